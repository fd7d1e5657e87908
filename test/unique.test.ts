/**
 * Unique jobs against real PostgreSQL: scopes, windows, keys, duplicate strategies, races on separate
 * connections, callers' transactions, bulk, bounded state, and a scope x outcome matrix with real runners.
 */
import { createHash } from "node:crypto";
import { makeWorkerUtils, type Job, type Runner, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  UniqueConflictError,
  makeLocks,
  uniqueJobKey,
  uniqueKeyMaterial,
  type Locks,
  type UniqueScope,
} from "../src/index.js";
import { deferred, useTestDatabase, waitFor, type Deferred } from "./support/db.js";
import { countEvents, nextEvent, quietLogger, startRunner } from "./support/runner.js";

const db = useTestDatabase();
let utils: WorkerUtils;
let locks: Locks;
const cleanups: Array<() => Promise<unknown>> = [];

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url, logger: quietLogger });
  locks = makeLocks({ connectionString: db.url, logger: quietLogger });
});
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  await db
    .pool()
    .query(
      "delete from graphile_worker._private_jobs; delete from graphile_worker_locks.unique_windows",
    );
});
afterAll(async () => {
  await locks?.release();
  await utils?.release();
});

async function client(): Promise<pg.Client> {
  const c = new pg.Client({ connectionString: db.url });
  await c.connect();
  cleanups.push(() => c.end());
  return c;
}
async function jobCount(where = "true"): Promise<number> {
  const { rows } = await db
    .pool()
    .query<{ n: number }>(`select count(*)::int as n from graphile_worker.jobs where ${where}`);
  return rows[0]!.n;
}
/** Waits until `pid` is blocked on a lock (so a race is really happening, not just sequential calls). */
async function blocked(pid: number): Promise<void> {
  await waitFor(
    async () => {
      const { rows } = await db
        .pool()
        .query("select 1 from pg_locks where pid = $1 and not granted", [pid]);
      return rows.length > 0;
    },
    { message: `backend ${pid} to wait on a lock` },
  );
}
const pidOf = (c: pg.Client) => (c as unknown as { processID: number }).processID;

describe("keys", () => {
  it("are pinned, versioned, and ignore key order", () => {
    expect(uniqueKeyMaterial("send_email", { to: "a@b.c", template: "welcome" }, null)).toBe(
      'gwl:v1:unique:"send_email":*:{"template":"welcome","to":"a@b.c"}',
    );
    expect(uniqueJobKey("send_email", { to: "a@b.c", template: "welcome" }, null)).toBe(
      "gwl:u:d7414e1aecd63397729622092c78df88ec136e9d2a81ba5a2215bfd9da75fc28",
    );
    for (const payload of [{ a: 1 }, { name: "名前 🙂" }, null]) {
      const hex = createHash("sha256")
        .update(uniqueKeyMaterial("t", payload, null), "utf8")
        .digest("hex");
      expect(uniqueJobKey("t", payload, null)).toBe(`gwl:u:${hex}`);
    }
    expect(uniqueJobKey("t", { a: 1, b: 2 }, null)).toBe(uniqueJobKey("t", { b: 2, a: 1 }, null));
    expect(uniqueJobKey("t", { a: 1 }, "q1")).not.toBe(uniqueJobKey("t", { a: 1 }, null));
  });

  it("subset keys, time buckets, groups shared across tasks, the queue name, and bypass", async () => {
    const email = locks.unique("email", async () => undefined, {
      unique: "queued",
      uniqueKey: (p: { user: number; at?: string }) => ({ user: p.user }),
    });
    expect((await email.addJob({ user: 1, at: "x" })).outcome).toBe("added");
    expect((await email.addJob({ user: 1, at: "y" })).outcome).toBe("duplicate");
    expect((await email.addJob({ user: 2, at: "y" })).outcome).toBe("added");

    // Zizq's hourly bucket: the key includes the hour of enqueue.
    const hourly = (hour: number) =>
      locks.addJob(
        "digest",
        { list: 9 },
        { unique: "queued", uniqueKey: (p: { list: number }) => ({ ...p, hour }) },
      );
    expect((await hourly(13)).outcome).toBe("added");
    expect((await hourly(13)).outcome).toBe("duplicate");
    expect((await hourly(14)).outcome).toBe("added");

    // One key across two tasks.
    locks.define("push", {
      unique: "active",
      uniqueGroup: "notify",
      uniqueKey: (p: { user: number }) => p.user,
    });
    locks.define("sms", {
      unique: "active",
      uniqueGroup: "notify",
      uniqueKey: (p: { user: number }) => p.user,
    });
    const first = await locks.addJob("push", { user: 5 });
    const second = await locks.addJob("sms", { user: 5, text: "hi" });
    expect(second.outcome).toBe("duplicate");
    expect(second.job!.id).toBe(first.job!.id);
    expect(second.job!.task_identifier).toBe("push");

    // Faktory: the queue is part of the key only when asked.
    expect(
      (await locks.addJob("q", { a: 1 }, { unique: "queued", queueName: "one" })).outcome,
    ).toBe("added");
    expect(
      (await locks.addJob("q", { a: 1 }, { unique: "queued", queueName: "two" })).outcome,
    ).toBe("duplicate");
    const byQueue = { unique: "queued", uniqueByQueue: true } as const;
    expect((await locks.addJob("qq", { a: 1 }, { ...byQueue, queueName: "one" })).outcome).toBe(
      "added",
    );
    expect((await locks.addJob("qq", { a: 1 }, { ...byQueue, queueName: "two" })).outcome).toBe(
      "added",
    );

    // Bypass for one enqueue.
    expect((await email.addJob({ user: 1 }, { unique: false })).outcome).toBe("added");
    expect(await jobCount("task_identifier = 'email'")).toBe(3);
  });
});

