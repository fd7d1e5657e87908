/**
 * Exclusive execution in one process: re-entrancy, conflict strategies, semaphores, the preemptive
 * check and introspection, and releases.
 * Real PostgreSQL, real graphile-worker runners, separate connections.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import { InvalidArgumentError, LockConflictError, lockKey, makeLocks } from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { countEvents, nextEvent, Timeline, warningsLogger } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner, holdExternally, jobRows } = h;

describe("one process, one pool", () => {
  it("concurrency 16 on one shared pool, same key: never two at once (the que-locks failure)", async () => {
    const pool = new pg.Pool({ connectionString: db.url, max: 18 });
    // (as the helper pool: a backend terminated at the end of the file must not crash the test worker)
    pool.on("error", () => undefined);
    pool.on("connect", (client) => client.on("error", () => undefined));
    cleanups.push(() => pool.end());
    const locks = newLocks({ pgPool: pool });
    const timeline = new Timeline();
    const task = locks.exclusive("same", async (_p: { n: number }, helpers) => {
      const end = timeline.begin("same", helpers.job.id, helpers.job.attempts);
      await new Promise((r) => setTimeout(r, 2));
      end();
    });
    const counts = countEvents(locks, ["job:dropped", "lock:conflict"]);
    const local = { n: 0 };
    locks.events.on("lock:conflict", (e) => void (e.local && local.n++));
    await h.utils.addJobs(
      Array.from({ length: 300 }, () => ({ identifier: "same", payload: { n: 0 } })),
    );
    await runner({ pgPool: pool, concurrency: 16, taskList: { same: task } });
    await waitFor(async () => (await jobRows()).length === 0, { message: "jobs to drain" });

    expect(timeline.maxConcurrency()).toBe(1);
    expect(timeline.executions.length).toBeGreaterThan(0);
    expect(timeline.executions.length + counts["job:dropped"]!).toBe(300);
    // The in-process guard answered most conflicts without a round trip: re-entrancy never let two in.
    expect(local.n).toBeGreaterThan(0);
  });
});

describe("conflict strategies", () => {
  it("drop: completes the job without running it, with an event", async () => {
    const locks = newLocks();
    let ran = 0;
    const task = locks.exclusive("drop_me", async () => void ran++);
    const external = await holdExternally(task.lockKey({ id: 1 }));
    const { job } = await task.addJob({ id: 1 }, { preemptive: false });
    const dropped = nextEvent(locks, "job:dropped");
    await runner({ connectionString: db.url, concurrency: 2, taskList: { drop_me: task } });
    const event = await dropped;
    expect(event.job.id).toBe(job!.id);
    expect(event.lockKey).toBe(lockKey("drop_me", { id: 1 }));
    await waitFor(async () => (await jobRows()).length === 0, {
      message: "the dropped job to complete",
    });
    expect(ran).toBe(0);
    await external.release();
  });

  it("raise: throws LockConflictError, graphile-worker retries with its backoff and the attempt counts", async () => {
    const locks = newLocks();
    const ran: number[] = [];
    const task = locks.exclusive(
      "raise_me",
      async (_p, helpers) => void ran.push(helpers.job.attempts),
      {
        onConflict: "raise",
      },
    );
    const external = await holdExternally(task.lockKey({ id: 1 }));
    const { job } = await task.addJob({ id: 1 }, { preemptive: false });
    const r = await runner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { raise_me: task },
    });
    const failure = new Promise<unknown>((resolve) =>
      r.events.on("job:error", ({ error }) => resolve(error)),
    );
    expect(await failure).toBeInstanceOf(LockConflictError);
    const [row] = await waitFor(
      async () => {
        const rows = await jobRows();
        return rows[0]?.locked_by === null && rows[0].last_error ? rows : null;
      },
      { message: "the failure to be recorded" },
    );
    expect(row!.id).toBe(job!.id);
    expect(row!.attempts).toBe(1);
    expect(row!.last_error).toMatch(/held by another job/);
    expect(row!.run_at.getTime()).toBeGreaterThan(Date.now());
    expect(ran).toEqual([]);
    await external.release();
    await h.utils.rescheduleJobs([job!.id], { runAt: new Date() });
    await waitFor(async () => ran.length === 1, { message: "the retry to run" });
    expect(ran).toEqual([2]);
  });

  it("reschedule: replaced by a copy that runs later, keeping attempts, queue, priority, flags and job key", async () => {
    const locks = newLocks();
    const ran: Array<{ attempts: number; id: string }> = [];
    let failFirst = true;
    const task = locks.exclusive(
      "later",
      async (_p: { id: number }, helpers) => {
        if (failFirst) {
          failFirst = false;
          throw new Error("first attempt fails");
        }
        ran.push({ attempts: helpers.job.attempts, id: helpers.job.id });
      },
      { onConflict: "reschedule", reschedule: { minDelay: 50, maxDelay: 200 } },
    );
    const { job } = await task.addJob(
      { id: 1 },
      { queueName: "q1", priority: 3, flags: ["f1"], jobKey: "later-1", maxAttempts: 7 },
    );
    const r = await runner({ connectionString: db.url, concurrency: 1, taskList: { later: task } });
    // Attempt 1 fails for real: attempts = 1 from now on.
    await new Promise((resolve) => r.events.once("job:error", resolve));
    const external = await holdExternally(task.lockKey({ id: 1 }));
    // (rescheduleJobs skips locked jobs: wait until the failure is written and the job unlocked)
    await waitFor(async () => (await jobRows())[0]?.locked_by === null, {
      message: "the failure to be written",
    });
    await h.utils.rescheduleJobs([job!.id], { runAt: new Date() });
    // Every conflict parks a new copy (the copy runs after minDelay, meets the held key again, ...).
    const copies: string[] = [];
    locks.events.on("job:rescheduled", (e) => void copies.push(e.newJobId));
    const rescheduled = await nextEvent(locks, "job:rescheduled");
    expect(rescheduled.job.id).toBe(job!.id);
    expect(rescheduled.delayMs).toBeLessThanOrEqual(50);
    const rows = await waitFor(
      async () => {
        const all = await jobRows();
        // (not while a copy is running, about to be parked again)
        return all.length === 1 && all[0]!.id !== job!.id && all[0]!.locked_by === null
          ? all
          : null;
      },
      { message: "the original to complete and its copy to remain" },
    );
    const copy = rows[0]!;
    expect(copies).toContain(copy.id);
    expect(copy.attempts).toBe(1); // the failure counts, the conflict does not
    expect(copy.max_attempts).toBe(7);
    expect(copy.key).toBe("later-1");
    expect(copy.queue_name).toBe("q1");
    expect(copy.priority).toBe(3);
    // (the caller's flag, and the key's, which every job of a `reschedule` task enqueued here carries)
    expect(copy.flags).toEqual({ f1: true, [`gwl:lock:${task.lockKey({ id: 1 })}`]: true });
    expect(copy.payload).toEqual({ id: 1 });
    // More conflicts while held; then the key frees and the job runs, never lost.
    await nextEvent(locks, "job:rescheduled");
    await external.release();
    await waitFor(async () => ran.length === 1, { message: "the rescheduled job to run" });
    expect(ran[0]!.attempts).toBe(2);
    await waitFor(async () => (await jobRows()).length === 0, { message: "the job's completion" });
  });

  it("reschedule survives a crash between the copy and the completion: neither lost nor run twice", async () => {
    const locks = newLocks();
    await locks.migrate();
    const { job } = await locks.addJob("crashy", { id: 1 }, { preemptive: false });
    // What a worker that fetched the job and then died looks like.
    await db
      .pool()
      .query(
        "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'dead-worker', attempts = attempts + 1 where id = $1",
        [job!.id],
      );
    const { rows } = await db
      .pool()
      .query<{ id: string }>("select graphile_worker_locks.reschedule_job($1, now())::text as id", [
        job!.id,
      ]);
    const copyId = rows[0]!.id;
    // ... and graphile-worker unlocks the dead worker's jobs eventually (4 hours later).
    await h.utils.forceUnlockWorkers(["dead-worker"]);
    const ran: string[] = [];
    const task = locks.exclusive("crashy", async (_p, helpers) => void ran.push(helpers.job.id));
    await runner({ connectionString: db.url, concurrency: 2, taskList: { crashy: task } });
    await waitFor(async () => ran.length === 1, { message: "the copy to run" });
    await new Promise((r) => setTimeout(r, 300));
    expect(ran).toEqual([copyId]);
    const left = await jobRows();
    expect(left.map((j) => j.id)).toEqual([job!.id]);
    expect(left[0]!.attempts).toBe(left[0]!.max_attempts); // permanently failed, never retried
  });
});

describe("limit", () => {
  it("limit 3 never runs more than 3 per key, across two lock sessions, and does run 3 at once", async () => {
    const timeline = new Timeline();
    const tasks = [newLocks(), newLocks()].map((locks) =>
      locks.exclusive(
        "sem",
        async (_p: { k: string }, helpers) => {
          const end = timeline.begin("sem", helpers.job.id, helpers.job.attempts);
          await new Promise((r) => setTimeout(r, 15));
          end();
        },
        { limit: 3, onConflict: "reschedule", reschedule: { minDelay: 5, maxDelay: 40 } },
      ),
    );
    await h.utils.addJobs(
      Array.from({ length: 60 }, () => ({ identifier: "sem", payload: { k: "x" } })),
    );
    for (const task of tasks)
      await runner({ connectionString: db.url, concurrency: 5, taskList: { sem: task } });
    await waitFor(async () => timeline.executions.filter((e) => e.end !== null).length === 60, {
      timeoutMs: 40_000,
      message: "all 60 jobs to run",
    });
    expect(timeline.maxConcurrency()).toBe(3);
  });
});

describe("lockAvailable and the preemptive check", () => {
  it("probing lockAvailable in a tight loop never causes a conflict", async () => {
    const locks = newLocks();
    const probe = newLocks();
    const ran: string[] = [];
    const task = locks.exclusive("probed", async (_p, helpers) => {
      await new Promise((r) => setTimeout(r, 10));
      ran.push(helpers.job.id);
    });
    const counts = countEvents(locks, ["lock:conflict"]);
    await runner({ connectionString: db.url, concurrency: 1, taskList: { probed: task } });
    let probing = true;
    const seen = new Set<boolean>();
    let probes = 0;
    const loop = (async () => {
      while (probing) {
        seen.add(await probe.lockAvailable("probed", { same: true }));
        probes++;
      }
    })();
    for (let i = 0; i < 30; i++) await task.addJob({ same: true }, { preemptive: false });
    await waitFor(async () => ran.length === 30, { message: "all jobs to run" });
    probing = false;
    await loop;
    expect(counts["lock:conflict"]).toBe(0);
    expect(seen).toEqual(new Set([true, false]));
    expect(probes).toBeGreaterThan(30);
  });

  it("addJob drops up front while the key is held, and adds again once it is free", async () => {
    const locks = newLocks();
    const task = locks.exclusive("pre", async () => undefined, {
      key: (p: { user: number; at?: string }) => p.user,
    });
    const dropped = countEvents(locks, ["enqueue:dropped"]);
    const external = await holdExternally(task.lockKey({ user: 7 }));
    expect(await task.lockAvailable({ user: 7, at: "x" })).toBe(false);
    expect(await locks.lockAvailable("pre", { user: 7 })).toBe(false);
    const first = await task.addJob({ user: 7, at: "a" });
    expect(first).toEqual({ job: null, outcome: "dropped" });
    const viaLocks = await locks.addJob("pre", { user: 7, at: "b" });
    expect(viaLocks.outcome).toBe("dropped");
    expect(dropped["enqueue:dropped"]).toBe(2);
    expect(await jobRows()).toEqual([]);
    const forced = await task.addJob({ user: 7 }, { preemptive: false });
    expect(forced.outcome).toBe("added");
    expect(forced.job!.task_identifier).toBe("pre");
    const other = await task.addJob({ user: 8 });
    expect(other.outcome).toBe("added");
    await external.release();
    expect(await task.lockAvailable({ user: 7 })).toBe(true);
    expect((await task.addJob({ user: 7 })).outcome).toBe("added");
    expect(await jobRows()).toHaveLength(3);
  });

  it("is off by default for strategies whose jobs must all run (reschedule, raise)", async () => {
    const locks = newLocks();
    const later = locks.exclusive("must_run", async () => undefined, { onConflict: "reschedule" });
    const raising = locks.exclusive("must_run_too", async () => undefined, { onConflict: "raise" });
    expect(later.options.preemptive).toBe(false);
    const external = await holdExternally(later.lockKey({ id: 1 }));
    const external2 = await holdExternally(raising.lockKey({ id: 1 }));
    expect((await later.addJob({ id: 1 })).outcome).toBe("added");
    expect((await raising.addJob({ id: 1 })).outcome).toBe("added");
    expect((await later.addJob({ id: 1 }, { preemptive: true })).outcome).toBe("dropped");
    await external.release();
    await external2.release();
  });

  it("rejects bad input with a typed error before anything is written", async () => {
    const locks = newLocks();
    const task = locks.exclusive("bad", async () => undefined, {
      key: (p: { id: unknown }) => {
        if (p.id === "boom") throw new Error("key function failed");
        return p.id;
      },
    });
    await expect(task.addJob({ id: 10n })).rejects.toThrow(InvalidArgumentError);
    await expect(task.addJob({ id: 10n })).rejects.toThrow(/payload\.id is a BigInt/);
    await expect(task.lockAvailable({ id: Symbol("s") })).rejects.toThrow(
      /key\(payload\) is a symbol/,
    );
    await expect(locks.addJob("other", { when: Number.NaN })).rejects.toThrow(
      /payload\.when is NaN/,
    );
    await expect(task.addJob({ id: "boom" })).rejects.toThrow(/key function failed/);
    expect(() =>
      locks.exclusive("x", async () => undefined, { onConflict: "skip" as never }),
    ).toThrow(/`onConflict` must be one of "drop", "reschedule", "raise", got "skip"/);
    expect(() => locks.exclusive("x", async () => undefined, { limit: 0 })).toThrow(
      /`limit` must be a positive integer/,
    );
    expect(() =>
      locks.exclusive("x", async () => undefined, { reschedule: { jitter: 2 } }),
    ).toThrow(/`reschedule.jitter` must be between 0 and 1/);
    expect(() => makeLocks({} as never)).toThrow(/needs `connectionString` or `pgPool`/);
    expect(() => makeLocks({ connectionString: db.url, heartbeatTimeout: 0 })).toThrow(
      /`heartbeatTimeout` must be a positive number of milliseconds, got 0/,
    );
    expect(() => makeLocks({ connectionString: db.url, heartbeatInterval: "5s" as never })).toThrow(
      InvalidArgumentError,
    );
    expect(await jobRows()).toEqual([]);
  });
});

describe("release", () => {
  it("an unlock PostgreSQL answers false is reported: lock:released with outcome unverified, and a warning", async () => {
    const { logger, warnings } = warningsLogger();
    const locks = newLocks({ logger });
    // The lock session's connection: the client that sends the lock statements.
    const sessionClients = new Set<pg.Client>();
    const stopWatching = h.watchLockStatements((client) => sessionClients.add(client));
    let ran = 0;
    const task = locks.exclusive("unverified", async (_p: { k: number }) => {
      ran++;
      // Something else on that connection lets every key go behind the library's back.
      const [sessionClient] = sessionClients;
      await sessionClient!.query("select pg_advisory_unlock_all()");
    });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { unverified: task } });
    const released = nextEvent(locks, "lock:released");
    await task.addJob({ k: 1 });
    const event = await released;
    stopWatching();
    expect(ran).toBe(1);
    expect(sessionClients.size).toBe(1);
    expect(event.outcome).toBe("unverified");
    expect(event.lockKey).toBe(task.lockKey({ k: 1 }));
    expect(
      warnings.filter((w) => /pg_advisory_unlock\(-?\d+\) returned false/.test(w)),
    ).toHaveLength(1);
    expect(locks.status().held).toEqual([]);
  });
});
