/**
 * The version guard: the library writes into graphile-worker's private job table, so it runs only on the
 * migration levels of the graphile-worker versions it is tested with, unless told otherwise.
 */
// (not "graphile-worker", which TEST_GRAPHILE_WORKER=0.17 sends to 0.17: see test/support/graphile-worker.ts)
import * as gw18 from "graphile-worker-0.18";
import * as gw17 from "graphile-worker-0.17";
import { describe, expect, it } from "vitest";
import {
  ErrorCodes,
  makeLocks,
  migrate,
  TESTED_WORKER_SCHEMAS,
  UntestedWorkerSchemaError,
} from "../src/index.js";
import { quietLogger } from "./support/runner.js";
import { useScratchDatabases } from "./support/scratch.js";

const scratch = useScratchDatabases();

async function levelOf(url: string): Promise<number> {
  const { rows } = await scratch
    .pool(url)
    .query<{ level: number }>("select max(id)::int as level from graphile_worker.migrations");
  return rows[0]!.level;
}

async function libraryInstalled(url: string): Promise<boolean> {
  const { rows } = await scratch
    .pool(url)
    .query<{ ok: boolean }>(
      "select to_regclass('graphile_worker_locks.migrations') is not null as ok",
    );
  return rows[0]!.ok;
}

describe("graphile-worker's migration level", () => {
  it("0.17.3's schema is at the level the guard names for it, and passes", async () => {
    const url = await scratch.create();
    await gw17.runMigrations({
      connectionString: url,
      logger: new gw17.Logger(() => () => undefined),
    });
    expect(await levelOf(url)).toBe(
      TESTED_WORKER_SCHEMAS.find((t) => t.version === "0.17.3")!.level,
    );
    const locks = makeLocks({ connectionString: url, logger: quietLogger });
    try {
      const { outcome } = await locks.addJob("t", { a: 1 }, { unique: "queued" });
      expect(outcome).toBe("added");
    } finally {
      await locks.release();
    }
  });

  it("0.18's schema is at the level the guard names for it, and passes", async () => {
    const url = await scratch.create();
    await gw18.runMigrations({ connectionString: url, logger: quietLogger });
    expect(await levelOf(url)).toBe(
      TESTED_WORKER_SCHEMAS.find((t) => t.version === "0.18.0")!.level,
    );
    await migrate({ pgPool: scratch.pool(url) });
    expect(await libraryInstalled(url)).toBe(true);
  });

  it("a level it was not tested with is refused by every entry point, with what is supported, before anything is written", async () => {
    const url = await scratch.create();
    await gw18.runMigrations({ connectionString: url, logger: quietLogger });
    const pool = scratch.pool(url);
    const next = (await levelOf(url)) + 1;
    await pool.query("insert into graphile_worker.migrations (id) values ($1)", [next]);

    const error = await migrate({ pgPool: pool }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UntestedWorkerSchemaError);
    const untested = error as UntestedWorkerSchemaError;
    expect(untested.code).toBe(ErrorCodes.WORKER_SCHEMA_UNTESTED);
    expect(untested.level).toBe(next);
    expect(untested.message).toContain(`migration ${next}`);
    expect(untested.message).toContain("graphile-worker 0.17.3 (migration 19)");
    expect(untested.message).toContain("graphile-worker 0.18.0 (migration 20)");
    expect(untested.message).toContain("allowUntestedWorkerSchema");

    const locks = makeLocks({ connectionString: url, logger: quietLogger });
    try {
      const task = locks.exclusive("t", async () => undefined);
      for (const call of [
        () => task.addJob({ a: 1 }),
        () => locks.addJob("t", { a: 1 }, { unique: "queued" }),
        () => locks.addJobs([{ identifier: "t", payload: {} }]),
        () => locks.lockAvailable("t", { a: 1 }),
        () => locks.connect(),
      ]) {
        await expect(call()).rejects.toBeInstanceOf(UntestedWorkerSchemaError);
      }
    } finally {
      await locks.release();
    }
    expect(await libraryInstalled(url)).toBe(false);
    const { rows } = await pool.query<{ n: number }>(
      "select count(*)::int as n from graphile_worker._private_jobs",
    );
    expect(rows[0]!.n).toBe(0);
  });

  it("`allowUntestedWorkerSchema: true` goes ahead, with a warning", async () => {
    const url = await scratch.create();
    await gw18.runMigrations({ connectionString: url, logger: quietLogger });
    const pool = scratch.pool(url);
    await pool.query("insert into graphile_worker.migrations (id) values ($1)", [
      (await levelOf(url)) + 1,
    ]);
    const warnings: string[] = [];
    const logger = new gw18.Logger(() => (level, message) => {
      if (level === "warning") warnings.push(message);
    });
    const locks = makeLocks({ connectionString: url, logger, allowUntestedWorkerSchema: true });
    try {
      const { outcome } = await locks.addJob("t", { a: 1 }, { unique: "queued" });
      expect(outcome).toBe("added");
    } finally {
      await locks.release();
    }
    expect(warnings.some((w) => w.includes("not tested with"))).toBe(true);
    await expect(
      migrate({ pgPool: pool, allowUntestedWorkerSchema: true }),
    ).resolves.toBeUndefined();
  });
});