describe("duplicates", () => {
  it("reject (default) returns the existing job untouched, with an event, and writes nothing", async () => {
    const events = countEvents(locks, ["enqueue:duplicate"]);
    const first = await locks.addJob(
      "r",
      { n: 1, v: "first" },
      { unique: "active", uniqueKey: (p: { n: number }) => p.n },
    );
    const before = await db.pool().query("select revision, updated_at from graphile_worker.jobs");
    const dup = await locks.addJob(
      "r",
      { n: 1, v: "second" },
      { unique: "active", uniqueKey: (p: { n: number }) => p.n },
    );
    expect(dup.outcome).toBe("duplicate");
    expect(dup.job!.id).toBe(first.job!.id);
    // The existing job's own data, not the caller's (BullMQ's misleading return).
    expect(dup.job!.payload).toEqual({ n: 1, v: "first" });
    expect(events["enqueue:duplicate"]).toBe(1);
    const after = await db.pool().query("select revision, updated_at from graphile_worker.jobs");
    expect(after.rows).toEqual(before.rows);
  });

  it("raise throws UniqueConflictError carrying the existing job", async () => {
    const first = await locks.addJob("x", { n: 1 }, { unique: "queued" });
    const error = await locks
      .addJob("x", { n: 1 }, { unique: "queued", onDuplicate: "raise" })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UniqueConflictError);
    expect((error as UniqueConflictError).code).toBe("GWL_UNIQUE_CONFLICT");
    expect((error as UniqueConflictError).existingJob!.id).toBe(first.job!.id);
    expect(await jobCount()).toBe(1);
  });

  it("replace updates payload, runAt and priority while the job waits, and never a started job", async () => {
    const replaced = countEvents(locks, ["enqueue:replaced"]);
    const opts = {
      unique: "active",
      onDuplicate: "replace",
      uniqueKey: (p: { n: number }) => p.n,
    } as const;
    const first = await locks.addJob("rp", { n: 1, v: 1 }, opts);
    const runAt = new Date(Date.now() + 3_600_000);
    const second = await locks.addJob("rp", { n: 1, v: 2 }, { ...opts, runAt, priority: 5 });
    expect(second.outcome).toBe("replaced");
    expect(second.job!.id).toBe(first.job!.id);
    expect(second.job!.payload).toEqual({ n: 1, v: 2 });
    expect(second.job!.priority).toBe(5);
    expect(second.job!.run_at.getTime()).toBe(runAt.getTime());
    expect(replaced["enqueue:replaced"]).toBe(1);
    // As a worker does when it takes the job:
    await db
      .pool()
      .query(
        "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1",
      );
    const third = await locks.addJob("rp", { n: 1, v: 3 }, opts);
    expect(third.outcome).toBe("duplicate");
    expect(third.job!.payload).toEqual({ n: 1, v: 2 });
  });
});

