/**
 * Exclusive execution in one process: re-entrancy, conflict strategies, semaphores, introspection.
 * Real PostgreSQL, real graphile-worker runners, separate connections.
 */
import { Logger, makeWorkerUtils, type Runner, type WorkerUtils } from "graphile-worker";
import net from "node:net";
import pg from "pg";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  LockConflictError,
  lockKey,
  makeLocks,
  type HandoffCounts,
  type Locks,
} from "../src/index.js";
import { makeSql } from "../src/sql.js";
import { deferred, useTestDatabase, waitFor } from "./support/db.js";
import { highestConcurrency } from "../scripts/overlap.js";
import { countEvents, nextEvent, quietLogger, startRunner, Timeline } from "./support/runner.js";

const db = useTestDatabase();
let utils: WorkerUtils;
const cleanups: Array<() => Promise<unknown>> = [];

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url });
});
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  await db
    .pool()
    .query("delete from graphile_worker._private_jobs; delete from graphile_worker_locks.waiters");
});
afterAll(async () => {
  await utils?.release();
});

function newLocks(options: Partial<Parameters<typeof makeLocks>[0]> = {}): Locks {
  const locks = makeLocks({ connectionString: db.url, logger: quietLogger, ...options });
  cleanups.push(() => locks.release());
  return locks;
}
async function runner(options: Parameters<typeof startRunner>[0]): Promise<Runner> {
  const r = await startRunner(options);
  cleanups.push(() => r.stop());
  return r;
}
/** Holds an advisory key on a connection of its own, as another process would. */
async function holdExternally(key: bigint): Promise<{ release(): Promise<void> }> {
  const client = new pg.Client({ connectionString: db.url });
  await client.connect();
  await client.query("select pg_advisory_lock($1)", [key.toString()]);
  let done = false;
  const release = async () => {
    if (done) return;
    done = true;
    await client.end();
  };
  cleanups.push(release);
  return { release };
}
async function jobRows() {
  const { rows } = await db.pool().query<{
    id: string;
    attempts: number;
    max_attempts: number;
    run_at: Date;
    key: string | null;
    last_error: string | null;
    locked_by: string | null;
    payload: unknown;
    priority: number;
    queue_name: string | null;
    flags: Record<string, true> | null;
  }>(
    `select j.id::text, j.attempts, j.max_attempts, j.run_at, j.key, j.last_error, j.locked_by, j.payload,
            j.priority, q.queue_name, j.flags
     from graphile_worker._private_jobs j left join graphile_worker._private_job_queues q on q.id = j.job_queue_id
     order by j.id`,
  );
  return rows;
}

/** Marks a job as fetched by a worker, as graphile-worker's fetch would (for SQL-level tests). */
const markFetched = (id: string) =>
  db
    .pool()
    .query(
      "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1 where id = $1",
      [id],
    );
/**
 * Parks job `id` behind `key` as a worker's `reschedule` would (fetched, copied with its safety net at
 * `runAt`, the original completed); resolves the copy's id.
 */
const parkFetched = async (id: string, key: string, runAt: string): Promise<string> => {
  await markFetched(id);
  const { rows } = await db
    .pool()
    .query<{ id: string }>(
      "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2)",
      [id, runAt, key],
    );
  await db.pool().query("delete from graphile_worker._private_jobs where id = $1", [id]);
  return rows[0]!.id;
};
/** A query on the helper pool (for SQL-level tests). */
const q = <R extends object>(text: string, values: unknown[] = []) =>
  db.pool().query<R & pg.QueryResultRow>(text, values);
