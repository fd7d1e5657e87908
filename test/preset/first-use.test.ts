/**
 * Every entry point installs the library's schema on first use, on a database where only graphile-worker's
 * schema is: the README's snippets run as written there. On a database without graphile-worker's schema,
 * every entry point names that schema as the one missing, and writes nothing.
 */
import { rm } from "node:fs/promises";
import { runMigrations } from "graphile-worker";
import { afterAll, describe, expect, it } from "vitest";
import { ErrorCodes, makeLocks, type Locks } from "../../src/index.js";
import { expectedOutput, readmeSnippets, runSnippet } from "../support/readme.js";
import { quietLogger } from "../support/runner.js";
import { LATEST_MIGRATION, useScratchDatabases } from "../support/scratch.js";

const scratch = useScratchDatabases();
const dir = new URL("../.readme-fresh/", import.meta.url);
const instances: Locks[] = [];
afterAll(async () => {
  for (const locks of instances) await locks.release();
  await rm(dir, { recursive: true, force: true });
});

/** A database with graphile-worker's schema only. */
async function workerOnlyDatabase(): Promise<string> {
  const url = await scratch.create();
  await runMigrations({ connectionString: url, logger: quietLogger });
  return url;
}

function locksOn(url: string, schema?: string): Locks {
  const locks = makeLocks({
    connectionString: url,
    logger: quietLogger,
    ...(schema ? { schema } : {}),
  });
  instances.push(locks);
  return locks;
}

/** Each entry point, as a user's first call on a `Locks` instance. */
const entryPoints: Array<[string, (locks: Locks) => Promise<unknown>]> = [
  ["addJob of a `drop` task", (l) => l.exclusive("t_drop", async () => undefined).addJob({ a: 1 })],
  [
    "addJob of a `reschedule` task",
    (l) =>
      l
        .exclusive("t_resched", async () => undefined, { onConflict: "reschedule" })
        .addJob({ a: 1 }),
  ],
  [
    "addJob of a `drop` task with `preemptive: false`",
    (l) => l.exclusive("t_np", async () => undefined).addJob({ a: 1 }, { preemptive: false }),
  ],
  ["locks.addJob of a task not defined here", (l) => l.addJob("t_undefined", { a: 1 })],
  [
    "locks.addJob with the caller's job key",
    (l) => l.addJob("t_keyed", { a: 1 }, { jobKey: "k", preemptive: true }),
  ],
  ["a unique addJob", (l) => l.addJob("t_unique", { a: 1 }, { unique: "queued" })],
  ["addJobs", (l) => l.addJobs([{ identifier: "t_bulk", payload: { a: 1 } }])],
  ["lockAvailable", (l) => l.lockAvailable("t_avail", { a: 1 })],
  ["heldLocks", (l) => l.heldLocks()],
  ["sweep", (l) => l.sweep()],
  ["connect", (l) => l.connect()],
];

describe("on a database with graphile-worker's schema only", () => {
  readmeSnippets.forEach((snippet, index) => {
    it(`README snippet ${index + 1} runs as written and prints what its comments say`, async () => {
      const url = await workerOnlyDatabase();
      const printed = await runSnippet(snippet, url, dir, `fresh-${index + 1}`);
      expect(printed).toEqual(expectedOutput(snippet));
    });
  });

  it("every entry point installs the library's schema first", async () => {
    const url = await workerOnlyDatabase();
    const pool = scratch.pool(url);
    for (const [index, [name, call]] of entryPoints.entries()) {
      const schema = `gwl_first_${index}`;
      await expect(call(locksOn(url, schema)), name).resolves.not.toThrow();
      const { rows } = await pool.query<{ level: number }>(
        `select max(id)::int as level from ${schema}.migrations`,
      );
      expect(rows[0]!.level, name).toBe(LATEST_MIGRATION);
    }
  });
});

describe("on a database without graphile-worker's schema", () => {
  it("every entry point rejects naming graphile-worker's schema, and creates nothing", async () => {
    const url = await scratch.create();
    const pool = scratch.pool(url);
    for (const [name, call] of entryPoints) {
      const error = await call(locksOn(url)).then(
        () => null,
        (e: unknown) => e as { code?: string; message?: string },
      );
      expect(error, name).not.toBeNull();
      expect(error!.code, `${name}: ${error!.message}`).toBe(ErrorCodes.SCHEMA_MISSING);
      expect(error!.message, name).toContain("graphile-worker's schema 'graphile_worker'");
    }
    const { rows } = await pool.query<{ n: number }>(
      "select count(*)::int as n from pg_namespace where nspname like 'graphile_worker%'",
    );
    expect(rows[0]!.n).toBe(0);
  });
});