describe("race-free", () => {
  for (const scope of ["queued", "active", "exists"] as const) {
    it(`50 concurrent enqueuers of one key on separate connections give exactly one job (${scope})`, async () => {
      const clients = await Promise.all(Array.from({ length: 50 }, () => client()));
      const start = deferred();
      const results = Promise.all(
        clients.map(async (c, i) => {
          await start.promise;
          return locks.addJob(
            "race",
            { k: scope, from: i },
            { unique: scope, pgClient: c, uniqueKey: (p: { k: string }) => p.k },
          );
        }),
      );
      start.resolve();
      const outcomes = await results;
      expect(outcomes.filter((r) => r.outcome === "added")).toHaveLength(1);
      expect(outcomes.filter((r) => r.outcome === "duplicate")).toHaveLength(49);
      expect(new Set(outcomes.map((r) => r.job!.id)).size).toBe(1);
      expect(await jobCount()).toBe(1);
    });
  }

  it("a window alone is race-free too", async () => {
    const clients = await Promise.all(Array.from({ length: 30 }, () => client()));
    const outcomes = await Promise.all(
      clients.map((c) => locks.addJob("win", { k: 1 }, { uniqueFor: 60, pgClient: c })),
    );
    expect(outcomes.filter((r) => r.outcome === "added")).toHaveLength(1);
    expect(await jobCount()).toBe(1);
  });

  it("an enqueuer that rolls back never makes another enqueuer's job disappear", async () => {
    const a = await client();
    const b = await client();
    await a.query("begin");
    expect((await locks.addJob("rb", { k: 1 }, { unique: "active", pgClient: a })).outcome).toBe(
      "added",
    );
    const pendingB = locks.addJob("rb", { k: 1 }, { unique: "active", pgClient: b });
    await blocked(pidOf(b));
    await a.query("rollback");
    const resultB = await pendingB;
    expect(resultB.outcome).toBe("added");
    expect(await jobCount()).toBe(1);
    const { rows } = await db
      .pool()
      .query<{ id: string }>("select id::text from graphile_worker.jobs");
    expect(rows[0]!.id).toBe(resultB.job!.id);
  });

  it("inside callers' transactions: READ COMMITTED waits and answers duplicate, never two jobs", async () => {
    const a = await client();
    const b = await client();
    await a.query("begin");
    await b.query("begin isolation level read committed");
    const added = await locks.addJob("tx", { k: 1 }, { unique: "queued", pgClient: a });
    const pendingB = locks.addJob("tx", { k: 1 }, { unique: "queued", pgClient: b });
    await blocked(pidOf(b));
    await a.query("commit");
    const dup = await pendingB;
    expect(dup.outcome).toBe("duplicate");
    expect(dup.job!.id).toBe(added.job!.id);
    await b.query("commit");
    expect(await jobCount()).toBe(1);
  });

  it("inside callers' transactions: REPEATABLE READ gets a clear serialization error, never two jobs", async () => {
    const a = await client();
    const b = await client();
    await b.query("begin isolation level repeatable read");
    await b.query("select 1"); // b's snapshot is taken now, before a's job exists
    await a.query("begin");
    await locks.addJob("rr", { k: 1 }, { unique: "active", pgClient: a });
    const pendingB = locks
      .addJob("rr", { k: 1 }, { unique: "active", pgClient: b })
      .catch((e: unknown) => e);
    await blocked(pidOf(b));
    await a.query("commit");
    const outcome = (await pendingB) as { code?: string };
    expect(outcome.code).toBe("40001");
    await b.query("rollback");
    // Committed after b's snapshot, so b can neither see it nor insert beside it: it must retry.
    const retry = await locks.addJob("rr", { k: 1 }, { unique: "active", pgClient: b });
    expect(retry.outcome).toBe("duplicate");
    expect(await jobCount()).toBe(1);
  });

  it("a job and its uniqueness are written in the caller's transaction, and vanish with its rollback", async () => {
    const a = await client();
    await a.query("begin");
    await a.query("create temp table my_write (x int)");
    await locks.addJob("t1", { k: 1 }, { unique: "exists", uniqueFor: 60, pgClient: a });
    await locks.addJob("t2", { k: 1 }, { uniqueFor: 60, pgClient: a });
    await a.query("rollback");
    expect(await jobCount()).toBe(0);
    const { rows } = await db.pool().query("select * from graphile_worker_locks.unique_windows");
    expect(rows).toEqual([]);
    expect((await locks.addJob("t2", { k: 1 }, { uniqueFor: 60 })).outcome).toBe("added");
  });
});

describe("windows (uniqueFor)", () => {
  const ago = (s: number) => new Date(Date.now() - s * 1000);
  const later = (s: number) => new Date(Date.now() + s * 1000);

  it("alone: refuses duplicates until it expires, even after the job is gone", async () => {
    const first = await locks.addJob("w", { k: 1 }, { uniqueFor: 600 });
    await utils.completeJobs([first.job!.id]);
    const dup = await locks.addJob("w", { k: 1 }, { uniqueFor: 600 });
    expect(dup).toEqual({ job: null, outcome: "duplicate" });
    // Counted from runAt: a window that started 20 s ago and lasts 10 s is over.
    expect((await locks.addJob("w", { k: 2 }, { uniqueFor: 10, runAt: ago(20) })).outcome).toBe(
      "added",
    );
    expect((await locks.addJob("w", { k: 2 }, { uniqueFor: 10 })).outcome).toBe("added");
    expect((await locks.addJob("w", { k: 2 }, { uniqueFor: 10 })).outcome).toBe("duplicate");
  });

  it("a scheduled delay counts: the window runs from runAt", async () => {
    await locks.addJob("w", { k: 3 }, { uniqueFor: 5, runAt: later(3600) });
    expect((await locks.addJob("w", { k: 3 }, { uniqueFor: 5 })).outcome).toBe("duplicate");
  });

  it("with a scope it bounds the scope", async () => {
    await locks.addJob("ws", { k: 1 }, { unique: "exists", uniqueFor: 10, runAt: ago(60) });
    expect((await locks.addJob("ws", { k: 1 }, { unique: "exists" })).outcome).toBe("added");
    expect(await jobCount("task_identifier = 'ws'")).toBe(2);
    await locks.addJob("ws", { k: 2 }, { unique: "exists", uniqueFor: 600 });
    expect((await locks.addJob("ws", { k: 2 }, { unique: "exists" })).outcome).toBe("duplicate");
  });
});

