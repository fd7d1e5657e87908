/**
 * Schema names are used exactly as given, whatever characters they hold: `$` patterns, quotes, a dollar-quote
 * delimiter, a line break. Migrate, enqueue, lock and introspect under such names, graphile-worker's schema
 * included (with the characters graphile-worker itself accepts).
 */
import { runMigrations } from "graphile-worker";
import { afterAll, describe, expect, it } from "vitest";
import { InvalidArgumentError, makeLocks, migrate, type Locks } from "../src/index.js";
import { escapeIdentifier } from "../src/sql.js";
import { deferred, waitFor } from "./support/db.js";
import { quietLogger, startRunner } from "./support/runner.js";
import { MIGRATIONS, useScratchDatabases } from "./support/scratch.js";

const scratch = useScratchDatabases();
const instances: Locks[] = [];
afterAll(async () => {
  for (const locks of instances) await locks.release();
});

/** Library schema names, each a trap for one way of building SQL text. */
const NAMES = [
  `gwl$$x'$&"y`,
  "gwl$'after",
  "gwl$`before",
  "gwl$1$2",
  "$gwl$",
  "gwl\n-- not a comment",
  "Gwl Mixed Case ; drop table x",
];
/** graphile-worker's own migrations replace its placeholder with a replacement string: no `$` here. */
const WORKER_SCHEMA = `gw "w'x`;

async function schemasIn(url: string): Promise<string[]> {
  const { rows } = await scratch
    .pool(url)
    .query<{ nspname: string }>("select nspname from pg_namespace order by nspname");
  return rows.map((r) => r.nspname);
}

describe("schema names", () => {
  it("a library schema with any characters: migrate, enqueue (single, unique, bulk), introspect", async () => {
    const url = await scratch.create();
    await runMigrations({ connectionString: url, logger: quietLogger });
    for (const schema of NAMES) {
      await migrate({ pgPool: scratch.pool(url), schema });
      const locks = makeLocks({ connectionString: url, schema, logger: quietLogger });
      instances.push(locks);
      const task = locks.exclusive("names", async () => undefined);
      expect((await task.addJob({ schema })).outcome, schema).toBe("added");
      const first = await locks.addJob("names_u", { schema }, { unique: "queued", uniqueFor: 60 });
      const again = await locks.addJob("names_u", { schema }, { unique: "queued" });
      expect([first.outcome, again.outcome, again.job?.id === first.job?.id], schema).toEqual([
        "added",
        "duplicate",
        true,
      ]);
      const bulk = await locks.addJobs([
        { identifier: "names_w", payload: { schema }, uniqueFor: 60 },
        { identifier: "names_w", payload: { schema }, uniqueFor: 60 },
      ]);
      expect(
        bulk.map((r) => r.outcome),
        schema,
      ).toEqual(["added", "duplicate"]);
      expect(await locks.sweep(), schema).toBe(0);
      expect(await locks.lockAvailable("names", { schema }), schema).toBe(true);
      expect(await locks.heldLocks(), schema).toEqual([]);
    }
    const present = await schemasIn(url);
    for (const schema of NAMES) expect(present, schema).toContain(schema);
    // Each schema has every migration, under its own name and nowhere else.
    const pool = scratch.pool(url);
    for (const schema of NAMES) {
      const { rows } = await pool.query<{ n: number }>(
        `select count(*)::int as n from ${escapeIdentifier(schema)}.migrations`,
      );
      expect(rows[0]!.n, schema).toBe(MIGRATIONS.length);
    }
  });

  it("graphile-worker's schema with quotes and a space: exclusive jobs run, lock and show in heldLocks", async () => {
    const url = await scratch.create();
    await runMigrations({ connectionString: url, schema: WORKER_SCHEMA, logger: quietLogger });
    const schema = NAMES[0]!;
    const locks = makeLocks({
      connectionString: url,
      schema,
      workerSchema: WORKER_SCHEMA,
      logger: quietLogger,
    });
    instances.push(locks);
    const running = deferred();
    const finish = deferred();
    const task = locks.exclusive(
      "odd",
      async () => {
        running.resolve();
        await finish.promise;
      },
      { onConflict: "reschedule", reschedule: { minDelay: 50, maxDelay: 100 } },
    );
    await task.addJob({ k: 1 });
    const unique = await locks.addJob("odd_u", { k: 1 }, { unique: "active" });
    expect(unique.outcome).toBe("added");
    const runner = await startRunner({
      connectionString: url,
      schema: WORKER_SCHEMA,
      concurrency: 2,
      taskList: { odd: task, odd_u: async () => undefined },
    });
    try {
      await running.promise;
      expect(await task.lockAvailable({ k: 1 })).toBe(false);
      const held = await waitFor(async () => {
        const rows = await locks.heldLocks();
        return rows.find((r) => r.lockKey === task.lockKey({ k: 1 }) && r.taskIdentifier === "odd");
      });
      expect(held.taskIdentifier).toBe("odd");
      // A second job of the key parks (the reschedule strategy writes graphile-worker's table).
      await task.addJob({ k: 1 });
      await waitFor(async () => (await parkedCount(url)) > 0, {
        message: "the second job to park",
      });
      finish.resolve();
      await waitFor(async () => (await jobCount(url)) === 0, { message: "every job to finish" });
    } finally {
      finish.resolve();
      await runner.stop();
    }
    expect(await task.lockAvailable({ k: 1 })).toBe(true);
  });

  it("names PostgreSQL would cut short or cannot hold are refused before anything is written", () => {
    const long = "s".repeat(64);
    expect(() => makeLocks({ connectionString: "postgres://x", schema: long })).toThrow(
      InvalidArgumentError,
    );
    expect(() =>
      makeLocks({ connectionString: "postgres://x", workerSchema: "é".repeat(32) }),
    ).toThrow(/`workerSchema` is 64 bytes long/);
    expect(() => makeLocks({ connectionString: "postgres://x", schema: "" })).toThrow(
      /`schema` must be a non-empty string/,
    );
    expect(() => makeLocks({ connectionString: "postgres://x", schema: "a\0b" })).toThrow(/NUL/);
    expect(() =>
      makeLocks({ connectionString: "postgres://x", schema: "s".repeat(63) }),
    ).not.toThrow();
  });
});

async function jobCount(url: string): Promise<number> {
  const { rows } = await scratch
    .pool(url)
    .query<{ n: number }>(
      `select count(*)::int as n from ${escapeIdentifier(WORKER_SCHEMA)}._private_jobs`,
    );
  return rows[0]!.n;
}

async function parkedCount(url: string): Promise<number> {
  const { rows } = await scratch
    .pool(url)
    .query<{ n: number }>(`select count(*)::int as n from ${escapeIdentifier(NAMES[0]!)}.waiters`);
  return rows[0]!.n;
}
