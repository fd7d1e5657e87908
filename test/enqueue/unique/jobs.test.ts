/**
 * Unique jobs against real PostgreSQL: scopes, windows, keys, duplicate strategies, races on separate
 * connections, callers' transactions, and a scope x outcome matrix with real runners (bounded state: churn.long.test.ts).
 */
import { createHash } from "node:crypto";
import { type Job, type Runner } from "graphile-worker";
import type pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  UniqueConflictError,
  makeLocks,
  uniqueJobKey,
  type Locks,
  type UniqueScope,
} from "../../../src/index.js";
import { uniqueKeyMaterial } from "../../../src/enqueue/unique.js";
import { deferred, waitFor, type Deferred } from "../../support/db.js";
import { useUniqueHarness } from "../../support/unique.js";
import { countEvents, nextEvent, quietLogger, startRunner } from "../../support/runner.js";

const h = useUniqueHarness();
const { db, cleanups, client, jobCount, blocked, pidOf } = h;

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
    const email = h.locks.unique("email", async () => undefined, {
      unique: "queued",
      uniqueKey: (p: { user: number; at?: string }) => ({ user: p.user }),
    });
    expect((await email.addJob({ user: 1, at: "x" })).outcome).toBe("added");
    expect((await email.addJob({ user: 1, at: "y" })).outcome).toBe("duplicate");
    expect((await email.addJob({ user: 2, at: "y" })).outcome).toBe("added");

    // Zizq's hourly bucket: the key includes the hour of enqueue.
    const hourly = (hour: number) =>
      h.locks.addJob(
        "digest",
        { list: 9 },
        { unique: "queued", uniqueKey: (p: { list: number }) => ({ ...p, hour }) },
      );
    expect((await hourly(13)).outcome).toBe("added");
    expect((await hourly(13)).outcome).toBe("duplicate");
    expect((await hourly(14)).outcome).toBe("added");

    // One key across two tasks.
    h.locks.define("push", {
      unique: "active",
      uniqueGroup: "notify",
      uniqueKey: (p: { user: number }) => p.user,
    });
    h.locks.define("sms", {
      unique: "active",
      uniqueGroup: "notify",
      uniqueKey: (p: { user: number }) => p.user,
    });
    const first = await h.locks.addJob("push", { user: 5 });
    const second = await h.locks.addJob("sms", { user: 5, text: "hi" });
    expect(second.outcome).toBe("duplicate");
    expect(second.job!.id).toBe(first.job!.id);
    expect(second.job!.task_identifier).toBe("push");

    // Faktory: the queue is part of the key only when asked.
    expect(
      (await h.locks.addJob("q", { a: 1 }, { unique: "queued", queueName: "one" })).outcome,
    ).toBe("added");
    expect(
      (await h.locks.addJob("q", { a: 1 }, { unique: "queued", queueName: "two" })).outcome,
    ).toBe("duplicate");
    const byQueue = { unique: "queued", uniqueByQueue: true } as const;
    expect((await h.locks.addJob("qq", { a: 1 }, { ...byQueue, queueName: "one" })).outcome).toBe(
      "added",
    );
    expect((await h.locks.addJob("qq", { a: 1 }, { ...byQueue, queueName: "two" })).outcome).toBe(
      "added",
    );

    // Bypass for one enqueue.
    expect((await email.addJob({ user: 1 }, { unique: false })).outcome).toBe("added");
    expect(await jobCount("task_identifier = 'email'")).toBe(3);
  });
});

