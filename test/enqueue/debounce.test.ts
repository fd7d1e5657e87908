/**
 * Debounced enqueues (`debounce`) against real PostgreSQL and real runners: a burst collapses into one job
 * with the last payload, run at least(last + delay, first + maxWait) as the database computed it; 20
 * concurrent enqueuers on separate connections; a started run ends its burst; leading mode; callers'
 * transactions; bulk enqueues; sweeps; validation before anything is written, in code and in the preset.
 */
import type { Runner, Task } from "graphile-worker";
import { describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  debounceKey,
  makeLocksFromPreset,
  type AddJobResult,
  type LocksEvents,
} from "../../src/index.js";
import { deferred, waitFor } from "../support/db.js";
import { startRunner } from "../support/runner.js";
import { useUniqueHarness } from "../support/unique.js";

const h = useUniqueHarness();
const { db, cleanups, client, jobCount } = h;

/** A key's debounce row and its job's run_at, as microsecond epochs (null: none). */
async function burstOf(key: string) {
  const { rows } = await db.pool().query<Record<string, string | null>>(
    `select d.job_id::text as job_id, (extract(epoch from d.first_at) * 1e6)::bigint::text as first_at,
       (extract(epoch from d.last_at) * 1e6)::bigint::text as last_at,
       (extract(epoch from j.run_at) * 1e6)::bigint::text as run_at, d.trailing_run::text as trailing
     from graphile_worker_locks.debounces d
     left join graphile_worker._private_jobs j on j.id = d.job_id where d.debounce_key = $1`,
    [key],
  );
  const row = rows[0];
  if (!row) return null;
  return {
    jobId: row.job_id,
    firstAt: Number(row.first_at),
    lastAt: Number(row.last_at),
    runAt: row.run_at === null ? null : Number(row.run_at),
    trailing: row.trailing === "true",
  };
}

/** The database's clock, in microseconds since the epoch. */
async function dbNow(): Promise<number> {
  const { rows } = await db
    .pool()
    .query<{ us: string }>(
      "select (extract(epoch from clock_timestamp()) * 1e6)::bigint::text as us",
    );
  return Number(rows[0]!.us);
}

/** A runner of `task` under `identifier`, stopped after the test. */
async function runner(identifier: string, task: Task): Promise<Runner> {
  const r = await startRunner({
    connectionString: db.url,
    concurrency: 2,
    taskList: { [identifier]: task },
  });
  cleanups.push(() => r.stop());
  return r;
}