/** How many parked jobs wait for a key. */
const parkedCount = async () =>
  Number(
    (await db.pool().query("select count(*) from graphile_worker_locks.waiters")).rows[0].count,
  );

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
    await utils.addJobs(
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
    await utils.rescheduleJobs([job!.id], { runAt: new Date() });
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
    await utils.rescheduleJobs([job!.id], { runAt: new Date() });
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
    await utils.forceUnlockWorkers(["dead-worker"]);
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
    await utils.addJobs(
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
    const warnings: string[] = [];
    const logger = new Logger(() => (level, message) => {
      if (level === "warning") warnings.push(message);
    });
    const locks = newLocks({ logger });
    // The lock session's connection: the client that sends the lock statements.
    const sessionClients = new Set<pg.Client>();
    const original = pg.Client.prototype.query;
    const restore = async () => {
      pg.Client.prototype.query = original;
    };
    cleanups.push(restore);
    pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
      const config = args[0] as { name?: string } | undefined;
      if (typeof config === "object" && config?.name?.startsWith("gwl_lock_"))
        sessionClients.add(this);
      return (original as (...a: unknown[]) => unknown).apply(this, args);
    } as typeof original;
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
    await restore();
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

describe("lock loss", () => {
  it("pg_terminate_backend of the lock session: abort fires, lock:lost, reconnect, and a late release frees nothing", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 200 } });
    const aborted = deferred<unknown>();
    const finishA = deferred();
    const finishB = deferred();
    const startedB = deferred<boolean>();
    const task = locks.exclusive(
      "victim",
      async (p: { k: string; role: string }, helpers) => {
        if (p.role === "A") {
          helpers.abortSignal!.addEventListener("abort", () =>
            aborted.resolve(helpers.abortSignal!.reason),
          );
          await finishA.promise; // ignores the abort for a while: its release comes late
        } else {
          // A job of the new connection gets a live signal (the old connection's one has aborted).
          startedB.resolve(helpers.abortSignal!.aborted);
          await finishB.promise;
        }
      },
      { key: (p) => p.k },
    );
    await runner({ connectionString: db.url, concurrency: 3, taskList: { victim: task } });
    const lost = nextEvent(locks, "lock:lost");
    const acquiredA = nextEvent(locks, "lock:acquired");
    await task.addJob({ k: "k", role: "A" });
    await acquiredA;
    const oldPid = locks.status().pid!;
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [oldPid]);

    const reason = (await aborted.promise) as { code?: string };
    expect(reason.code).toBe("GWL_LOCK_LOST");
    const lostEvent = await lost;
    expect(lostEvent.holds.map((h) => h.taskIdentifier)).toEqual(["victim"]);
    await reconnected;
    const newPid = locks.status().pid!;
    expect(newPid).not.toBe(oldPid);

    // B takes the same key on the new session while A is still running.
    await task.addJob({ k: "k", role: "B" });
    expect(await startedB.promise).toBe(false);
    const releasedA = nextEvent(locks, "lock:released", (e) => e.outcome === "lost");
    finishA.resolve();
    await releasedA;
    const held = await locks.heldLocks();
    expect(held.filter((h) => h.lockKey === lockKey("victim", "k")).map((h) => h.pid)).toEqual([
      newPid,
    ]);
    expect(await task.lockAvailable({ k: "k", role: "" })).toBe(false);
    finishB.resolve();
    await waitFor(() => task.lockAvailable({ k: "k", role: "" }), { message: "B to release" });
  });

  it("the same worker's next job after a reconnection gets a live abort signal", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 200 } });
    const seen: Array<{ id: number; aborted: boolean }> = [];
    const release = deferred();
    const task = locks.exclusive("one_worker", async (p: { id: number }, helpers) => {
      const signal = helpers.abortSignal!;
      if (p.id === 1)
        await Promise.race([
          release.promise,
          new Promise((r) => signal.addEventListener("abort", r)),
        ]);
      seen.push({ id: p.id, aborted: signal.aborted });
    });
    // One worker: job 2 runs where job 1 ran, after the connection job 1 held its lock on was lost.
    await runner({ connectionString: db.url, concurrency: 1, taskList: { one_worker: task } });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({ id: 1 });
    await acquired;
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [locks.status().pid]);
    await reconnected;
    await task.addJob({ id: 2 });
    await waitFor(async () => seen.length === 2, { message: "both jobs to run" });
    expect(seen).toEqual([
      { id: 1, aborted: true },
      { id: 2, aborted: false },
    ]);
    release.resolve();
  });

  it("a connection that goes silent (no reset, no answer) is given up after heartbeatTimeout: holders abort", async () => {
    // A TCP proxy in front of PostgreSQL whose connections can be frozen: bytes stop flowing both ways,
    // nothing is closed, as when a network drops packets.
    const target = new URL(db.url);
    const frozen = new Set<net.Socket>();
    const sockets: net.Socket[] = [];
    const proxy = net.createServer((inbound) => {
      const outbound = net.connect(Number(target.port), target.hostname);
      sockets.push(inbound, outbound);
      for (const [from, to] of [
        [inbound, outbound],
        [outbound, inbound],
      ] as const) {
        from.on("error", () => undefined);
        from.on("data", (chunk) => {
          if (!frozen.has(inbound)) to.write(chunk);
        });
        // (a frozen connection does not pass its close on either: the network is gone, not the peer)
        from.on("close", () => {
          if (!frozen.has(inbound)) to.destroy();
        });
      }
    });
    await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
    cleanups.push(async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => proxy.close(resolve));
    });
    const proxied = new URL(db.url);
    proxied.hostname = "127.0.0.1";
    proxied.port = String((proxy.address() as net.AddressInfo).port);

    const locks = newLocks({
      lockConnectionString: proxied.toString(),
      // (generous enough that a test machine busy with the other test files is not taken for a dead one)
      heartbeatInterval: 200,
      heartbeatTimeout: 2000,
      reconnectDelay: { min: 50, max: 100 },
    });
    const aborted = deferred<{ code?: string }>();
    const task = locks.exclusive("silent", async (_p, helpers) => {
      const signal = helpers.abortSignal!;
      await new Promise<void>((resolve) =>
        signal.addEventListener("abort", () => {
          aborted.resolve(signal.reason as { code?: string });
          resolve();
        }),
      );
    });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { silent: task } });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    const oldPid = locks.status().pid!;
    const lost = nextEvent(locks, "lock:lost");
    const reconnected = nextEvent(locks, "session:connected");
    for (const socket of sockets) frozen.add(socket);

    expect((await aborted.promise).code).toBe("GWL_LOCK_LOST");
    expect((await lost).error.message).toMatch(/heartbeat|unanswered/);
    // The old backend never heard of it and still holds the key: another job of the key cannot start
    // until PostgreSQL ends that backend (here by hand; in life, its own keepalive or a DBA).
    expect(await task.lockAvailable({})).toBe(false);
    await db.pool().query("select pg_terminate_backend($1)", [oldPid]);
    await reconnected;
    expect(locks.status().pid).not.toBe(oldPid);
    await waitFor(() => task.lockAvailable({}), { message: "the old backend's lock to go" });
  });

  it("graphile-worker's own shutdown abort reaches the task through the combined signal", async () => {
    const locks = newLocks();
    const aborted = deferred<void>();
    const task = locks.exclusive("shutdown", async (_p, helpers) => {
      await new Promise<void>((resolve) =>
        helpers.abortSignal!.addEventListener("abort", () => resolve()),
      );
      aborted.resolve();
    });
    const r = await startRunner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { shutdown: task },
      preset: { worker: { gracefulShutdownAbortTimeout: 100 } },
    });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    await Promise.all([r.stop(), aborted.promise]);
    await waitFor(async () => locks.status().held.length === 0, { message: "the release" });
  });
});