describe("duplicates", () => {
  it("reject (default) returns the existing job untouched, with an event, and writes nothing", async () => {
    const events = countEvents(h.locks, ["enqueue:duplicate"]);
    const first = await h.locks.addJob(
      "r",
      { n: 1, v: "first" },
      { unique: "active", uniqueKey: (p: { n: number }) => p.n },
    );
    const before = await db.pool().query("select revision, updated_at from graphile_worker.jobs");
    const dup = await h.locks.addJob(
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

  it("a job without flags gets none (SQL null), and a keyed row whose flags are the JSON value null still answers duplicates", async () => {
    const plain = await h.locks.addJob("plain_flags", { n: 1 });
    const { rows: plainRows } = await db
      .pool()
      .query<{ flags: unknown }>("select flags from graphile_worker._private_jobs where id = $1", [
        plain.job!.id,
      ]);
    expect(plainRows[0]!.flags).toBeNull();
    // Another tool may leave the JSON value null in a keyed row's flags: the duplicate check must not fail.
    const first = await h.locks.addJob("null_flags", { n: 1 }, { unique: "queued" });
    await db
      .pool()
      .query("update graphile_worker._private_jobs set flags = 'null'::jsonb where id = $1", [
        first.job!.id,
      ]);
    const single = await h.locks.addJob("null_flags", { n: 1 }, { unique: "queued" });
    const [bulk] = await h.locks.addJobs([
      { identifier: "null_flags", payload: { n: 1 }, unique: "queued" },
    ]);
    expect([single.outcome, bulk!.outcome]).toEqual(["duplicate", "duplicate"]);
    expect(bulk!.job!.id).toBe(first.job!.id);
  });

  it("raise throws UniqueConflictError carrying the existing job", async () => {
    const first = await h.locks.addJob("x", { n: 1 }, { unique: "queued" });
    const error = await h.locks
      .addJob("x", { n: 1 }, { unique: "queued", onDuplicate: "raise" })
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UniqueConflictError);
    expect((error as UniqueConflictError).code).toBe("GWL_UNIQUE_CONFLICT");
    expect((error as UniqueConflictError).existingJob!.id).toBe(first.job!.id);
    expect(await jobCount()).toBe(1);
  });

  it("replace updates payload, runAt and priority while the job waits, and never a started job", async () => {
    const replaced = countEvents(h.locks, ["enqueue:replaced"]);
    const opts = {
      unique: "active",
      onDuplicate: "replace",
      uniqueKey: (p: { n: number }) => p.n,
    } as const;
    const first = await h.locks.addJob("rp", { n: 1, v: 1 }, opts);
    const runAt = new Date(Date.now() + 3_600_000);
    const second = await h.locks.addJob("rp", { n: 1, v: 2 }, { ...opts, runAt, priority: 5 });
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
    const third = await h.locks.addJob("rp", { n: 1, v: 3 }, opts);
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
          return h.locks.addJob(
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
      clients.map((c) => h.locks.addJob("win", { k: 1 }, { uniqueFor: 60, pgClient: c })),
    );
    expect(outcomes.filter((r) => r.outcome === "added")).toHaveLength(1);
    expect(await jobCount()).toBe(1);
  });

  it("an enqueuer that rolls back never makes another enqueuer's job disappear", async () => {
    const a = await client();
    const b = await client();
    await a.query("begin");
    expect((await h.locks.addJob("rb", { k: 1 }, { unique: "active", pgClient: a })).outcome).toBe(
      "added",
    );
    const pendingB = h.locks.addJob("rb", { k: 1 }, { unique: "active", pgClient: b });
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
    const added = await h.locks.addJob("tx", { k: 1 }, { unique: "queued", pgClient: a });
    const pendingB = h.locks.addJob("tx", { k: 1 }, { unique: "queued", pgClient: b });
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
    await h.locks.addJob("rr", { k: 1 }, { unique: "active", pgClient: a });
    const pendingB = h.locks
      .addJob("rr", { k: 1 }, { unique: "active", pgClient: b })
      .catch((e: unknown) => e);
    await blocked(pidOf(b));
    await a.query("commit");
    const outcome = (await pendingB) as { code?: string };
    expect(outcome.code).toBe("40001");
    await b.query("rollback");
    // Committed after b's snapshot, so b can neither see it nor insert beside it: it must retry.
    const retry = await h.locks.addJob("rr", { k: 1 }, { unique: "active", pgClient: b });
    expect(retry.outcome).toBe("duplicate");
    expect(await jobCount()).toBe(1);
  });

  it("a job and its uniqueness are written in the caller's transaction, and vanish with its rollback", async () => {
    const a = await client();
    await a.query("begin");
    await a.query("create temp table my_write (x int)");
    await h.locks.addJob("t1", { k: 1 }, { unique: "exists", uniqueFor: 60, pgClient: a });
    await h.locks.addJob("t2", { k: 1 }, { uniqueFor: 60, pgClient: a });
    await a.query("rollback");
    expect(await jobCount()).toBe(0);
    const { rows } = await db.pool().query("select * from graphile_worker_locks.unique_windows");
    expect(rows).toEqual([]);
    expect((await h.locks.addJob("t2", { k: 1 }, { uniqueFor: 60 })).outcome).toBe("added");
  });
  it("every kind of addJob with the caller's pgClient, rolled back, leaves no advisory lock and no row", async () => {
    h.locks.exclusive("rb_drop", async () => undefined);
    h.locks.exclusive("rb_line", async () => undefined, { onConflict: "reschedule" });
    const a = await client();
    const tables = ["unique_windows", "waiters", "wakes", "prewakes", "given_back"];
    /** Advisory locks held in this database (by any session), and the rows of every table written. */
    const leftovers = async (on: { query: pg.Client["query"] }) => {
      const { rows } = await on.query<Record<string, number>>(
        `select
           (select count(*)::int from pg_locks where locktype = 'advisory'
              and database = (select oid from pg_database where datname = current_database())) as advisory,
           (select count(*)::int from graphile_worker._private_jobs) as jobs,
           ${tables.map((t) => `(select count(*)::int from graphile_worker_locks.${t}) as ${t}`).join(",\n")}`,
      );
      return rows[0]!;
    };
    const none = { advisory: 0, jobs: 0, ...Object.fromEntries(tables.map((t) => [t, 0])) };
    expect(await leftovers(a)).toEqual(none);

    await a.query("begin");
    const results = [
      // the preemptive check of a `drop` task
      await h.locks.addJob("rb_drop", { k: 1 }, { pgClient: a }),
      // a `reschedule` task's job, in its key's line
      await h.locks.addJob("rb_line", { k: 1 }, { pgClient: a }),
      await h.locks.addJob("rb_unique", { k: 1 }, { unique: "queued", uniqueFor: 60, pgClient: a }),
      // a job key of the caller's (graphile-worker's add_job), with the preemptive check
      await h.locks.addJob("rb_drop", { k: 2 }, { jobKey: "rb-k", preemptive: true, pgClient: a }),
      // bulk: two of one `reschedule` key (the second waits in line) and a unique job
      ...(await h.locks.addJobs(
        [
          { identifier: "rb_line", payload: { k: 2 } },
          { identifier: "rb_line", payload: { k: 2 } },
          { identifier: "rb_unique", payload: { k: 2 }, unique: "queued" },
        ],
        { pgClient: a },
      )),
    ];
    expect(results.map((r) => r.outcome)).toEqual(Array(7).fill("added"));
    // Written, in the caller's transaction: its own session sees them.
    expect((await leftovers(a)).jobs).toBe(7);
    await a.query("rollback");

    expect(await leftovers(a)).toEqual(none);
    expect(await leftovers(db.pool())).toEqual(none);
  });
});

describe("windows (uniqueFor)", () => {
  const ago = (s: number) => new Date(Date.now() - s * 1000);
  const later = (s: number) => new Date(Date.now() + s * 1000);

  it("alone: refuses duplicates until it expires, even after the job is gone", async () => {
    const first = await h.locks.addJob("w", { k: 1 }, { uniqueFor: 600 });
    await h.utils.completeJobs([first.job!.id]);
    const dup = await h.locks.addJob("w", { k: 1 }, { uniqueFor: 600 });
    expect(dup).toEqual({ job: null, outcome: "duplicate" });
    // Counted from runAt: a window that started 20 s ago and lasts 10 s is over.
    expect((await h.locks.addJob("w", { k: 2 }, { uniqueFor: 10, runAt: ago(20) })).outcome).toBe(
      "added",
    );
    expect((await h.locks.addJob("w", { k: 2 }, { uniqueFor: 10 })).outcome).toBe("added");
    expect((await h.locks.addJob("w", { k: 2 }, { uniqueFor: 10 })).outcome).toBe("duplicate");
  });

  it("a scheduled delay counts: the window runs from runAt", async () => {
    await h.locks.addJob("w", { k: 3 }, { uniqueFor: 5, runAt: later(3600) });
    expect((await h.locks.addJob("w", { k: 3 }, { uniqueFor: 5 })).outcome).toBe("duplicate");
  });

  it("with a scope it bounds the scope", async () => {
    await h.locks.addJob("ws", { k: 1 }, { unique: "exists", uniqueFor: 10, runAt: ago(60) });
    expect((await h.locks.addJob("ws", { k: 1 }, { unique: "exists" })).outcome).toBe("added");
    expect(await jobCount("task_identifier = 'ws'")).toBe(2);
    await h.locks.addJob("ws", { k: 2 }, { unique: "exists", uniqueFor: 600 });
    expect((await h.locks.addJob("ws", { k: 2 }, { unique: "exists" })).outcome).toBe("duplicate");
  });
});

describe("bad input is refused before anything is written", () => {
  it("names what was wrong", async () => {
    const cases: Array<[Promise<unknown>, RegExp]> = [
      [
        h.locks.addJob("bad", {}, { unique: "forever" as UniqueScope }),
        /`unique` must be one of "queued", "active", "exists" or false, got "forever"/,
      ],
      [
        h.locks.addJob("bad", {}, { uniqueFor: -5 }),
        /`uniqueFor` must be a positive number of seconds, got -5/,
      ],
      [
        h.locks.addJob("bad", {}, { unique: "queued", onDuplicate: "merge" as never }),
        /`onDuplicate` must be one of/,
      ],
      [
        h.locks.addJob(
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
        h.locks.addJob("bad", {}, { unique: "queued", uniqueKey: () => ({ id: 1n }) }),
        /uniqueKey\(payload\)\.id is a BigInt/,
      ],
      [
        h.locks.addJob("bad", {}, { unique: "queued", jobKey: "mine" }),
        /cannot be combined with a unique job/,
      ],
      [
        h.locks.addJobs([
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
      h.locks.unique("bad", async () => undefined, { unique: "sometimes" as UniqueScope }),
    ).toThrow(InvalidArgumentError);
    expect(await jobCount()).toBe(0);
    // Your own job key without uniqueness keeps graphile-worker's meaning.
    const own = await h.locks.addJob("bad", { a: 1 }, { jobKey: "mine" });
    const again = await h.locks.addJob("bad", { a: 2 }, { jobKey: "mine" });
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