describe("a burst", () => {
  it("collapses into one job with the last payload, due `delay` after the last enqueue", async () => {
    const debounce = { delay: 60_000, maxWait: 120_000 };
    const key = debounceKey("index", { index: "a" });
    const first = await h.locks.addJob(
      "index",
      { index: "a" },
      { debounce, priority: 1, queueName: "q1" },
    );
    expect(first.outcome).toBe("added");
    const afterFirst = await burstOf(key);
    expect(afterFirst!.runAt).toBe(afterFirst!.lastAt + 60_000_000);

    const seen: Array<LocksEvents["job:debounced"]> = [];
    const listener = (e: LocksEvents["job:debounced"]) => seen.push(e);
    h.locks.events.on("job:debounced", listener);
    cleanups.push(async () => h.locks.events.off("job:debounced", listener));
    const second = await h.locks.addJob(
      "index",
      { index: "a" },
      {
        debounce: { ...debounce, key: (p: { index: string }) => ({ index: p.index }) },
        priority: 5,
        queueName: "q2",
        maxAttempts: 3,
      },
    );
    expect(second.outcome).toBe("debounced");
    expect(second.job!.id).toBe(first.job!.id);
    const burst = await burstOf(key);
    expect(burst!.jobId).toBe(first.job!.id);
    expect(burst!.firstAt).toBe(afterFirst!.firstAt);
    expect(burst!.lastAt).toBeGreaterThan(afterFirst!.lastAt);
    expect(burst!.runAt).toBe(burst!.lastAt + 60_000_000);
    // The job is the last enqueue's: priority, queue and max attempts too.
    const { rows } = await db
      .pool()
      .query(
        "select priority, queue_name, max_attempts, revision from graphile_worker.jobs where id = $1",
        [first.job!.id],
      );
    expect(rows[0]).toEqual({ priority: 5, queue_name: "q2", max_attempts: 3, revision: 1 });
    expect(seen).toEqual([
      { taskIdentifier: "index", debounceKey: key, payload: { index: "a" }, job: second.job },
    ]);
    expect(await jobCount("task_identifier = 'index'")).toBe(1);
  });

  it("never runs later than `maxWait` after its first enqueue", async () => {
    const debounce = { delay: 1000, maxWait: 1500, key: () => "capped" };
    const key = debounceKey("capped", "capped");
    const first = await h.locks.addJob("capped", { n: 1 }, { debounce });
    // (the second enqueue comes over half a second after the first, on the database's clock)
    await db.pool().query("select pg_sleep(0.6)");
    const second = await h.locks.addJob("capped", { n: 2 }, { debounce });
    expect(second.outcome).toBe("debounced");
    expect(second.job!.id).toBe(first.job!.id);
    const burst = await burstOf(key);
    expect(burst!.lastAt - burst!.firstAt).toBeGreaterThanOrEqual(600_000);
    expect(burst!.runAt).toBe(burst!.firstAt + 1_500_000);
    expect(second.job!.payload).toEqual({ n: 2 });
  });

  it("from 20 concurrent enqueuers on separate connections is one job, answered to every one", async () => {
    const connections = await Promise.all(Array.from({ length: 20 }, () => client()));
    const debounce = { delay: 60_000, maxWait: 120_000, key: () => "crowd" };
    const results = await Promise.all(
      connections.map((c, i) => h.locks.addJob("crowd", { i }, { debounce, pgClient: c })),
    );
    expect(results.filter((r) => r.outcome === "added")).toHaveLength(1);
    expect(results.filter((r) => r.outcome === "debounced")).toHaveLength(19);
    expect(new Set(results.map((r) => r.job!.id)).size).toBe(1);
    expect(await jobCount("task_identifier = 'crowd'")).toBe(1);
    // The job carries the payload of the enqueue that came last.
    const burst = await burstOf(debounceKey("crowd", "crowd"));
    const last = results.reduce((a, b) =>
      Number(b.job!.revision) > Number(a.job!.revision) ? b : a,
    );
    const { rows } = await db
      .pool()
      .query("select payload from graphile_worker._private_jobs where id = $1", [burst!.jobId]);
    expect(rows[0].payload).toEqual(last.job!.payload);
  });

  it("ends when its run starts: the next enqueue starts a new burst", async () => {
    const started = deferred<string>();
    const release = deferred();
    const runs: Array<{ id: string; payload: unknown }> = [];
    await runner("ends", async (payload, helpers) => {
      runs.push({ id: helpers.job.id, payload });
      started.resolve(helpers.job.id);
      await release.promise;
    });
    // (a failed check must not leave the runner waiting on its job)
    cleanups.push(async () => release.resolve());
    const debounce = { delay: 200, maxWait: 1000, key: () => "ends" };
    const first = await h.locks.addJob("ends", { n: 1 }, { debounce });
    expect(first.outcome).toBe("added");
    expect(await started.promise).toBe(first.job!.id);
    const second = await h.locks.addJob("ends", { n: 2 }, { debounce });
    expect(second.outcome).toBe("added");
    expect(second.job!.id).not.toBe(first.job!.id);
    const third = await h.locks.addJob("ends", { n: 3 }, { debounce });
    expect(third.outcome).toBe("debounced");
    expect(third.job!.id).toBe(second.job!.id);
    release.resolve();
    await waitFor(
      async () => runs.length === 2 && (await jobCount("task_identifier = 'ends'")) === 0,
      {
        message: "both runs",
      },
    );
    expect(runs).toEqual([
      { id: first.job!.id, payload: { n: 1 } },
      { id: second.job!.id, payload: { n: 3 } },
    ]);
  });
});