describe("reschedule hand-off", () => {
  it("a parked job is woken the moment its key is released, not after its safety-net delay", async () => {
    const locks = newLocks();
    const finishA = deferred();
    const startedB = deferred<number>();
    let releasedAt = 0;
    const task = locks.exclusive(
      "handoff",
      async (p: { k: string; role: string }) => {
        if (p.role === "A") {
          await finishA.promise;
          releasedAt = performance.now();
        } else startedB.resolve(performance.now());
      },
      {
        key: (p) => p.k,
        onConflict: "reschedule",
        reschedule: { minDelay: 60_000, maxDelay: 60_000 },
      },
    );
    await runner({ connectionString: db.url, concurrency: 2, taskList: { handoff: task } });
    const acquiredA = nextEvent(locks, "lock:acquired");
    await task.addJob({ k: "h", role: "A" });
    await acquiredA;
    const parked = nextEvent(locks, "job:rescheduled");
    await task.addJob({ k: "h", role: "B" }, { preemptive: false });
    const { runAt } = await parked;
    expect(runAt.getTime()).toBeGreaterThan(Date.now() + 20_000);
    finishA.resolve();
    const startB = await startedB.promise;
    const handoffMs = startB - releasedAt;
    console.info(`hand-off ${handoffMs.toFixed(1)} ms`);
    expect(handoffMs).toBeLessThan(20_000); // woken, not waiting out the 60 s net
    const { rows } = await db.pool().query("select * from graphile_worker_locks.waiters");
    expect(rows).toEqual([]);
  });

  it("parked jobs run in enqueue order, across two sessions, and a job enqueued meanwhile waits its turn", async () => {
    const ran: number[] = [];
    const spans: Array<{ start: number; end: number }> = [];
    const gate = deferred();
    const tasks = [newLocks(), newLocks()].map((locks) =>
      locks.exclusive(
        "fifo",
        async (p: { n: number }) => {
          const start = performance.now();
          if (p.n === 0) await gate.promise;
          ran.push(p.n);
          await new Promise((resolve) => setTimeout(resolve, 5));
          spans.push({ start, end: performance.now() });
        },
        { key: () => "one key", onConflict: "reschedule" },
      ),
    );
    // Two runners, each with its own lock session: every hand-off between them goes through PostgreSQL.
    for (const task of tasks) {
      await runner({ connectionString: db.url, concurrency: 3, taskList: { fifo: task } });
    }
    await tasks[0]!.addJob({ n: 0 });
    await waitFor(async () => ran.length === 0 && !(await tasks[0]!.lockAvailable({ n: 0 })), {
      message: "job 0 to hold the key",
    });
    for (let n = 1; n <= 8; n++) await tasks[n % 2]!.addJob({ n }, { preemptive: false });
    await waitFor(async () => (await parkedCount()) === 8, { message: "jobs 1-8 to park" });
    gate.resolve();
    // Enqueued while the line moves: they go to the back, they do not take a key that frees in between.
    for (let n = 9; n <= 13; n++) {
      await waitFor(async () => ran.length >= n - 7, { message: "the line to move" });
      await tasks[n % 2]!.addJob({ n }, { preemptive: false });
    }
    await waitFor(async () => ran.length === 14, { message: "every job to run" });
    expect(ran).toEqual([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]);
    // (both runners are in this process, so one clock serves: never two at once across the sessions)
    expect(highestConcurrency(spans)).toBe(1);
  });

  it("a runner given forbiddenFlags: locks.forbiddenFlags fetches no job of a key it holds, then runs each once, one at a time", async () => {
    const locks = newLocks();
    const ran: number[] = [];
    const spans: Array<{ start: number; end: number }> = [];
    const gate = deferred();
    const task = locks.exclusive(
      "skip_held",
      async (p: { n: number }) => {
        const start = performance.now();
        if (p.n === 0) await gate.promise;
        ran.push(p.n);
        await new Promise((resolve) => setTimeout(resolve, 2));
        spans.push({ start, end: performance.now() });
      },
      { key: () => "one key", onConflict: "reschedule" },
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { skip_held: task },
      forbiddenFlags: locks.forbiddenFlags,
    });
    // graphile-worker reads forbiddenFlags as a worker begins a fetch: a fetch begun before job 0's hold was
    // recorded skips nothing. Fetches in flight are counted, so that jobs 1-6 are added only once every such
    // fetch has ended.
    const fetching = new Set<string>();
    r.events.on("worker:getJob:start", ({ worker }) => fetching.add(worker.workerId));
    for (const ended of ["worker:getJob:empty", "worker:getJob:error", "job:start"] as const)
      r.events.on(ended, ({ worker }) => fetching.delete(worker.workerId));
    const { job } = await task.addJob({ n: 0 });
    expect(Object.keys(job!.flags ?? {})).toEqual([`gwl:lock:${task.lockKey({ n: 0 })}`]);
    await waitFor(async () => locks.forbiddenFlags().length > 0, { message: "job 0 to hold" });
    expect(locks.forbiddenFlags()).toEqual([`gwl:lock:${task.lockKey({ n: 0 })}`]);
    expect(await task.lockAvailable({ n: 0 })).toBe(false);
    await waitFor(async () => fetching.size === 0, {
      message: "fetches begun before the hold to end",
    });
    let emptyFetches = 0;
    r.events.on("worker:getJob:empty", () => emptyFetches++);
    for (let n = 1; n <= 6; n++) await task.addJob({ n });
    // Every add nudges the idle workers: they fetch, and find nothing they may run.
    await waitFor(async () => emptyFetches >= 6, { message: "the idle workers to fetch" });
    const { rows } = await db
      .pool()
      .query("select count(*)::int as n from graphile_worker.jobs where locked_at is not null");
    expect(rows[0].n).toBe(1);
    gate.resolve();
    await waitFor(async () => ran.length === 7, { message: "every job to run" });
    expect(ran[0]).toBe(0);
    expect([...ran].sort((a, b) => a - b)).toEqual([0, 1, 2, 3, 4, 5, 6]);
    expect(highestConcurrency(spans)).toBe(1);
    // (Their order is graphile-worker's fetch order, except that idle workers fetching in the instant the
    // key frees race for it: a job that loses parks and waits its turn.)
  });

  describe("the line holds under load (SQL)", () => {
    const S = "graphile_worker_locks";
    /** Two jobs of `task` parked behind one key in enqueue order: the key and the copies' ids. */
    const lineOfTwo = async (task: string) => {
      const locks = newLocks();
      await locks.migrate();
      const key = lockKey(task, "k");
      const later = new Date(Date.now() + 3_600_000).toISOString();
      const copies: string[] = [];
      for (let n = 1; n <= 2; n++) {
        const { job } = await locks.addJob(task, { n });
        copies.push(await parkFetched(job!.id, key.toString(), later));
      }
      const [first, second] = copies as [string, string];
      return { locks, key, first, second };
    };
    /** The job of a key's last wake. */
    const wokenFor = async (key: bigint) =>
      (
        await q<{ job_id: string }>(`select job_id::text from ${S}.wakes where lock_key = $1`, [
          key.toString(),
        ])
      ).rows.map((r) => r.job_id);
    const isNext = async (key: bigint, job: string) =>
      (await q<{ ok: boolean }>(`select ${S}.is_next($1, $2) as ok`, [key.toString(), job]))
        .rows[0]!.ok;
    /** Moves a key's last wake, or a job's fetch, back in time by `ago` (an interval). */
    const wokenAgo = (key: bigint, ago: string) =>
      q(`update ${S}.wakes set at = clock_timestamp() - $2::interval where lock_key = $1`, [
        key.toString(),
        ago,
      ]);
    const fetchedAgo = (job: string, ago: string) =>
      q("update graphile_worker._private_jobs set locked_at = now() - $2::interval where id = $1", [
        job,
        ago,
      ]);

    it("a waiter fetched by its safety net holds the line while it decides: the one behind does not take the free key", async () => {
      const { key, first, second } = await lineOfTwo("deciding");
      // Both safety nets ran out at once: both are fetched, the key is free, the first has not tried yet.
      await markFetched(first);
      await markFetched(second);
      expect(await isNext(key, second)).toBe(false);
      expect(await isNext(key, first)).toBe(true);
      // A fetch whose worker died long ago (graphile-worker keeps it locked for hours) does not stop the line.
      await fetchedAgo(first, "1 minute");
      expect(await isNext(key, second)).toBe(true);
    });

    it("a woken job not fetched within 100 ms is still on its way: nobody behind takes the key, and no second job is woken", async () => {
      const { locks, key, first, second } = await lineOfTwo("slowfetch");
      await q(`select ${S}.wake_waiters($1)`, [[key.toString()]]);
      // The workers are busy: half a second later the woken job is still waiting to be fetched.
      await wokenAgo(key, "500 milliseconds");
      const { job } = await locks.addJob("slowfetch", { n: 3 });
      await markFetched(job!.id);
      await markFetched(second);
      expect(await isNext(key, job!.id)).toBe(false);
      expect(await isNext(key, second)).toBe(false);
      const { rows } = await q<{ woken: number }>(`select ${S}.wake_if_free($1, $2, $3) as woken`, [
        [key.toString()],
        key.toString(),
        job!.id,
      ]);
      expect(rows[0]!.woken).toBe(0);
      expect(await wokenFor(key)).toEqual([first]);
      // A wake is over once its job is gone (it ran, or parked again under a new id).
      await q("delete from graphile_worker._private_jobs where id = $1", [first]);
      expect(await isNext(key, second)).toBe(true);
    });

    it("a woken job's wake goes stale after 2 seconds (its worker died)", async () => {
      const { key, first, second } = await lineOfTwo("stalewake");
      await q(`select ${S}.wake_waiters($1)`, [[key.toString()]]);
      await markFetched(first);
      await markFetched(second);
      expect(await isNext(key, second)).toBe(false);
      await wokenAgo(key, "3 seconds");
      await fetchedAgo(first, "3 seconds");
      expect(await isNext(key, second)).toBe(true);
    });

    it("a holder that took its key by its safety net wakes the next in line at its release", async () => {
      const { key, first, second } = await lineOfTwo("selfline");
      // The first waiter's safety net ran out; it took the key (its waiter row stays while it runs)...
      await markFetched(first);
      // ...and releases it, before graphile-worker completes the job.
      const { rows } = await q<{ woken: number }>(`select ${S}.release_waiters($1, $2) as woken`, [
        [key.toString()],
        [first],
      ]);
      expect(rows[0]!.woken).toBe(1);
      const woken = await q<{ ready: boolean }>(
        "select run_at <= now() as ready from graphile_worker._private_jobs where id = $1",
        [second],
      );
      expect(woken.rows[0]!.ready).toBe(true);
      expect(await wokenFor(key)).toEqual([second]);
      expect(await parkedCount()).toBe(0);
    });
  });

  it("a parked job's safety net is later the further back in line it is, and never past the latest", async () => {
    const locks = newLocks();
    await locks.migrate();
    const key = lockKey("line", "k").toString();
    const soon = new Date(Date.now() + 1000);
    const latest = new Date(soon.getTime() + 2500);
    const runAts: number[] = [];
    for (let n = 0; n < 5; n++) {
      const { job } = await locks.addJob("line", { n });
      await markFetched(job!.id);
      const { rows } = await db
        .pool()
        .query<{ run_at: Date }>(
          "select run_at from graphile_worker_locks.park_job($1, $2, $3, interval '1 second', $4)",
          [job!.id, soon.toISOString(), key, latest.toISOString()],
        );
      runAts.push(rows[0]!.run_at.getTime() - soon.getTime());
    }
    expect(runAts).toEqual([0, 1000, 2000, 2500, 2500]);
  });

  it("a release that finds nobody waiting retires the last wake: a job parking a moment later is woken, not stranded", async () => {
    const locks = newLocks();
    await locks.migrate();
    const key = lockKey("sw", "k");
    const later = new Date(Date.now() + 3_600_000).toISOString();
    const fetchAndPark = async (n: number) => {
      const { job } = await locks.addJob("sw", { n });
      await markFetched(job!.id);
      const { rows } = await q(
        "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2)",
        [job!.id, later, key.toString()],
      );
      return { original: job!.id, copy: (rows[0] as { id: string }).id };
    };
    const wakeWaiters = () =>
      q("select graphile_worker_locks.wake_waiters($1)", [[key.toString()]]);
    // H waited, was woken (a wake on its way to the key), took the key...
    await fetchAndPark(1);
    await wakeWaiters();
    const h = await holdExternally(key);
    // ...and released it: unlock, then wake, with nobody waiting yet.
    await h.release();
    await wakeWaiters();
    // P met the key while H held it, and its park commits only now: its own check must wake it.
    const p = await fetchAndPark(2);
    const { rows } = await q("select graphile_worker_locks.wake_if_free($1, $2, $3) as woken", [
      [key.toString()],
      key.toString(),
      p.original,
    ]);
    expect((rows[0] as { woken: number }).woken).toBe(1);
  });

  it("the parker's own check wakes it when the key freed before its waiter was visible (no lost wake-up)", async () => {
    const locks = newLocks();
    await locks.migrate();
    const key = lockKey("lw", { id: 1 });
    const { job } = await locks.addJob("lw", { id: 1 });
    await markFetched(job!.id);
    const external = await holdExternally(key);
    const later = new Date(Date.now() + 3_600_000).toISOString();
    const { rows } = await db
      .pool()
      .query<{ id: string }>(
        "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2)",
        [job!.id, later, key.toString()],
      );
    const copy = rows[0]!.id;
    const wake = () =>
      db
        .pool()
        .query<{ woken: number }>(
          "select graphile_worker_locks.wake_if_free($1, $2, $3) as woken",
          [[key.toString()], key.toString(), job!.id],
        );
    // Still held: the releaser will wake it.
    expect((await wake()).rows[0]!.woken).toBe(0);
    // Released by a holder that wakes no one (here: outside the library): the parker's check does.
    await external.release();
    expect((await wake()).rows[0]!.woken).toBe(1);
    const { rows: after } = await db
      .pool()
      .query<{ run_at: Date }>("select run_at from graphile_worker.jobs where id = $1", [copy]);
    expect(after[0]!.run_at.getTime()).toBeLessThanOrEqual(Date.now() + 1000);
    expect((await db.pool().query("select * from graphile_worker_locks.waiters")).rows).toEqual([]);
  });

  /**
   * A `reschedule` task on one key that records its runs; `slow` payloads run `slowMs` instead of `ms`, and
   * `gated` ones until `gate` resolves.
   */
  function lineTask(
    locks: Locks,
    identifier: string,
    ms: number,
    slowMs = ms,
    gate?: Promise<void>,
  ) {
    const ran: number[] = [];
    const spans: Array<{ start: number; end: number }> = [];
    const task = locks.exclusive(
      identifier,
      async (p: { n: number; slow?: boolean; gated?: boolean }) => {
        const start = performance.now();
        ran.push(p.n);
        if (p.gated) await gate;
        await new Promise((resolve) => setTimeout(resolve, p.slow ? slowMs : ms));
        spans.push({ start, end: performance.now() });
      },
      { key: () => "one key", onConflict: "reschedule" },
    );
    return { task, ran, spans };
  }

  it("in one process the next job, woken early, takes the key from its holder without an unlock, in line order", async () => {
    const locks = newLocks();
    const { task, ran, spans } = lineTask(locks, "early_local", 15);
    const rescheduled = countEvents(locks, ["job:rescheduled"]);
    for (let n = 0; n < 24; n++) await task.addJob({ n }, { preemptive: false });
    await runner({ connectionString: db.url, concurrency: 4, taskList: { early_local: task } });
    await waitFor(async () => spans.length === 24, { message: "every job to run" });
    expect([...ran].sort((a, b) => a - b)).toEqual(Array.from({ length: 24 }, (_, n) => n));
    expect(highestConcurrency(spans)).toBe(1);
    // The line decides from the first wait on: only the first fetches may race for the key (with 4 workers
    // that race can show twice, e.g. 2 1 4 3 when job 3's park commits just after the wake that took job 4).
    const outOfOrder = ran.filter((n, i) => i > 0 && n < ran[i - 1]!).length;
    expect(outOfOrder).toBeLessThanOrEqual(2);
    const { handoffs } = locks.status();
    expect(handoffs.prewakes).toBeGreaterThan(0);
    expect(handoffs.handedOver).toBeGreaterThan(0);
    // A job woken early waits for the key instead of parking again: about one park per job, not two.
    expect(rescheduled["job:rescheduled"]).toBeLessThan(24 + 4);
    await waitFor(async () => (await parkedCount()) === 0, { message: "no waiter left" });
    await waitFor(async () => locks.status().held.length === 0, {
      message: "the key to be released",
    });
  });

  /**
   * 30 jobs of one key over two lock sessions, each with a runner of concurrency 3 (given to `attach` if
   * asked): asserts that every job ran once and never two at once, and resolves each session's hand-offs.
   */
  async function twoSessionLine(identifier: string, attach: boolean) {
    const lines = [newLocks(), newLocks()].map((locks) => ({
      locks,
      ...lineTask(locks, identifier, 15),
    }));
    for (let n = 0; n < 30; n++) await lines[n % 2]!.task.addJob({ n }, { preemptive: false });
    for (const { locks, task } of lines) {
      const r = await runner({
        connectionString: db.url,
        concurrency: 3,
        taskList: { [identifier]: task },
      });
      if (attach) locks.attach(r);
    }
    await waitFor(async () => lines[0]!.spans.length + lines[1]!.spans.length === 30, {
      message: "every job to run",
    });
    const ran = [...lines[0]!.ran, ...lines[1]!.ran];
    expect(ran.sort((a, b) => a - b)).toEqual(Array.from({ length: 30 }, (_, n) => n));
    // (both sessions are in this process, so one clock serves)
    expect(highestConcurrency([...lines[0]!.spans, ...lines[1]!.spans])).toBe(1);
    await waitFor(async () => (await parkedCount()) === 0, { message: "no waiter left" });
    return lines.map((l) => l.locks.status().handoffs);
  }
  const total = (handoffs: HandoffCounts[], what: keyof HandoffCounts) =>
    handoffs.reduce((sum, h) => sum + h[what], 0);

  it("across two sessions the job woken early waits for the other session's release, told by a notification", async () => {
    const handoffs = await twoSessionLine("early_remote", false);
    expect(total(handoffs, "afterRelease")).toBeGreaterThan(0);
    // Without attach, no session knows an idle worker of its own: every early wake is announced to all.
    expect(handoffs.map((h) => h.wokenHere)).toEqual([0, 0]);
  });

  it("with runners attached, an early wake goes to an idle worker of the holder's process, and the key passes in memory", async () => {
    const handoffs = await twoSessionLine("early_attached", true);
    expect(total(handoffs, "wokenHere")).toBeGreaterThan(0);
    expect(total(handoffs, "handedOver")).toBeGreaterThan(0);
  });

  it("a holder that overruns: the job woken early stops waiting, parks again in its place, and runs next", async () => {
    const locks = newLocks();
    const gate = deferred();
    cleanups.push(async () => gate.resolve());
    const { task, ran, spans } = lineTask(locks, "early_overrun", 5, 700, gate.promise);
    const parks = new Map<number, number>();
    locks.events.on("job:rescheduled", ({ job }) => {
      const { n } = job.payload as { n: number };
      parks.set(n, (parks.get(n) ?? 0) + 1);
    });
    // Five short jobs teach the task its usual hold.
    for (let n = 0; n < 5; n++) await task.addJob({ n }, { preemptive: false });
    await runner({
      connectionString: db.url,
      concurrency: 3,
      taskList: { early_overrun: task },
    });
    await waitFor(async () => spans.length === 5, { message: "the short jobs to run" });
    // While another job holds the key, 6 (which will overrun), 7 and 8 park: a line.
    await task.addJob({ n: 5, gated: true }, { preemptive: false });
    await waitFor(async () => !(await task.lockAvailable({ n: 0 })), {
      message: "the gate job to hold",
    });
    await task.addJob({ n: 6, slow: true }, { preemptive: false });
    for (let n = 7; n < 9; n++) await task.addJob({ n }, { preemptive: false });
    await waitFor(async () => (await parkedCount()) === 3, { message: "6, 7 and 8 to park" });
    gate.resolve();
    await waitFor(async () => spans.length === 9, { message: "every job to run" });
    expect(ran.slice(5)).toEqual([5, 6, 7, 8]);
    expect(highestConcurrency(spans)).toBe(1);
    // 6 took the key with a line behind it and woke 7 early; 7 waited, gave up while 6 overran, parked
    // again in its place and was woken by 6's release.
    expect(locks.status().handoffs.prewakes).toBeGreaterThan(0);
    expect(parks.get(7)).toBe(2);
    expect(parks.get(8)).toBe(1);
  });

  it("a release wakes nobody else while the job woken early is on its way, and wakes the line once it parked again", async () => {
    const locks = newLocks();
    await locks.migrate();
    const key = lockKey("pw", "k").toString();
    const later = new Date(Date.now() + 3_600_000).toISOString();
    const park = (id: string) => parkFetched(id, key, later);
    const ids: string[] = [];
    for (let n = 0; n < 3; n++) ids.push((await locks.addJob("pw", { n })).job!.id);
    const holder = ids[0]!;
    await markFetched(holder);
    const waitingA = await park(ids[1]!);
    const waitingB = await park(ids[2]!);
    const listener = new pg.Client({ connectionString: db.url });
    await listener.connect();
    cleanups.push(() => listener.end());
    const notices: string[] = [];
    listener.on("notification", (m) => notices.push(`${m.channel}:${m.payload}`));
    await listener.query("listen gwl_release");

    // The holder wakes the first in line early.
    const { rows: early } = await q(
      "select i, job_id::text as job_id from graphile_worker_locks.prewake($1)",
      [[key]],
    );
    expect(early).toEqual([{ i: 1, job_id: waitingA }]);
    const wokenAt = async (id: string) =>
      (
        await q<{ run_at: Date }>(
          "select run_at from graphile_worker._private_jobs where id = $1",
          [id],
        )
      ).rows[0]!.run_at;
    expect((await wokenAt(waitingA)).getTime()).toBeLessThan(Date.now() + 1000);
    // It is fetched (running) when the holder releases: nobody else is woken, its session is told.
    await markFetched(waitingA);
    const release = (jobId: string) =>
      q("select graphile_worker_locks.release_waiters($1, $2) as woken", [[key], [jobId]]);
    expect((await release(holder)).rows[0]!.woken).toBe(0);
    await waitFor(async () => notices.length > 0, { message: "the notification" });
    expect(notices).toEqual([`gwl_release:${key}`]);
    expect((await wokenAt(waitingB)).getTime()).toBeGreaterThan(Date.now() + 60_000);

    // Next time the early-woken job gave up waiting and parked again (under a new id, in its place): the
    // release wakes the first in line, which is that job.
    await q("select i from graphile_worker_locks.prewake($1)", [[key]]);
    const { rows: again } = await q(
      "select job_id::text as job_id from graphile_worker_locks.prewakes where lock_key = $1",
      [key],
    );
    expect(again).toEqual([{ job_id: waitingB }]);
    const reparked = await park(waitingB);
    expect((await release(waitingA)).rows[0]!.woken).toBe(1);
    expect((await wokenAt(reparked)).getTime()).toBeLessThan(Date.now() + 1000);
    expect(notices).toHaveLength(1);
  });

  it("an early wake left to the holder's process is not announced; its release announces it if still unfetched", async () => {
    const locks = newLocks();
    await locks.migrate();
    const key = lockKey("pq", "k").toString();
    const later = new Date(Date.now() + 3_600_000).toISOString();
    const ids: string[] = [];
    for (let n = 0; n < 3; n++) ids.push((await locks.addJob("pq", { n })).job!.id);
    const holder = ids[0]!;
    await markFetched(holder);
    const waiting: string[] = [];
    for (const id of ids.slice(1)) waiting.push(await parkFetched(id, key, later));
    const listener = new pg.Client({ connectionString: db.url });
    await listener.connect();
    cleanups.push(() => listener.end());
    const notices: string[] = [];
    listener.on("notification", (m) =>
      notices.push(
        m.channel === "jobs:insert"
          ? `jobs:insert:${JSON.parse(m.payload!).count ?? m.payload}`
          : `${m.channel}:${m.payload}`,
      ),
    );
    await listener.query('listen "jobs:insert"; listen gwl_release');
    // Notifications arrive in commit order: once a marker sent afterwards arrived, whatever came before did.
    let markers = 0;
    const settle = async () => {
      const marker = `marker${++markers}`;
      await q("select pg_notify('gwl_release', $1)", [marker]);
      await waitFor(async () => notices.includes(`gwl_release:${marker}`), {
        message: "the marker notification",
      });
      return notices.splice(0).filter((n) => !n.endsWith(marker));
    };

    // Quiet: the first in line is woken (runnable now) and nobody is told.
    const { rows: early } = await q(
      "select i, job_id::text as job_id from graphile_worker_locks.prewake($1, false)",
      [[key]],
    );
    expect(early).toEqual([{ i: 1, job_id: waiting[0] }]);
    const { rows: runnable } = await q(
      "select run_at <= now() as runnable from graphile_worker._private_jobs where id = $1",
      [waiting[0]],
    );
    expect(runnable).toEqual([{ runnable: true }]);
    expect(await settle()).toEqual([]);

    // Nobody fetched it by the release: the release tells its session (should it be fetched meanwhile) and
    // announces it to every worker; it still wakes nobody else.
    const release = (jobId: string) =>
      q("select graphile_worker_locks.release_waiters($1, $2) as woken", [[key], [jobId]]);
    expect((await release(holder)).rows[0]!.woken).toBe(0);
    expect((await settle()).sort()).toEqual([`gwl_release:${key}`, "jobs:insert:1"]);

    // The one-argument prewake (older versions of this library) announces, as it did.
    await markFetched(waiting[0]!);
    const { rows: announced } = await q(
      "select job_id::text as job_id from graphile_worker_locks.prewake($1)",
      [[key]],
    );
    expect(announced).toEqual([{ job_id: waiting[1] }]);
    expect(await settle()).toEqual(["jobs:insert:1"]);
    // Fetched by the release: only its session is told.
    await markFetched(waiting[1]!);
    expect((await release(waiting[0]!)).rows[0]!.woken).toBe(0);
    expect(await settle()).toEqual([`gwl_release:${key}`]);
  });
});

