/**
 * The `reschedule` strategy reads and updates graphile-worker's private job tables. Those are not public
 * API, so the same scenarios run here against graphile-worker 0.17.3 (the rest of the suite runs 0.18).
 */
import { randomBytes } from "node:crypto";
import * as gw17 from "graphile-worker-0.17";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, inject, it } from "vitest";
import { makeLocks, type Locks } from "../../src/index.js";
import { databaseUrl } from "../../scripts/postgres.js";
import { dropDatabase, withAdmin } from "../support/admin.js";
import { waitFor } from "../support/db.js";

const name = `gwl_c17_${randomBytes(5).toString("hex")}`;
let url: string;
let pool: pg.Pool;
let locks: Locks;
let runner: gw17.Runner | undefined;

const admin = <T>(fn: (client: pg.Client) => Promise<T>) => withAdmin(inject("baseUrl"), fn);
const quiet = new gw17.Logger(() => () => undefined);

/** A graphile-worker 0.17 runner of `taskList` on the file's database: concurrency 2, polling every 50 ms. */
const run17 = (taskList: gw17.TaskList) =>
  gw17.run({
    connectionString: url,
    concurrency: 2,
    taskList,
    noHandleSignals: true,
    pollInterval: 50,
    logger: quiet,
  });

beforeAll(async () => {
  await admin((c) => c.query(`create database ${name} template template0`));
  url = databaseUrl(inject("baseUrl"), name);
  await gw17.runMigrations({ connectionString: url, logger: quiet });
  pool = new pg.Pool({ connectionString: url });
  // The database is dropped with force at the end: a backend it terminates under a client the pool has not
  // closed yet must not crash the test worker with an unhandled 'error' event (seen once in CI's Node 24 run).
  pool.on("error", () => undefined);
  pool.on("connect", (client) => client.on("error", () => undefined));
  locks = makeLocks({ pgPool: pool, logger: quiet as never });
  await locks.migrate();
});

afterAll(async () => {
  await runner?.stop();
  await locks?.release();
  const { rows } = await pool.query<{ n: number }>(
    "select count(*)::int as n from pg_locks where locktype = 'advisory' and database = (select oid from pg_database where datname = current_database())",
  );
  await pool?.end();
  await admin((c) => dropDatabase(c, name));
  expect(rows[0]!.n).toBe(0);
});