describe("leading mode", () => {
  it("runs the first of a burst at once and collapses the rest into one trailing run", async () => {
    const key = debounceKey("lead", "lead");
    const debounce = { delay: 3000, maxWait: 10_000, leading: true, key: () => "lead" };
    // Before any worker: the leading job is due now, and an enqueue collapses into it while it waits.
    const first = await h.locks.addJob("lead", { n: 1 }, { debounce });
    const after = await dbNow();
    expect(first.outcome).toBe("added");
    expect(new Date(first.job!.run_at).getTime() * 1000).toBeLessThanOrEqual(after);
    const second = await h.locks.addJob("lead", { n: 2 }, { debounce });
    expect([second.outcome, second.job!.id]).toEqual(["debounced", first.job!.id]);
    expect(second.job!.run_at).toEqual(first.job!.run_at);

    const started = deferred<string>();
    const release = deferred();
    const runs: Array<{ id: string; payload: unknown }> = [];
    await runner("lead", async (payload, helpers) => {
      runs.push({ id: helpers.job.id, payload });
      started.resolve(helpers.job.id);
      await release.promise;
    });
    // (a failed check must not leave the runner waiting on its job)
    cleanups.push(async () => release.resolve());
    expect(await started.promise).toBe(first.job!.id);
    // The leading run started, the key is not quiet: the trailing run, then collapses into it.
    const third = await h.locks.addJob("lead", { n: 3 }, { debounce });
    expect(third.outcome).toBe("added");
    const trailing = await burstOf(key);
    expect(trailing!.trailing).toBe(true);
    expect(trailing!.runAt).toBe(
      Math.min(trailing!.lastAt + 3_000_000, trailing!.firstAt + 10_000_000),
    );
    const fourth = await h.locks.addJob("lead", { n: 4 }, { debounce });
    expect([fourth.outcome, fourth.job!.id]).toEqual(["debounced", third.job!.id]);
    release.resolve();
    await waitFor(
      async () => runs.length === 2 && (await jobCount("task_identifier = 'lead'")) === 0,
      {
        message: "the trailing run",
        timeoutMs: 30_000,
      },
    );
    expect(runs).toEqual([
      { id: first.job!.id, payload: { n: 2 } },
      { id: third.job!.id, payload: { n: 4 } },
    ]);
    // Quiet again (no enqueue for `delay`, its run done): the next enqueue leads a new burst.
    const now = await dbNow();
    const quietAt = (await burstOf(key))!.lastAt + 3_000_000;
    if (now < quietAt)
      await db.pool().query("select pg_sleep($1::float8)", [(quietAt - now) / 1e6 + 0.01]);
    const fifth = await h.locks.addJob("lead", { n: 5 }, { debounce });
    expect(fifth.outcome).toBe("added");
    expect((await burstOf(key))!.trailing).toBe(false);
    await waitFor(async () => runs.length === 3, { message: "the new leading run" });
  });
});

describe("callers' transactions", () => {
  it("a rolled-back enqueue leaves nothing; a waiting one collapses into a committed burst", async () => {
    const [a, b] = await Promise.all([client(), client()]);
    const debounce = { delay: 60_000, maxWait: 120_000, key: () => "tx" };
    await a.query("begin");
    const rolledBack = await h.locks.addJob("tx", { n: 1 }, { debounce, pgClient: a });
    expect(rolledBack.outcome).toBe("added");
    await a.query("rollback");
    expect(await burstOf(debounceKey("tx", "tx"))).toBeNull();
    expect(await jobCount("task_identifier = 'tx'")).toBe(0);

    await a.query("begin");
    const committed = await h.locks.addJob("tx", { n: 2 }, { debounce, pgClient: a });
    expect(committed.outcome).toBe("added");
    const waiting = h.locks.addJob("tx", { n: 3 }, { debounce, pgClient: b });
    await h.blocked(h.pidOf(b));
    await a.query("commit");
    const collapsed = await waiting;
    expect([collapsed.outcome, collapsed.job!.id]).toEqual(["debounced", committed.job!.id]);
    expect(await jobCount("task_identifier = 'tx'")).toBe(1);
  });
});

describe("repeatable read", () => {
  it("a caller whose snapshot predates the key's burst gets a serialization failure", async () => {
    const [a, b] = await Promise.all([client(), client()]);
    const debounce = { delay: 60_000, maxWait: 120_000, key: () => "rr" };
    await a.query("begin isolation level repeatable read");
    await a.query("select 1");
    expect((await h.locks.addJob("rr", { n: 1 }, { debounce, pgClient: b })).outcome).toBe("added");
    await expect(h.locks.addJob("rr", { n: 2 }, { debounce, pgClient: a })).rejects.toMatchObject({
      code: "40001",
    });
    await a.query("rollback");
    expect((await h.locks.addJob("rr", { n: 3 }, { debounce, pgClient: a })).outcome).toBe(
      "debounced",
    );
  });
});

describe("bulk", () => {
  it("collapses a batch's items of a key into one job, answered in input order", async () => {
    const debounce = { delay: 60_000, maxWait: 120_000, key: () => "bulk" };
    const results: AddJobResult[] = await h.locks.addJobs([
      { identifier: "bulk_d", payload: { n: 0 }, debounce },
      { identifier: "bulk_d", payload: { n: 1 }, debounce },
      { identifier: "plain", payload: { n: 2 } },
      { identifier: "bulk_d", payload: { n: 3 }, debounce },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "debounced", "added", "debounced"]);
    expect(results[1]!.job!.id).toBe(results[0]!.job!.id);
    expect(results[3]!.job!.id).toBe(results[0]!.job!.id);
    expect(results[3]!.job!.payload).toEqual({ n: 3 });
    expect(results[2]!.job!.payload).toEqual({ n: 2 });
    expect(await jobCount("task_identifier = 'bulk_d'")).toBe(1);
  });
});