describe("plans with a long line analyzed", () => {
  it("is_next and the lock statement read a key's waiters by position, never every waiter or every job", async () => {
    const client = new pg.Client({ connectionString: db.url });
    await client.connect();
    cleanups.push(() => client.end());
    // 4,000 jobs, half of them parked over 10 keys, the tables analyzed with the line in them (as autovacuum
    // does in the middle of a burst), and the generic plans the lock session uses.
    await client.query("begin");
    await client.query("set local plan_cache_mode = force_generic_plan");
    await client.query(
      `select graphile_worker.add_jobs(array(
         select row('long_line', json_build_object('n', g), null, null, null, null, null, null)::graphile_worker.job_spec
         from generate_series(1, 4000) g))`,
    );
    await client.query(
      `insert into graphile_worker_locks.waiters (lock_key, job_id, run_at, pos)
       select id % 10, id, now(), id from graphile_worker._private_jobs
       where task_id = (select id from graphile_worker._private_tasks where identifier = 'long_line') and id % 2 = 0`,
    );
    await client.query("analyze graphile_worker_locks.waiters, graphile_worker._private_jobs");
    const { rows: last } = await client.query<{ key: string; id: string }>(
      `select (lock_key)::text as key, max(job_id)::text as id from graphile_worker_locks.waiters
       group by lock_key order by lock_key`,
    );
    for (const { key, id } of last) {
      const { rows } = await client.query<{ next: boolean }>(
        "select graphile_worker_locks.is_next($1::bigint, $2::bigint + 1) as next",
        [key, id],
      );
      // Every key has a line ahead of a job enqueued after it.
      expect(rows[0]!.next).toBe(false);
    }
    // The function's own body, planned as the lock session plans it (generic, the statistics above): the
    // waiters are read by key and position, never joined with the jobs over the whole of both tables.
    const { rows: source } = await client.query<{ src: string }>(
      `select prosrc as src from pg_catalog.pg_proc
       where proname = 'is_next' and pronamespace = 'graphile_worker_locks'::regnamespace`,
    );
    expect(source).toHaveLength(1);
    const body = source[0]!.src
      .replaceAll("p_key", "$1::bigint")
      .replaceAll("p_job_id", "$2::bigint");
    const { key, id } = last[0]!;
    await client.query({ name: "is_next_body", text: body, values: [key, id] });
    const { rows: plan } = await client.query<{ "QUERY PLAN": string }>(
      `explain (costs off) execute is_next_body(${BigInt(key)}, ${BigInt(id) + 1n})`,
    );
    const text = plan.map((row) => row["QUERY PLAN"]).join("\n");
    expect(text).toContain("waiters_lock_key_pos");
    expect(text).not.toMatch(/Merge Join|Hash Join|Seq Scan on _private_jobs/);

    // The lock statement's own question, whether anyone waits in line for the key a `reschedule` job just
    // took, is read by key and position as well, never by scanning every waiter.
    const { lockBatch } = makeSql("graphile_worker_locks", "graphile_worker");
    await client.query({
      name: "lock_batch",
      text: lockBatch.text,
      values: [[], [key], [], [], [id], [], [], true],
    });
    const { rows: batchPlan } = await client.query<{ "QUERY PLAN": string }>(
      `explain (costs off) execute lock_batch('{}', '{${key}}', '{}', '{}', '{${id}}', '{}', '{}', true)`,
    );
    const batchText = batchPlan.map((row) => row["QUERY PLAN"]).join("\n");
    expect(batchText).toContain("waiters_lock_key_pos");
    expect(batchText).not.toMatch(/Seq Scan on waiters|Merge Join|Hash Join/);
    await client.query("rollback");
  });
});