describe("bulk", () => {
  it("dedupes within the batch and against existing jobs in one statement, an outcome per item", async () => {
    const existing = await locks.addJob("b", { k: "old" }, { unique: "queued" });
    const counting = await client();
    let statements = 0;
    const counted = {
      query: (...args: Parameters<pg.Client["query"]>) => {
        statements++;
        return (counting.query as (...a: unknown[]) => unknown)(...args);
      },
    } as unknown as pg.Client;
    const results = await locks.addJobs(
      [
        { identifier: "b", payload: { k: "new" }, unique: "queued" },
        { identifier: "b", payload: { k: "old" }, unique: "queued" },
        { identifier: "b", payload: { k: "new" }, unique: "queued" },
        { identifier: "b", payload: { k: "plain" } },
        { identifier: "b", payload: { k: "plain" } },
        { identifier: "b", payload: { k: "win" }, uniqueFor: 60 },
        { identifier: "b", payload: { k: "win" }, uniqueFor: 60 },
      ],
      { pgClient: counted },
    );
    expect(statements).toBe(1);
    expect(results.map((r) => r.outcome)).toEqual([
      "added",
      "duplicate",
      "duplicate",
      "added",
      "added",
      "added",
      "duplicate",
    ]);
    expect(results[1]!.job!.id).toBe(existing.job!.id);
    expect(results[2]!.job!.id).toBe(results[0]!.job!.id);
    expect(results[6]!.job!.id).toBe(results[5]!.job!.id);
    expect(await jobCount()).toBe(5);
  });

  it("adds a small batch in the order given: ids ascend with the items, each result its own job", async () => {
    // (graphile-worker 0.18's add_jobs, planned as a hash join with no order, inserts a batch this small
    // last item first, and its addJobs then labels the jobs of a mixed batch with each other's tasks)
    const items = Array.from({ length: 6 }, (_, i) => ({
      identifier: i % 2 ? "ord_x" : "ord_y",
      payload: { i },
      ...(i === 4 ? { unique: "queued" as const } : {}),
    }));
    const results = await locks.addJobs(items);
    expect(results.map((r) => r.outcome)).toEqual(Array(6).fill("added"));
    const ids = results.map((r) => BigInt(r.job!.id));
    for (let i = 1; i < ids.length; i++) expect(ids[i]! > ids[i - 1]!).toBe(true);
    expect(results.map((r) => (r.job!.payload as { i: number }).i)).toEqual([0, 1, 2, 3, 4, 5]);
    expect(results.map((r) => r.job!.task_identifier)).toEqual(
      items.map((item) => item.identifier),
    );
    const { rows } = await db.pool().query<{ id: string; task_identifier: string; i: number }>(
      `select j.id::text, t.identifier as task_identifier, (j.payload->>'i')::int as i
       from graphile_worker._private_jobs j join graphile_worker._private_tasks t on t.id = j.task_id
       where j.id = any($1::bigint[]) order by j.id`,
      [ids.map(String)],
    );
    expect(rows.map((row) => row.i)).toEqual([0, 1, 2, 3, 4, 5]);
    expect(rows.map((row) => row.task_identifier)).toEqual(items.map((item) => item.identifier));
  });

  it("reads no more of the job table than the batch, however full the table is", async () => {
    // 20,000 jobs, analyzed. With them PostgreSQL once planned the read-back of a batch's rows as a hash join
    // or a merge join over the whole table. The batches run in one transaction, whose own reads of the job
    // table PostgreSQL counts (pg_stat_xact_user_tables: rows returned by sequential scans, and rows fetched
    // through indexes); they must stay within twice the items of the batches.
    await db.pool().query(
      `select count(*) from graphile_worker.add_jobs(array(
         select row('bulk_full', json_build_object('n', g), null, null, null, null, null, null)::graphile_worker.job_spec
         from generate_series(1, 20000) g))`,
    );
    await db.pool().query("analyze graphile_worker._private_jobs");
    const session = await client();
    const size = 1000;
    const plain = Array.from({ length: size }, (_, i) => ({
      identifier: "bulk_full",
      payload: { i },
    }));
    const unique = plain.map((item) => ({
      ...item,
      payload: { u: item.payload.i },
      unique: "active" as const,
    }));
    const batches = [plain, unique, [...plain.slice(0, 500), ...unique.slice(0, 500)]];
    await session.query("begin");
    for (const batch of batches) {
      const results = await locks.addJobs(batch, { pgClient: session });
      expect(results).toHaveLength(batch.length);
    }
    const { rows } = await session.query<{ seq: number; idx: number }>(
      `select coalesce(seq_tup_read, 0)::int as seq, coalesce(idx_tup_fetch, 0)::int as idx
       from pg_catalog.pg_stat_xact_user_tables
       where schemaname = 'graphile_worker' and relname = '_private_jobs'`,
    );
    await session.query("commit");
    expect(rows).toHaveLength(1);
    // 3,000 items read back once each, and each duplicate's holder: 3,500 rows. A scan of the table reads
    // more than 20,000.
    const items = batches.reduce((n, batch) => n + batch.length, 0);
    expect(rows[0]!.seq + rows[0]!.idx).toBeLessThanOrEqual(2 * items);
  });

  it("carries every spec field of a bulk item, set or left out, to the job it adds", async () => {
    const runAt = new Date(Date.now() + 3_600_000);
    const results = await locks.addJobs([
      {
        identifier: "bf",
        payload: { k: 1 },
        unique: "active",
        queueName: "bf-queue",
        runAt,
        priority: 3,
        maxAttempts: 4,
        flags: ["mine"],
      },
      { identifier: "bf2", payload: { k: 2 }, uniqueFor: 60, queueName: "bf-queue" },
      { identifier: "bf", payload: { k: 3 } },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "added", "added"]);
    expect(results.map((r) => r.job!.task_identifier)).toEqual(["bf", "bf2", "bf"]);
    const { rows: found } = await db.pool().query<{
      id: string;
      task_identifier: string;
      queue_name: string | null;
      run_at: Date;
      priority: number;
      max_attempts: number;
      flags: Record<string, unknown> | null;
      key: string | null;
    }>(
      `select id::text, task_identifier, queue_name, run_at, priority, max_attempts, flags, key
       from graphile_worker.jobs where id = any($1::bigint[])`,
      [results.map((r) => r.job!.id)],
    );
    const rows = results.map((r) => found.find((row) => row.id === r.job!.id)!);
    expect(rows[0]).toMatchObject({
      task_identifier: "bf",
      queue_name: "bf-queue",
      priority: 3,
      max_attempts: 4,
      flags: { mine: true, "gwl:unique:active": true },
    });
    expect(rows[0]!.run_at.getTime()).toBe(runAt.getTime());
    expect(rows[0]!.key).toMatch(/^gwl:u:[0-9a-f]{64}$/);
    // A window alone: no scope flag and no job key; the window is a row of its own, ending a minute from now.
    expect(rows[1]).toMatchObject({ task_identifier: "bf2", queue_name: "bf-queue", priority: 0 });
    expect(Object.keys(rows[1]!.flags ?? {}).filter((f) => f.startsWith("gwl:"))).toEqual([]);
    expect(rows[1]!.key).toBeNull();
    const windows = await db.pool().query<{ seconds: number }>(
      `select extract(epoch from expires_at - now())::float8 as seconds
         from graphile_worker_locks.unique_windows where job_id = $1::bigint`,
      [results[1]!.job!.id],
    );
    expect(windows.rows).toHaveLength(1);
    expect(windows.rows[0]!.seconds).toBeGreaterThan(50);
    expect(windows.rows[0]!.seconds).toBeLessThanOrEqual(60);
    // Nothing set: graphile-worker's defaults, no key, no flags.
    expect(rows[2]).toMatchObject({
      task_identifier: "bf",
      queue_name: null,
      priority: 0,
      max_attempts: 25,
      flags: null,
      key: null,
    });
    expect(Math.abs(rows[2]!.run_at.getTime() - Date.now())).toBeLessThan(60_000);
  });

  it("a holder out of its scope gives up its key to the batch; one in scope answers for every duplicate", async () => {
    const started = await locks.addJob("bs", { k: "started" }, { unique: "queued" });
    const waiting = await locks.addJob("bs", { k: "waiting" }, { unique: "queued" });
    const byK = (p: unknown) => (p as { k: string }).k;
    const replaceable = await locks.addJob(
      "bs",
      { k: "repl" },
      { unique: "queued", uniqueKey: byK },
    );
    // The first one has started: a `queued` job no longer refuses duplicates.
    await db
      .pool()
      .query(
        "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1 where id = $1",
        [started.job!.id],
      );
    const results = await locks.addJobs([
      { identifier: "bs", payload: { k: "waiting" }, unique: "queued" },
      { identifier: "bs", payload: { k: "started" }, unique: "queued" },
      { identifier: "bs", payload: { k: "waiting" }, unique: "active" },
      { identifier: "bs", payload: { k: "started" }, unique: "queued" },
      {
        identifier: "bs",
        payload: { k: "repl", v: 2 },
        unique: "queued",
        uniqueKey: byK,
        onDuplicate: "replace",
      },
    ]);
    expect(results.map((r) => r.outcome)).toEqual([
      "duplicate",
      "added",
      "duplicate",
      "duplicate",
      "replaced",
    ]);
    expect(results[0]!.job!.id).toBe(waiting.job!.id);
    expect(results[2]!.job!.id).toBe(waiting.job!.id);
    expect(results[1]!.job!.id).not.toBe(started.job!.id);
    expect(results[3]!.job!.id).toBe(results[1]!.job!.id);
    expect(results[4]!.job!.id).toBe(replaceable.job!.id);
    expect(results[4]!.job!.payload).toEqual({ k: "repl", v: 2 });
    // The started job keeps running without its key; the batch's job holds it now.
    const { rows } = await db
      .pool()
      .query<{ id: string; key: string | null }>(
        "select id::text, key from graphile_worker._private_jobs where id = any($1::bigint[]) order by id",
        [[started.job!.id, results[1]!.job!.id]],
      );
    expect(rows.map((r) => r.key === null)).toEqual([true, false]);
    expect(await jobCount()).toBe(4);
  });

  it("a duplicate's job is its holder, of whichever task, or null once a window outlived it", async () => {
    const holder = await locks.addJob(
      "bg_push",
      { user: 1 },
      { unique: "queued", uniqueGroup: "bg" },
    );
    const gone = await locks.addJob("bg_mail", { user: 2 }, { uniqueFor: 600 });
    await utils.completeJobs([gone.job!.id]);
    const items = [{ user: 3 }, { user: 1 }, { user: 2 }, { user: 4 }];
    const results = await locks.addJobs([
      { identifier: "bg_mail", payload: items[0], unique: "queued", uniqueGroup: "bg" },
      { identifier: "bg_mail", payload: items[1], unique: "queued", uniqueGroup: "bg" },
      { identifier: "bg_mail", payload: items[2], uniqueFor: 600 },
      { identifier: "bg_mail", payload: items[3] },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "duplicate", "duplicate", "added"]);
    expect(results[1]!.job!.id).toBe(holder.job!.id);
    expect(results[1]!.job!.task_identifier).toBe("bg_push");
    expect(results[1]!.job!.payload).toEqual({ user: 1 });
    expect(results[2]!.job).toBeNull();
    for (const i of [0, 3]) {
      expect(results[i]!.job!.task_identifier).toBe("bg_mail");
      expect(results[i]!.job!.payload).toEqual(items[i]);
    }
    // (every item added: one row each, in order, with nothing else in it; tasks and queues are named by
    // their place in the batch)
    const fresh = await locks.addJobs([
      { identifier: "bg_mail", payload: { user: 5 }, unique: "queued", queueName: "q2" },
      { identifier: "bg_push", payload: { user: 6 }, queueName: "q1" },
      { identifier: "bg_mail", payload: { user: 7 }, queueName: "q1" },
      { identifier: "bg_new", payload: { user: 8 } },
    ]);
    expect(fresh.map((r) => [r.outcome, r.job!.payload, r.job!.task_identifier])).toEqual([
      ["added", { user: 5 }, "bg_mail"],
      ["added", { user: 6 }, "bg_push"],
      ["added", { user: 7 }, "bg_mail"],
      ["added", { user: 8 }, "bg_new"],
    ]);
    const { rows: stored } = await db
      .pool()
      .query<{ task_identifier: string; queue_name: string }>(
        `select task_identifier, queue_name from graphile_worker.jobs where id = any($1::bigint[]) order by id`,
        [fresh.map((r) => r.job!.id)],
      );
    expect(stored.map((r) => [r.task_identifier, r.queue_name])).toEqual([
      ["bg_mail", "q2"],
      ["bg_push", "q1"],
      ["bg_mail", "q1"],
      ["bg_new", null],
    ]);
    expect(Object.keys(fresh[0]!.job!).sort()).toEqual(Object.keys(holder.job!).sort());
  });

  it("checks each holder inline: PostgreSQL inlines unique_job_blocks instead of calling it per row", async () => {
    // A SQL function with a subquery in its body is not inlined; called for each of a batch's duplicates,
    // its executor cost more than the check itself.
    const { rows } = await db.pool().query<{ "QUERY PLAN": unknown }>(
      `explain (verbose, format json)
         select graphile_worker_locks.unique_job_blocks(j) from graphile_worker._private_jobs j`,
    );
    const plan = JSON.stringify(rows[0]!["QUERY PLAN"]);
    expect(plan).toContain("jsonb_path_query_first");
    expect(plan).not.toContain("unique_job_blocks");
  });

  it("raise on any duplicate aborts the whole batch", async () => {
    const existing = await locks.addJob("br", { k: 1 }, { unique: "active" });
    const error = await locks
      .addJobs([
        { identifier: "br", payload: { k: 2 }, unique: "active" },
        { identifier: "br", payload: { k: 1 }, unique: "active", onDuplicate: "raise" },
      ])
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UniqueConflictError);
    expect((error as UniqueConflictError).existingJobId).toBe(existing.job!.id);
    expect(await jobCount()).toBe(1);
  });
});