describe("sweep", () => {
  it("removes a quiet key's row once its run is gone, not before", async () => {
    const debounce = { delay: 100, maxWait: 100, key: () => "swept" };
    const key = debounceKey("swept", "swept");
    const added = await h.locks.addJob("swept", { n: 1 }, { debounce });
    await db.pool().query("select pg_sleep(0.2)");
    await h.locks.sweep();
    expect(await burstOf(key)).not.toBeNull();
    await h.utils.completeJobs([added.job!.id]);
    await h.locks.sweep();
    expect(await burstOf(key)).toBeNull();
  });
});

describe("validation", () => {
  it("refuses bad values and combinations naming the option, before anything is written", async () => {
    const bad: Array<[Record<string, unknown>, RegExp]> = [
      [
        { debounce: { delay: 0, maxWait: 10 } },
        /`debounce.delay` must be a positive number of milliseconds/,
      ],
      [
        { debounce: { delay: 10, maxWait: 5 } },
        /`debounce.maxWait` \(5\) must not be below `debounce.delay` \(10\)/,
      ],
      [{ debounce: { delay: 10 } }, /`debounce.maxWait`/],
      [
        { debounce: { delay: 10, maxWait: 10, leading: "yes" } },
        /`debounce.leading` must be a boolean/,
      ],
      [
        { debounce: { delay: 10, maxWait: 10, trailing: true } },
        /unknown option `debounce.trailing`/,
      ],
      [
        { debounce: { delay: 10, maxWait: 10 }, unique: "queued" },
        /`debounce` cannot be combined with `unique`/,
      ],
      [
        { debounce: { delay: 10, maxWait: 10 }, uniqueFor: 60 },
        /`debounce` cannot be combined with `uniqueFor`/,
      ],
      [
        { debounce: { delay: 10, maxWait: 10 }, enqueueRate: { limit: 1, period: 10 } },
        /`debounce` cannot be combined with `enqueueRate`/,
      ],
    ];
    for (const [options, message] of bad) {
      await expect(h.locks.addJob("v", {}, options as never)).rejects.toThrow(message);
      expect(() => h.locks.unique("v", async () => undefined, options as never)).toThrow(message);
    }
    await expect(
      h.locks.addJob("v", {}, { debounce: { delay: 10, maxWait: 10 }, runAt: new Date() }),
    ).rejects.toThrow(/`runAt` cannot be combined with `debounce`/);
    await expect(
      h.locks.addJob("v", {}, { debounce: { delay: 10, maxWait: 10 }, jobKey: "k" }),
    ).rejects.toThrow(/`jobKey`\/`jobKeyMode` cannot be combined with `debounce`/);
    // A task's uniqueness meets an enqueue's debounce.
    h.locks.unique("u", async () => undefined, { unique: "queued" });
    await expect(h.locks.addJob("u", {}, { debounce: { delay: 10, maxWait: 10 } })).rejects.toThrow(
      InvalidArgumentError,
    );
    expect(await jobCount()).toBe(0);
    expect(await burstOf(debounceKey("v", {}))).toBeNull();
  });

  it("in the preset: bad values fail at start-up naming the task and the option; good ones apply", async () => {
    expect(() =>
      makeLocksFromPreset({
        worker: {
          connectionString: db.url,
          locks: { tasks: { rebuild: { debounce: { delay: 5000, maxWait: 1000 } } } },
        },
      }),
    ).toThrow(/task 'rebuild'.*`debounce.maxWait`/);
    expect(() =>
      makeLocksFromPreset({
        worker: {
          connectionString: db.url,
          locks: { tasks: { notify: { enqueueRate: { limit: -1, period: 1000 } } } },
        },
      }),
    ).toThrow(/task 'notify'.*`enqueueRate.limit`/);
    const locks = makeLocksFromPreset({
      worker: {
        connectionString: db.url,
        locks: {
          tasks: {
            rebuild: { debounce: { delay: 60_000, maxWait: 120_000, key: () => "all" } },
            notify: { enqueueRate: { limit: 1, period: 60_000, key: () => "all" } },
          },
        },
      },
    });
    try {
      expect((await locks.addJob("rebuild", { n: 1 })).outcome).toBe("added");
      expect((await locks.addJob("rebuild", { n: 2 })).outcome).toBe("debounced");
      expect((await locks.addJob("notify", { n: 1 })).outcome).toBe("added");
      expect((await locks.addJob("notify", { n: 2 })).outcome).toBe("rateLimited");
    } finally {
      await locks.release();
    }
  });
});