describe("bulk enqueue of a reschedule task: the line at once", () => {
  type Item = { k: string; n: number };
  /**
   * A `reschedule` task keyed by `k` that records, per key, the order its jobs ran in and their spans; a job
   * with a negative `n` holds its key until `gate` resolves.
   */
  function keyedLine(locks: Locks, identifier: string, maxDelay = 30_000, gate?: Promise<void>) {
    const order = new Map<string, number[]>();
    const spans: Array<{ start: number; end: number; k: string }> = [];
    const task = locks.exclusive(
      identifier,
      async (p: Item) => {
        const start = performance.now();
        order.set(p.k, [...(order.get(p.k) ?? []), p.n]);
        if (p.n < 0) await gate;
        await new Promise((resolve) => setTimeout(resolve, 10));
        spans.push({ start, end: performance.now(), k: p.k });
      },
      { key: (p) => p.k, onConflict: "reschedule", reschedule: { minDelay: 50, maxDelay } },
    );
    return { task, order, spans };
  }
  const items = (identifier: string, k: string, ns: number[]) =>
    ns.map((n) => ({ identifier, payload: { k, n } }));

  it("adds the jobs after the first of their key waiting in line, each at its own place, with its safety net as run_at", async () => {
    const locks = newLocks();
    const { task } = keyedLine(locks, "bulk_line");
    const later = new Date(Date.now() + 3_600_000);
    const before = Date.now();
    const results = await locks.addJobs([
      // A unique item first: the items in line are not at their place among all items.
      { identifier: "bulk_line", payload: { k: "u", n: 0 }, unique: "queued" },
      ...items("bulk_line", "a", [0, 1]),
      ...items("bulk_line", "b", [0, 1]),
      ...items("bulk_line", "a", [2, 3]),
      { identifier: "bulk_line", payload: { k: "c", n: 0 } },
      // Not in line: a job of its own time, and a unique one.
      { identifier: "bulk_line", payload: { k: "a", n: 4 }, runAt: later },
      { identifier: "bulk_line", payload: { k: "a", n: 5 }, unique: "queued" },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(Array(10).fill("added"));
    const id = (i: number) => results[i]!.job!.id;
    const { rows: waiters } = await db
      .pool()
      .query<{ lock_key: string; job_id: string; pos: string }>(
        "select lock_key::text, job_id::text, pos::text from graphile_worker_locks.waiters order by pos",
      );
    const keyOf = (k: string) => task.lockKey({ k, n: 0 }).toString();
    expect(waiters).toEqual(
      [2, 4, 5, 6].map((i) => ({
        lock_key: keyOf(i === 4 ? "b" : "a"),
        job_id: id(i),
        pos: id(i),
      })),
    );
    const runAt = (i: number) => results[i]!.job!.run_at.getTime();
    // The fronts (a0, b0), the lone c and the unique jobs run now; a4 at its own time.
    for (const i of [0, 1, 3, 7, 9]) expect(runAt(i)).toBeLessThanOrEqual(Date.now() + 1_000);
    expect(runAt(8)).toBe(later.getTime());
    for (const i of [2, 4, 5, 6]) {
      expect(runAt(i)).toBeGreaterThanOrEqual(before + 29_000);
      expect(runAt(i)).toBeLessThanOrEqual(Date.now() + 31_000);
    }
    // The function a process of the previous version calls still adds jobs, none in line.
    const { rows } = await db
      .pool()
      .query(
        `select r.outcome from graphile_worker_locks.add_unique_jobs($1::json, 2, 0, '{bulk_line}', '{}') r`,
        [
          JSON.stringify(
            [0, 1].map((n) => ({ identifier: "bulk_line", payload: { k: "d", n }, first: false })),
          ),
        ],
      );
    expect(rows.map((r) => r.outcome)).toEqual(["added", "added"]);
    expect(await parkedCount()).toBe(4);
  });

  it("a batch whose unique item meets a duplicate still puts its line in place and answers every item", async () => {
    const locks = newLocks();
    const { task } = keyedLine(locks, "bulk_line_dup");
    const held = await locks.addJob("bulk_line_dup", { k: "u", n: 0 }, { unique: "queued" });
    const results = await locks.addJobs([
      // (the task's key is also its unique key: k)
      { identifier: "bulk_line_dup", payload: { k: "v", n: 1 }, unique: "queued" },
      ...items("bulk_line_dup", "a", [0, 1]),
      { identifier: "bulk_line_dup", payload: { k: "u", n: 5 }, unique: "queued" },
      ...items("bulk_line_dup", "a", [2]),
    ]);
    expect(results.map((r) => r.outcome)).toEqual([
      "added",
      "added",
      "added",
      "duplicate",
      "added",
    ]);
    expect(results[3]!.job!.id).toBe(held.job!.id);
    // (the duplicate's job is the held one, n 0)
    expect(results.map((r) => (r.job!.payload as Item).n)).toEqual([1, 0, 1, 0, 2]);
    const { rows: waiters } = await db
      .pool()
      .query<{ lock_key: string; job_id: string }>(
        "select lock_key::text, job_id::text from graphile_worker_locks.waiters order by pos",
      );
    const a = task.lockKey({ k: "a", n: 0 }).toString();
    expect(waiters).toEqual([
      { lock_key: a, job_id: results[2]!.job!.id },
      { lock_key: a, job_id: results[4]!.job!.id },
    ]);
  });

  it("a runner then runs every key's jobs once each, in enqueue order, never two at once, fetching each about once", async () => {
    const locks = newLocks();
    const { task, order, spans } = keyedLine(locks, "bulk_run");
    const rescheduled = countEvents(locks, ["job:rescheduled"]);
    await locks.addJobs(
      Array.from({ length: 24 }, (_, i) => ({
        identifier: "bulk_run",
        payload: { k: i % 2 ? "odd" : "even", n: i },
      })),
    );
    expect(await parkedCount()).toBe(22);
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { bulk_run: task },
    });
    locks.attach(r);
    let fetches = 0;
    r.events.on("job:start", () => fetches++);
    await waitFor(async () => spans.length === 24, { message: "every job to run" });
    expect(order.get("even")).toEqual(Array.from({ length: 12 }, (_, i) => 2 * i));
    expect(order.get("odd")).toEqual(Array.from({ length: 12 }, (_, i) => 2 * i + 1));
    for (const k of ["even", "odd"])
      expect(highestConcurrency(spans.filter((span) => span.k === k))).toBe(1);
    // Nothing was fetched only to find its key held and park: the normal path parks about once per job.
    expect(rescheduled["job:rescheduled"]).toBeLessThan(5);
    expect(fetches).toBeLessThan(24 + 5);
    await waitFor(async () => (await parkedCount()) === 0, { message: "no waiter left" });
  });

  it("a front that finds its key held parks ahead of the jobs behind it, and the line runs in order once the key frees", async () => {
    const locks = newLocks();
    const gate = deferred();
    cleanups.push(async () => gate.resolve());
    const { task, order, spans } = keyedLine(locks, "bulk_held", 30_000, gate.promise);
    await runner({ connectionString: db.url, concurrency: 3, taskList: { bulk_held: task } });
    // A job of the key holds it (n = -1 waits for the gate) when the batch comes in.
    const holding = nextEvent(locks, "lock:acquired");
    await task.addJob({ k: "h", n: -1 });
    await holding;
    const parked = nextEvent(locks, "job:rescheduled");
    await locks.addJobs(items("bulk_held", "h", [0, 1, 2, 3]));
    const { job } = await parked;
    expect((job.payload as Item).n).toBe(0);
    expect(spans).toEqual([]);
    gate.resolve();
    await waitFor(async () => spans.length === 5, { message: "the line to run" });
    expect(order.get("h")).toEqual([-1, 0, 1, 2, 3]);
    expect(highestConcurrency(spans)).toBe(1);
  });

  it("should the front never run, the jobs behind it are fetched by their safety net, and one at a time go in line order", async () => {
    const locks = newLocks();
    const { task, order, spans } = keyedLine(locks, "bulk_net", 1_000);
    const results = await locks.addJobs(items("bulk_net", "s", [0, 1, 2]));
    await db
      .pool()
      .query("delete from graphile_worker._private_jobs where id = $1", [results[0]!.job!.id]);
    const started = performance.now();
    // (one worker: with several free at the safety net, its jobs race for the key as first fetches do)
    await runner({ connectionString: db.url, concurrency: 1, taskList: { bulk_net: task } });
    await waitFor(async () => spans.length === 2, { message: "the jobs behind the front to run" });
    expect(order.get("s")).toEqual([1, 2]);
    // Not before their safety net (1 s from the enqueue): nobody woke them.
    expect(spans[0]!.start - started).toBeGreaterThan(600);
    expect(highestConcurrency(spans)).toBe(1);
  });
});