describe("bounded state", () => {
  it("100,000 distinct keys churned through leave nothing behind", async () => {
    const batch = (from: number, extra: object) =>
      Array.from({ length: 10_000 }, (_, i) => ({
        identifier: "churn",
        payload: { i: from + i },
        ...extra,
      }));
    const past = new Date(Date.now() - 60_000);
    for (let from = 0; from < 100_000; from += 20_000) {
      // Half scoped (state lives on the job row), half windows alone (a row each until it expires).
      const scoped = await locks.addJobs(batch(from, { unique: "active" }));
      const windows = await locks.addJobs(batch(from + 10_000, { uniqueFor: 1, runAt: past }));
      expect([...scoped, ...windows].every((r) => r.outcome === "added")).toBe(true);
      const ids = [...scoped, ...windows].map((r) => r.job!.id);
      await utils.completeJobs(ids);
    }
    expect(await jobCount()).toBe(0);
    expect(await locks.sweep()).toBe(50_000);
    const { rows } = await db
      .pool()
      .query<{ n: number }>("select count(*)::int as n from graphile_worker_locks.unique_windows");
    expect(rows[0]!.n).toBe(0);
  });
});

describe("bad input is refused before anything is written", () => {
  it("names what was wrong", async () => {
    const cases: Array<[Promise<unknown>, RegExp]> = [
      [
        locks.addJob("bad", {}, { unique: "forever" as UniqueScope }),
        /`unique` must be one of "queued", "active", "exists" or false, got "forever"/,
      ],
      [
        locks.addJob("bad", {}, { uniqueFor: -5 }),
        /`uniqueFor` must be a positive number of seconds, got -5/,
      ],
      [
        locks.addJob("bad", {}, { unique: "queued", onDuplicate: "merge" as never }),
        /`onDuplicate` must be one of/,
      ],
      [
        locks.addJob(
          "bad",
          {},
          {
            unique: "queued",
            uniqueKey: () => {
              throw new Error("key failed");
            },
          },
        ),
        /key failed/,
      ],
      [
        locks.addJob("bad", {}, { unique: "queued", uniqueKey: () => ({ id: 1n }) }),
        /uniqueKey\(payload\)\.id is a BigInt/,
      ],
      [
        locks.addJob("bad", {}, { unique: "queued", jobKey: "mine" }),
        /cannot be combined with a unique job/,
      ],
      [
        locks.addJobs([
          { identifier: "bad", payload: { a: 1 } },
          { identifier: "bad", payload: { f: () => 1 } },
        ]),
        /payload\.f is a function/,
      ],
    ];
    for (const [attempt, message] of cases) {
      const error = await attempt.catch((e: unknown) => e);
      expect(error).toBeInstanceOf(Error);
      expect(String((error as Error).message)).toMatch(message);
    }
    expect(() =>
      locks.unique("bad", async () => undefined, { unique: "sometimes" as UniqueScope }),
    ).toThrow(InvalidArgumentError);
    expect(await jobCount()).toBe(0);
    // Your own job key without uniqueness keeps graphile-worker's meaning.
    const own = await locks.addJob("bad", { a: 1 }, { jobKey: "mine" });
    const again = await locks.addJob("bad", { a: 2 }, { jobKey: "mine" });
    expect(again.job!.id).toBe(own.job!.id);
    expect(again.job!.payload).toEqual({ a: 2 });
  });
});

