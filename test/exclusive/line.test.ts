/**
 * The line of a `reschedule` key: parking, waking, early wakes and hand-overs, FIFO order, its SQL under
 * load and its plans, and a bulk enqueue's line at once.
 * Real PostgreSQL, real graphile-worker runners, separate connections.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import { lockKey, type HandoffCounts, type Locks } from "../../src/index.js";
import { CLAIM_SETTING, makeSql, type LockShape } from "../../src/sql.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { highestConcurrency } from "../../scripts/overlap.js";
import { countEvents, nextEvent } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner, holdExternally, markFetched, parkFetched, q, parkedCount } =
  h;
const { connect } = h;

/**
 * A held key with a line, for SQL-level tests: a job of task `task` (keyed "k") fetched as the holder,
 * then `parked` jobs parked behind it as a worker's `reschedule` would. `ids`: every job as enqueued,
 * holder first; `waiting`: the parked copies, in line order.
 */
async function heldLine(task: string, parked: number) {
  const locks = newLocks();
  await locks.migrate();
  const key = lockKey(task, "k").toString();
  const later = new Date(Date.now() + 3_600_000).toISOString();
  const ids: string[] = [];
  for (let n = 0; n <= parked; n++) ids.push((await locks.addJob(task, { n })).job!.id);
  const holder = ids[0]!;
  await markFetched(holder);
  const waiting: string[] = [];
  for (const id of ids.slice(1)) waiting.push(await parkFetched(id, key, later));
  return { locks, key, later, ids, holder, waiting };
}

/** The backend pid of `client` (asked before it sends a statement that may block). */
const backendPid = async (client: pg.Client) =>
  (await client.query<{ pid: number }>("select pg_backend_pid() as pid")).rows[0]!.pid;

/** The mark a lock statement sent by hand must find on its backend (a lock session's claim). */
const MARK = "test";

/**
 * Marks the backend of `client` as a lock session's, as the session's connect does, for a lock statement sent
 * by hand; its pid.
 */
async function asLockSession(client: pg.Client): Promise<number> {
  await client.query("select pg_catalog.set_config($1, $2, false)", [CLAIM_SETTING, MARK]);
  return backendPid(client);
}

/** The text of the lock statement with the given branches (sql.ts, `LockShape`). */
function lockStatement(branches: Partial<LockShape>): string {
  const none: LockShape = {
    lines: false,
    slots: false,
    stacked: false,
    fastLimits: 0,
    rated: false,
    wakes: false,
    prewakes: false,
  };
  return makeSql("graphile_worker_locks", "graphile_worker").lockStatement({ ...none, ...branches })
    .text;
}

/** The lock statement of a release that wakes its key's line: $5 the line keys, $6 the releasing jobs. */
const releaseStatement = lockStatement({ wakes: true });

/**
 * The holder's lock session (a connection of its own) releases `key` of job `holder` with the lock statement,
 * held open in a transaction: its unlock has happened (session locks are not transactional), its wake and its
 * line lock last until the transaction ends.
 */
async function releaseInOpenTransaction(key: string, holder: string) {
  const releaser = await connect();
  await releaser.query("select pg_advisory_lock($1)", [key]);
  await releaser.query("begin");
  const pid = await asLockSession(releaser);
  await releaser.query(releaseStatement, [[key], [], pid, MARK, [key], [holder]]);
  return { releaser, pid };
}

