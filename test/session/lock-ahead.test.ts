/**
 * Lock-ahead: the locks of a batch graphile-worker's local queue fetched, taken before its jobs start.
 * Real PostgreSQL, real graphile-worker runners, separate connections.
 */
import { describe, expect, it } from "vitest";
import { lockKey, type Locks } from "../../src/index.js";
import { LOCK_AHEAD_MARGIN } from "../../src/session/lock-ahead.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent, startRunner, Timeline } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

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
    await h.utils.addJobs(
      Array.from({ length: 10 }, (_, k) => ({ identifier: "ahead", payload: { k } })),
    );
    await waitFor(async () => started.length === 1, { message: "a job to start" });
    // The other nine wait in the local queue behind the running one: the next LOCK_AHEAD_MARGIN (eight) of
    // them with their locks already taken, the last without (it takes its own when it starts).
    const waiting = Array.from({ length: 10 }, (_, k) => k).filter((k) => String(k) !== started[0]);
    const free = await waitFor(
      async () => {
        const free = await Promise.all(waiting.map((k) => task.lockAvailable({ k })));
        return free.filter((f) => !f).length >= LOCK_AHEAD_MARGIN && free;
      },
      { message: "lock-ahead of the queued jobs" },
    );
    expect(free.filter((f) => f)).toHaveLength(1);
    expect(locks.status().held).toHaveLength(1 + LOCK_AHEAD_MARGIN);
    expect(started).toHaveLength(1);
    gate.resolve();
    await waitFor(async () => started.length === 10, { message: "every job to run" });
    await r.stop();
    detach();
    await waitFor(async () => locks.status().held.length === 0, {
      message: "every lock to be released",
    });
  });

  it("holds locks for the jobs it can start soon, not for its whole local queue", async () => {
    const locks = newLocks();
    const gate = deferred();
    cleanups.push(async () => gate.resolve()); // (runs before the runner's stop, should the test fail)
    let running = 0;
    const task = locks.exclusive("soon", async (_payload: { k: number }) => {
      running++;
      await gate.promise;
    });
    const r = await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { soon: task },
      preset: { worker: { localQueue: { size: 40 }, completeJobBatchDelay: 0 } },
    });
    locks.attach(r);
    // One batch of thirty: two start, the rest wait in the local queue.
    await h.utils.addJobs(
      Array.from({ length: 30 }, (_, k) => ({ identifier: "soon", payload: { k } })),
    );
    const held = () => locks.status().held.length;
    await waitFor(async () => running === 2 && held() >= 2 + LOCK_AHEAD_MARGIN, {
      message: "two jobs to run and the next ones to lock ahead",
    });
    // The two running jobs' keys and the next LOCK_AHEAD_MARGIN jobs' keys, and no others.
    expect(held()).toBe(2 + LOCK_AHEAD_MARGIN);
    const free = await Promise.all(Array.from({ length: 30 }, (_, k) => task.lockAvailable({ k })));
    expect(free.filter((f) => !f)).toHaveLength(2 + LOCK_AHEAD_MARGIN);
    // Draining, the runner never holds more than that.
    let most = 0;
    gate.resolve();
    await waitFor(
      async () => {
        most = Math.max(most, held());
        return (await h.jobRows()).length === 0 && held() === 0;
      },
      { intervalMs: 5, message: "every job to run and release its key" },
    );
    expect(most).toBeLessThanOrEqual(2 + LOCK_AHEAD_MARGIN);
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
    await h.utils.addJob(identifier, { k: "gate" });
    await gateStarted.promise;
    await h.utils.addJobs(FIVE.map((k) => ({ identifier, payload: { k } })));
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
    const probe = await h.connect();
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
    await h.utils.addJobs(
      Array.from({ length: 300 }, (_, i) => ({ identifier: "ahead2", payload: { k: i % 5 } })),
    );
    await waitFor(async () => timeline.executions.filter((e) => e.end !== null).length === 300, {
      timeoutMs: 50_000,
      message: "all 300 jobs to run",
    });
    expect(timeline.maxConcurrency()).toBe(1);
  });
});