describe("when a duplicate is accepted again: scope x outcome, with a real runner", () => {
  type State =
    "queued" | "running" | "retrying" | "failed for good" | "succeeded" | "killed mid-job";
  const expected: Record<UniqueScope, Record<State, "duplicate" | "added">> = {
    queued: {
      queued: "duplicate",
      running: "added",
      retrying: "added",
      "failed for good": "added",
      succeeded: "added",
      "killed mid-job": "added",
    },
    active: {
      queued: "duplicate",
      running: "duplicate",
      retrying: "duplicate",
      "failed for good": "added",
      succeeded: "added",
      "killed mid-job": "duplicate",
    },
    exists: {
      queued: "duplicate",
      running: "duplicate",
      retrying: "duplicate",
      "failed for good": "duplicate",
      succeeded: "added",
      "killed mid-job": "duplicate",
    },
  };
  const holds = new Map<string, Deferred<void>>();
  let runner: Runner;
  let matrixLocks: Locks;

  beforeAll(async () => {
    matrixLocks = makeLocks({ connectionString: db.url, logger: quietLogger });
    const task = matrixLocks.unique(
      "m",
      async (p: { mode: string; id: string }) => {
        if (p.mode === "hold") await holds.get(p.id)!.promise;
        if (p.mode === "fail") throw new Error("fails");
      },
      { unique: "queued", uniqueKey: (p: { id: string }) => p.id },
    );
    runner = await startRunner({
      connectionString: db.url,
      concurrency: 20,
      taskList: { m: task },
    });
  });
  afterAll(async () => {
    for (const d of holds.values()) d.resolve();
    await runner?.stop();
    await matrixLocks?.release();
  });

  const jobState = async (id: string) =>
    (await db.pool().query<Job>("select * from graphile_worker.jobs where id = $1", [id])).rows[0];

  async function drive(scope: UniqueScope, state: State): Promise<string> {
    const id = `${scope}/${state}`;
    const add = (mode: string, extra: object = {}) =>
      matrixLocks.addJob("m", { mode, id }, { unique: scope, ...extra });
    switch (state) {
      case "queued":
        await add("ok", { runAt: new Date(Date.now() + 3_600_000) });
        break;
      case "running": {
        holds.set(id, deferred());
        const { job } = await add("hold");
        await waitFor(async () => (await jobState(job!.id))?.locked_at, {
          message: `${id} to start`,
        });
        break;
      }
      case "retrying": {
        const { job } = await add("fail");
        await waitFor(
          async () => {
            const j = await jobState(job!.id);
            return j && j.attempts === 1 && j.locked_at === null && j.last_error;
          },
          { message: `${id} to fail once` },
        );
        break;
      }
      case "failed for good": {
        const { job } = await add("fail", { maxAttempts: 1 });
        await waitFor(
          async () => {
            const j = await jobState(job!.id);
            return j && j.attempts === 1 && j.locked_at === null;
          },
          { message: `${id} to fail for good` },
        );
        break;
      }
      case "succeeded": {
        const { job } = await add("ok");
        await waitFor(async () => !(await jobState(job!.id)), { message: `${id} to succeed` });
        break;
      }
      case "killed mid-job": {
        // What a worker killed mid-job leaves: the row locked by a worker that no longer exists.
        const { job } = await add("ok", { runAt: new Date(Date.now() + 3_600_000) });
        await db
          .pool()
          .query(
            "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'killed', attempts = attempts + 1 where id = $1",
            [job!.id],
          );
        break;
      }
    }
    return id;
  }

  for (const scope of ["queued", "active", "exists"] as const) {
    it(`scope "${scope}"`, async () => {
      const seen: Record<string, string> = {};
      for (const state of Object.keys(expected[scope]) as State[]) {
        const id = await drive(scope, state);
        const result = await matrixLocks.addJob(
          "m",
          { mode: "ok", id, dup: true },
          { unique: scope, runAt: new Date(Date.now() + 3_600_000) },
        );
        seen[state] = result.outcome;
        holds.get(id)?.resolve();
      }
      expect(seen).toEqual(expected[scope]);
    });
  }
});