/** Waits until backend `pid` waits for a lock another transaction holds. */
async function waitForLockWait(pid: number, message: string): Promise<void> {
  await waitFor(
    async () =>
      (
        await q<{ waiting: boolean }>(
          "select wait_event_type = 'Lock' as waiting from pg_stat_activity where pid = $1",
          [pid],
        )
      ).rows[0]?.waiting === true,
    { message },
  );
}

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
      await q(`select ${S}.wake_waiters($1, true)`, [[key.toString()]]);
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
      await q(`select ${S}.wake_waiters($1, true)`, [[key.toString()]]);
      await markFetched(first);
      await markFetched(second);
      expect(await isNext(key, second)).toBe(false);
      await wokenAgo(key, "3 seconds");
      await fetchedAgo(first, "3 seconds");
      expect(await isNext(key, second)).toBe(true);
    });

    it("a release listing a key twice wakes its first two waiters, passing over one whose job is gone; a listing that finds nobody retires the wake", async () => {
      const { locks, key, first, second } = await lineOfTwo("twice");
      const later = new Date(Date.now() + 3_600_000).toISOString();
      const { job } = await locks.addJob("twice", { n: 3 });
      const third = await parkFetched(job!.id, key.toString(), later);
      // The first waiter's job is gone (completed or deleted by hand): the next in line goes instead.
      await q("delete from graphile_worker._private_jobs where id = $1", [first]);
      const ready = async (ids: string[]) =>
        (
          await q<{ id: string }>(
            "select id::text from graphile_worker._private_jobs where id = any($1) and run_at <= now() order by id",
            [ids],
          )
        ).rows.map((r) => r.id);
      const wake = async (times: number) =>
        (
          await q<{ woken: number }>(`select ${S}.wake_waiters($1, true) as woken`, [
            Array.from({ length: times }, () => key.toString()),
          ])
        ).rows[0]!.woken;
      expect(await wake(2)).toBe(2);
      expect(await ready([second, third])).toEqual([second, third]);
      expect(await wokenFor(key)).toEqual([third]);
      expect(await parkedCount()).toBe(0);
      // Two more listings, nobody left: the wake goes, so that a job parking next wakes itself.
      expect(await wake(2)).toBe(0);
      expect(await wokenFor(key)).toEqual([]);
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
          "select run_at from graphile_worker_locks.park_job($1, $2, $3, interval '1 second', $4, null)",
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
        "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2, null)",
        [job!.id, later, key.toString()],
      );
      return { original: job!.id, copy: (rows[0] as { id: string }).id };
    };
    const wakeWaiters = () =>
      q("select graphile_worker_locks.wake_waiters($1, true)", [[key.toString()]]);
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
        "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2, null)",
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
    const { key, later, holder, waiting } = await heldLine("pw", 2);
    const [waitingA, waitingB] = waiting as [string, string];
    const park = (id: string) => parkFetched(id, key, later);
    const listener = await connect();
    const notices: string[] = [];
    listener.on("notification", (m) => notices.push(`${m.channel}:${m.payload}`));
    await listener.query("listen gwl_release");

    // The holder wakes the first in line early.
    const { rows: early } = await q(
      "select i, job_id::text as job_id from graphile_worker_locks.prewake($1, true)",
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
    // It is fetched (running) when the holder releases: nobody else is woken, its session is told (by the
    // key's notification, and by one naming the job, which a job waiting in line at its worker hears).
    await markFetched(waitingA);
    const release = (jobId: string) =>
      q("select graphile_worker_locks.release_waiters($1, $2) as woken", [[key], [jobId]]);
    expect((await release(holder)).rows[0]!.woken).toBe(0);
    await waitFor(async () => notices.length > 1, { message: "the notifications" });
    expect(notices).toEqual([`gwl_release:${key}`, `gwl_release:${key}/${waitingA}`]);
    expect((await wokenAt(waitingB)).getTime()).toBeGreaterThan(Date.now() + 60_000);

    // Next time the early-woken job gave up waiting and parked again (under a new id, in its place): the
    // release wakes the first in line, which is that job.
    await q("select i from graphile_worker_locks.prewake($1, true)", [[key]]);
    const { rows: again } = await q(
      "select job_id::text as job_id from graphile_worker_locks.prewakes where lock_key = $1",
      [key],
    );
    expect(again).toEqual([{ job_id: waitingB }]);
    const reparked = await park(waitingB);
    expect((await release(waitingA)).rows[0]!.woken).toBe(1);
    expect((await wokenAt(reparked)).getTime()).toBeLessThan(Date.now() + 1000);
    expect(notices).toHaveLength(2);
  });

  it("a job parking while a release's wake is not yet committed wakes nobody: one job is sent after the key", async () => {
    const { locks, key, ids, holder, waiting } = await heldLine("pr", 2);
    const [first, second] = waiting as [string, string];
    const parker = (await locks.addJob("pr", { n: 3 })).job!.id;
    // The holder's session releases with the lock statement, held open in a transaction.
    const { releaser } = await releaseInOpenTransaction(key, holder);
    // A job that met the key held has parked and now checks whether the key is free.
    const checker = await connect();
    const checkerPid = await backendPid(checker);
    const checked = checker.query(
      "select graphile_worker_locks.wake_if_free($1, $2, $3) as woken",
      [[key], key, parker],
    );
    await waitForLockWait(checkerPid, "the check to wait for the release's transaction");
    await releaser.query("commit");
    expect((await checked).rows[0]!.woken).toBe(0);
    const { rows: woken } = await q<{ id: string }>(
      "select id::text as id from graphile_worker._private_jobs where id = any($1) and run_at < now() + interval '1 minute'",
      [[first, second]],
    );
    expect(woken).toEqual([{ id: first }]);
    const { rows: wake } = await q<{ job_id: string; pos: string }>(
      "select job_id::text as job_id, pos::text as pos from graphile_worker_locks.wakes where lock_key = $1",
      [key],
    );
    expect(wake).toEqual([{ job_id: first, pos: ids[1] }]);
  });

  it("a release waits for a parker's check of the key's line before its unlock, so that the check sees the key held", async () => {
    const { locks, key, holder, waiting } = await heldLine("pl", 1);
    const first = waiting[0]!;
    const parker = (await locks.addJob("pl", { n: 2 })).job!.id;
    const releaser = await connect();
    await releaser.query("select pg_advisory_lock($1)", [key]);
    // A parker's check, held open: the key is held, so it wakes nobody, and it has the line.
    const checker = await connect();
    await checker.query("begin");
    const { rows: checked } = await checker.query(
      "select graphile_worker_locks.wake_if_free($1, $2, $3) as woken",
      [[key], key, parker],
    );
    expect(checked[0]!.woken).toBe(0);
    const releaserPid = await asLockSession(releaser);
    const released = releaser.query(releaseStatement, [
      [key],
      [],
      releaserPid,
      MARK,
      [key],
      [holder],
    ]);
    await waitForLockWait(releaserPid, "the release to wait for the check");
    // Still held while the release waits: had it unlocked first, the check would have seen the key free.
    const { rows: held } = await q<{ held: boolean }>(
      `select exists (select 1 from pg_locks where locktype = 'advisory' and granted and objsubid = 1
         and classid = (($1::bigint >> 32) & 4294967295)::oid and objid = ($1::bigint & 4294967295)::oid) as held`,
      [key],
    );
    expect(held).toEqual([{ held: true }]);
    await checker.query("commit");
    await released;
    const { rows: woken } = await q<{ id: string }>(
      "select id::text as id from graphile_worker._private_jobs where id = $1 and run_at < now() + interval '1 minute'",
      [first],
    );
    expect(woken).toEqual([{ id: first }]);
  });

  it("a release with nobody in line writes no row: the line is locked by a transaction-level advisory lock, held to its end", async () => {
    const { key, holder } = await heldLine("pn", 0);
    const { releaser, pid } = await releaseInOpenTransaction(key, holder);
    // (this transaction's own row counts, for the library's tables)
    const { rows: written } = await releaser.query<{ table: string; rows: string }>(
      `select relname as table, (n_tup_ins + n_tup_upd + n_tup_del)::text as rows
         from pg_stat_xact_user_tables where schemaname = 'graphile_worker_locks' and n_tup_ins + n_tup_upd + n_tup_del > 0`,
    );
    expect(written).toEqual([]);
    // The line stays locked until the release's transaction ends: a parker's check waits for it.
    const { rows: line } = await q<{ held: boolean }>(
      `select exists (select 1 from pg_locks where locktype = 'advisory' and granted and objsubid = 2 and pid = $2
         and classid = (($1::bigint >> 32)::int)::oid and objid = ((($1::bigint << 32) >> 32)::int)::oid) as held`,
      [key, pid],
    );
    expect(line).toEqual([{ held: true }]);
    const checker = await connect();
    const checkerPid = await backendPid(checker);
    const checked = checker.query("select graphile_worker_locks.lock_lines($1) as n", [[key]]);
    await waitForLockWait(checkerPid, "the check to wait for the release's transaction");
    await releaser.query("commit");
    expect((await checked).rows[0]!.n).toBe(1);
  });

  it("an early wake left to the holder's process is not announced; its release announces it if still unfetched", async () => {
    const { key, holder, waiting } = await heldLine("pq", 2);
    const listener = await connect();
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
      "select job_id::text as job_id from graphile_worker_locks.prewake($1, true)",
      [[key]],
    );
    expect(announced).toEqual([{ job_id: waiting[1] }]);
    expect(await settle()).toEqual(["jobs:insert:1"]);
    // Fetched by the release: only its session is told (the key's notification, and one naming the job).
    await markFetched(waiting[1]!);
    expect((await release(waiting[0]!)).rows[0]!.woken).toBe(0);
    expect(await settle()).toEqual([`gwl_release:${key}`, `gwl_release:${key}/${waiting[1]}`]);
  });
});

describe("plans with a long line analyzed", () => {
  it("is_next and the lock statement read a key's waiters by position, never every waiter or every job", async () => {
    const client = await connect();
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
    const pid = await asLockSession(client);
    await client.query({
      name: "lock_batch",
      text: lockStatement({ lines: true }),
      values: [[], [key], pid, MARK, [id]],
    });
    const { rows: batchPlan } = await client.query<{ "QUERY PLAN": string }>(
      `explain (costs off) execute lock_batch('{}', '{${key}}', ${pid}, '${MARK}', '{${id}}')`,
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