describe("graphile-worker 0.17.3", () => {
  it("the version under test really is 0.17", async () => {
    const { rows } = await pool.query<{ id: number }>(
      "select max(id) as id from graphile_worker.migrations",
    );
    expect(rows[0]!.id).toBe(19); // 0.18.0 adds migration 20
  });

  it("reschedule replaces a conflicting job by a copy that keeps attempts, job key and options, and runs it later", async () => {
    const ran: number[] = [];
    const task = locks.exclusive(
      "later",
      async (_p: { id: number }, helpers) => void ran.push(helpers.job.attempts),
      {
        onConflict: "reschedule",
        reschedule: { minDelay: 50, maxDelay: 100 },
      },
    );
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    await holder.query("select pg_advisory_lock($1)", [task.lockKey({ id: 1 }).toString()]);
    const { job } = await task.addJob(
      { id: 1 },
      { jobKey: "k1", queueName: "q", priority: 2, maxAttempts: 5, preemptive: false },
    );
    const rescheduled = new Promise<string>((resolve) =>
      locks.events.once("job:rescheduled", (e) => resolve(e.newJobId)),
    );
    runner = await run17({ later: task as unknown as gw17.Task });
    const newId = await rescheduled;
    const rows = await waitFor(
      async () => {
        const r = await pool.query<{
          id: string;
          attempts: number;
          key: string | null;
          max_attempts: number;
          priority: number;
          queue_name: string | null;
        }>(
          "select id::text, attempts, key, max_attempts, priority, queue_name from graphile_worker.jobs",
        );
        // (a copy may be running at that moment, and be parked again: wait for a waiting one)
        return r.rows.length === 1 && r.rows[0]!.id !== job!.id && r.rows[0]!.attempts === 0
          ? r.rows
          : null;
      },
      { message: "the copy alone to remain" },
    );
    expect(rows[0]!.id).not.toBe(job!.id);
    expect([
      rows[0]!.attempts,
      rows[0]!.key,
      rows[0]!.max_attempts,
      rows[0]!.priority,
      rows[0]!.queue_name,
    ]).toEqual([0, "k1", 5, 2, "q"]);
    expect(Number(newId)).toBeGreaterThan(Number(job!.id));
    await holder.end();
    await waitFor(async () => ran.length === 1, { message: "the job to run once the key is free" });
    expect(ran).toEqual([1]);
    await runner.stop();
    runner = undefined;
  });

  it("a crash between the copy and the completion neither loses nor duplicates the job", async () => {
    const { job } = await locks.addJob("crashy", { id: 2 }, { preemptive: false });
    await pool.query(
      "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'dead', attempts = attempts + 1 where id = $1",
      [job!.id],
    );
    const { rows } = await pool.query<{ id: string }>(
      "select graphile_worker_locks.reschedule_job($1, now())::text as id",
      [job!.id],
    );
    const utils = await gw17.makeWorkerUtils({ connectionString: url, logger: quiet });
    await utils.forceUnlockWorkers(["dead"]);
    await utils.release();
    const ran: string[] = [];
    const task = locks.exclusive("crashy", async (_p, helpers) => void ran.push(helpers.job.id));
    runner = await run17({ crashy: task as unknown as gw17.Task });
    await waitFor(async () => ran.length === 1, { message: "the copy to run" });
    await new Promise((r) => setTimeout(r, 300));
    expect(ran).toEqual([rows[0]!.id]);
    await runner.stop();
    runner = undefined;
  });

  it("unique jobs: scopes, windows, replace and bulk write graphile-worker 0.17's tables correctly", async () => {
    await pool.query("delete from graphile_worker._private_jobs");
    const first = await locks.addJob(
      "u17",
      { k: 1 },
      { unique: "queued", queueName: "q17", flags: ["f"] },
    );
    const dup = await locks.addJob("u17", { k: 1 }, { unique: "queued" });
    expect([first.outcome, dup.outcome]).toEqual(["added", "duplicate"]);
    expect(dup.job!.id).toBe(first.job!.id);
    const replaced = await locks.addJob(
      "u17",
      { k: 1 },
      { unique: "queued", onDuplicate: "replace", priority: 4 },
    );
    expect(replaced.outcome).toBe("replaced");
    const row = (
      await pool.query<{
        queue_name: string;
        flags: Record<string, true>;
        priority: number;
        key: string;
      }>("select queue_name, flags, priority, key from graphile_worker.jobs where id = $1", [
        first.job!.id,
      ])
    ).rows[0]!;
    expect(row).toMatchObject({
      queue_name: "q17",
      flags: { f: true, "gwl:unique:queued": true },
      priority: 4,
    });
    expect(row.key).toMatch(/^gwl:u:[0-9a-f]{64}$/);
    // Once it starts (as a 0.17 worker marks it), a duplicate is accepted and the running job keeps running.
    await pool.query(
      "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1 where id = $1",
      [first.job!.id],
    );
    expect((await locks.addJob("u17", { k: 1 }, { unique: "queued" })).outcome).toBe("added");
    expect((await locks.addJob("w17", { k: 1 }, { uniqueFor: 60 })).outcome).toBe("added");
    expect((await locks.addJob("w17", { k: 1 }, { uniqueFor: 60 })).outcome).toBe("duplicate");
    const bulk = await locks.addJobs([
      { identifier: "b17", payload: { k: 1 }, unique: "active" },
      { identifier: "b17", payload: { k: 1 }, unique: "active" },
      { identifier: "b17", payload: { k: 2 } },
    ]);
    expect(bulk.map((r) => r.outcome)).toEqual(["added", "duplicate", "added"]);
    // And a 0.17 runner runs them.
    const ran: string[] = [];
    runner = await run17({ b17: async (p: unknown) => void ran.push(JSON.stringify(p)) });
    await waitFor(async () => ran.length === 2, { message: "the bulk jobs to run" });
    await runner.stop();
    runner = undefined;
    await pool.query("delete from graphile_worker._private_jobs");
  });
});