describe("unique + exclusive (sidekiq's until_and_while_executing)", () => {
  it("refuses duplicates while queued, accepts one once the first runs, and never runs the two at once", async () => {
    const combined = makeLocks({ connectionString: db.url, logger: quietLogger });
    cleanups.push(() => combined.release());
    const firstRunning = deferred();
    const finishFirst = deferred();
    const runs: Array<{ n: number; start: number; end: number }> = [];
    const task = combined.exclusive(
      "uawe",
      async (p: { account: number; n: number }) => {
        const start = performance.now();
        if (p.n === 1) {
          firstRunning.resolve();
          await finishFirst.promise;
        }
        runs.push({ n: p.n, start, end: performance.now() });
      },
      {
        key: (p) => p.account,
        unique: "queued",
        onConflict: "reschedule",
        reschedule: { minDelay: 60_000, maxDelay: 60_000 },
      },
    );
    expect((await task.addJob({ account: 1, n: 1 })).outcome).toBe("added");
    expect((await task.addJob({ account: 1, n: 2 })).outcome).toBe("duplicate");
    const runner = await startRunner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { uawe: task },
    });
    cleanups.push(() => runner.stop());
    await firstRunning.promise;
    // Running: no longer "queued", so a new one is accepted; it meets the lock and waits for the first.
    expect((await task.addJob({ account: 1, n: 3 })).outcome).toBe("added");
    await nextEvent(combined, "job:rescheduled");
    expect((await task.addJob({ account: 1, n: 4 })).outcome).toBe("duplicate");
    finishFirst.resolve();
    await waitFor(async () => runs.length === 2, { message: "both to run" });
    expect(runs.map((r) => r.n)).toEqual([1, 3]);
    expect(runs[1]!.start).toBeGreaterThanOrEqual(runs[0]!.end);
  });
});