describe("lock-ahead with graphile-worker's local queue", () => {
  const localQueue = { worker: { localQueue: { size: 20 }, completeJobBatchDelay: 0 } };

  it("takes the locks of a fetched batch before its jobs start, and holds none once the runner stopped", async () => {
    const locks = newLocks();
    const gate = deferred();
    const started: string[] = [];
    const task = locks.exclusive("ahead", async (p: { k: number }) => {
      started.push(String(p.k));
      await gate.promise;
    });
    const r = await startRunner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { ahead: task },
      preset: localQueue,
    });
    const detach = locks.attach(r);
    // One batch: the runner fetches all ten into its local queue and starts one.
    await utils.addJobs(
      Array.from({ length: 10 }, (_, k) => ({ identifier: "ahead", payload: { k } })),
    );
    await waitFor(async () => started.length === 1, { message: "a job to start" });
    // The other nine wait in the local queue behind the running one, with their locks already taken.
    const waiting = Array.from({ length: 10 }, (_, k) => k).filter((k) => String(k) !== started[0]);
    await waitFor(
      async () => {
        const free = await Promise.all(waiting.map((k) => task.lockAvailable({ k })));
        return free.every((f) => !f);
      },
      { message: "lock-ahead of the queued jobs" },
    );
    expect(started).toHaveLength(1);
    gate.resolve();
    await waitFor(async () => started.length === 10, { message: "every job to run" });
    await r.stop();
    detach();
    await waitFor(async () => locks.status().held.length === 0, {
      message: "every lock to be released",
    });
  });

  /**
   * A runner with one worker and a local queue, attached to `locks`, busy with a gate job while five jobs
   * (keys a to e) wait behind it in its local queue with their locks taken ahead. `run` is their body.
   */
  async function fiveLockedAhead(
    locks: Locks,
    identifier: string,
    run: (k: string) => Promise<void> | void,
    queue: { size: number; ttl?: number } = { size: 20 },
  ) {
    const gate = deferred();
    cleanups.push(async () => gate.resolve()); // (runs before the runner's stop, should the test fail)
    const gateStarted = deferred();
    const ran: string[] = [];
    const task = locks.exclusive(
      identifier,
      async (p: { k: string }) => {
        if (p.k === "gate") {
          gateStarted.resolve();
          return gate.promise;
        }
        await run(p.k);
        ran.push(p.k);
      },
      { key: (p) => p.k },
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { [identifier]: task },
      preset: { worker: { localQueue: queue } },
    });
    const returned = deferred<number>();
    r.events.on("localQueue:returnJobs", ({ jobs }) => returned.resolve(jobs.length));
    locks.attach(r);
    // The gate job runs; the five, fetched in the next batch, wait in the local queue behind it.
    await utils.addJob(identifier, { k: "gate" });
    await gateStarted.promise;
    await utils.addJobs(FIVE.map((k) => ({ identifier, payload: { k } })));
    const free = () => Promise.all(FIVE.map((k) => task.lockAvailable({ k })));
    await waitFor(async () => (await free()).every((f) => !f), {
      message: "lock-ahead of the queued jobs",
    });
    return { gate, ran, free, returned: returned.promise };
  }
  const FIVE = ["a", "b", "c", "d", "e"];

  it("gives back the locks taken ahead of jobs the local queue hands back (its ttl), and takes them again when they run", async () => {
    const locks = newLocks();
    const { gate, ran, free, returned } = await fiveLockedAhead(
      locks,
      "ahead_returned",
      () => undefined,
      { size: 20, ttl: 1000 },
    );
    // The gate job outlives the local queue's ttl: the five are handed back to the database unrun, and
    // their locks with them, while the runner still runs and is still attached.
    expect(await returned).toBe(FIVE.length);
    await waitFor(async () => (await free()).every((f) => f), {
      message: "the returned jobs' locks to be given back",
    });
    expect(ran).toEqual([]);
    expect(locks.status().held).toHaveLength(1); // the gate job's
    gate.resolve();
    await waitFor(async () => ran.length === FIVE.length, { message: "the five jobs to run" });
    expect([...ran].sort()).toEqual(FIVE);
    await waitFor(async () => locks.status().held.length === 0, {
      message: "every lock to be released",
    });
  });

  it("a lock taken ahead and lost with its connection before its job starts is taken again: the job never runs unlocked", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 100 } });
    // Another session tries each key the moment its job starts: it must find the key held.
    const probe = new pg.Client({ connectionString: db.url });
    await probe.connect();
    cleanups.push(() => probe.end());
    const unlocked: string[] = [];
    const { gate, ran } = await fiveLockedAhead(locks, "ahead_lost", async (k) => {
      const key = lockKey("ahead_lost", k).toString();
      const { rows } = await probe.query<{ got: boolean }>(
        "select pg_try_advisory_lock($1) as got",
        [key],
      );
      if (rows[0]!.got) {
        unlocked.push(k);
        await probe.query("select pg_advisory_unlock($1)", [key]);
      }
    });
    // The lock session dies with every lock it held, the ones taken ahead among them; it reconnects.
    const lost = nextEvent(locks, "lock:lost");
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [locks.status().pid]);
    expect((await lost).holds.length).toBeGreaterThanOrEqual(FIVE.length);
    await reconnected;
    gate.resolve();
    await waitFor(async () => ran.length === FIVE.length, { message: "the five jobs to run" });
    expect(unlocked).toEqual([]);
    expect([...ran].sort()).toEqual(FIVE);
  });

  it("two runners with lock-ahead, 300 jobs over 5 keys: no overlap, every job runs", async () => {
    const timeline = new Timeline();
    for (const locks of [newLocks(), newLocks()]) {
      const task = locks.exclusive(
        "ahead2",
        async (p: { k: number }, helpers) => {
          const end = timeline.begin(String(p.k), helpers.job.id, helpers.job.attempts);
          await new Promise((resolve) => setTimeout(resolve, 2));
          end();
        },
        { onConflict: "reschedule", reschedule: { minDelay: 50, maxDelay: 200 } },
      );
      const r = await runner({
        connectionString: db.url,
        concurrency: 6,
        taskList: { ahead2: task },
        preset: localQueue,
      });
      locks.attach(r);
    }
    await utils.addJobs(
      Array.from({ length: 300 }, (_, i) => ({ identifier: "ahead2", payload: { k: i % 5 } })),
    );
    await waitFor(async () => timeline.executions.filter((e) => e.end !== null).length === 300, {
      timeoutMs: 50_000,
      message: "all 300 jobs to run",
    });
    expect(timeline.maxConcurrency()).toBe(1);
  });
});
