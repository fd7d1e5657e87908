/**
 * The check of an in-memory hand-over (a finished hold passes its key to the job it woke early, without an
 * unlock) costs no statement of its own: the woken job gets its hold from the answer of the next lock
 * statement, which carries the new hold's early wake. (That the check still stops a hand-over on a dead
 * session is handover-loss.test.ts's.)
 * Real PostgreSQL, a real graphile-worker runner.
 */
import { EventEmitter } from "node:events";
import { setTimeout as sleep } from "node:timers/promises";

import pg from "pg";
import { describe, expect, it } from "vitest";
import type { Runner, Worker, WorkerEvents } from "graphile-worker";
import type { Locks } from "../../src/index.js";
import { startProxy } from "../../scripts/soak/proxy.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent, startRunner } from "../support/runner.js";
import { setTimingProbe } from "../../src/session/timing-probe.js";
import { spannedTask as spannedTaskOf } from "../support/spans.js";

const h = useExclusiveHarness();
const { cleanups, newLocks, runner, parkedCount } = h;

/**
 * Counts, from now until the test ends, the lock statements and the heartbeat-shaped checks sent, and lists
 * the lock statements' names in the order sent.
 */
function countStatements() {
  const counts = { lock: 0, check: 0, names: [] as string[] };
  const original = pg.Client.prototype.query;
  cleanups.push(async () => void (pg.Client.prototype.query = original));
  pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
    const config = args[0] as
      { name?: string; text?: string; second?: { name: string } } | string | undefined;
    const text = typeof config === "string" ? config : config?.text;
    if (typeof config === "object" && config?.name?.startsWith("gwl_lock_")) {
      counts.lock++;
      // (a lock statement sent with its wakes in a second statement: both names)
      counts.names.push(config.second ? `${config.name}+${config.second.name}` : config.name);
    } else if (text?.startsWith("select pg_catalog.pg_backend_pid() as pid")) counts.check++;
    return (original as (...a: unknown[]) => unknown).apply(this, args);
  } as typeof original;
  return counts;
}

/** A freezable proxy in front of the test database, closed by the test's cleanups, and the URL through it. */
async function proxiedDatabase() {
  const proxy = await startProxy(Number(new URL(h.db.url).port || 5432));
  cleanups.push(() => proxy.close());
  const proxied = new URL(h.db.url);
  proxied.hostname = "127.0.0.1";
  proxied.port = String(proxy.port);
  return { proxy, proxied };
}

/** `spannedTask` of this test's cleanups. */
const spannedTask = (locks: Locks, identifier: string, ms: number) =>
  spannedTaskOf(cleanups, locks, identifier, ms);

/**
 * With X's fetches in flight counted from now: job 100 of `identifier` holds the key in runner X; 101 (gated,
 * for X) and 102 (`flags102`) meet it and wait in line; resolves once 102 has parked (`parkedOn`: the
 * `Locks` of the runner that fetched it) and 100's release has passed the key to 101, whose hold, having a
 * line, wakes 102 early for an idle worker of X.
 */
async function holdWithLine(
  locks: Locks,
  x: Runner,
  identifier: string,
  flags102: string[],
  parkedOn: Locks,
) {
  let xFetching = 0;
  x.events.on("worker:getJob:start", () => void xFetching++);
  for (const done of ["worker:getJob:empty", "worker:getJob:error", "job:start"] as const)
    x.events.on(done, () => void (xFetching = Math.max(0, xFetching - 1)));
  const held = (n: number) =>
    nextEvent(locks, "lock:acquired", (e) => (e.job.payload as { n: number }).n === n);
  const held100 = held(100);
  await locks.addJob(identifier, { n: 100 }, { flags: ["x_only"] });
  await held100;
  const held101 = held(101);
  const parked102 = nextEvent(
    parkedOn,
    "job:rescheduled",
    (e) => (e.job.payload as { n: number }).n === 102,
  );
  await locks.addJob(identifier, { n: 101, gated: true }, { flags: ["x_only"] });
  await locks.addJob(identifier, { n: 102 }, { flags: flags102 });
  await parked102;
  await held101;
  return { fetching: () => xFetching };
}

describe("hand-over check", () => {
  it("rides on the next lock statement, ahead of the new hold's early wake, never a statement of its own shape; the passing job returns after it", async () => {
    // No heartbeat within the test: a heartbeat-shaped statement can only be a hand-over's own check.
    const locks = newLocks({ heartbeatInterval: 60_000, heartbeatTimeout: 60_000 });
    const gate = deferred();
    cleanups.push(async () => gate.resolve());
    const started: number[] = [];
    const task = locks.exclusive(
      "handover_check",
      async (p: { n: number; gated?: boolean }) => {
        started.push(p.n);
        if (p.gated) await gate.promise;
      },
      { key: () => "one key", onConflict: "reschedule" },
    );
    const r = await runner({
      connectionString: h.db.url,
      concurrency: 3,
      taskList: { handover_check: task },
    });
    locks.attach(r);
    const fetched = (n: number) =>
      new Promise<string>((resolve) =>
        r.events.on("job:start", ({ job }) => {
          if ((job.payload as { n: number }).n === n) resolve(job.id);
        }),
      );
    // The jobs that found their key held here and wait to be handed it.
    const waiting = new Set<string>();
    setTimingProbe({
      lock() {},
      unlock() {},
      stage(stage, jobId) {
        if (stage === "waiting") waiting.add(jobId);
      },
    });
    cleanups.push(async () => setTimingProbe(null));

    // Short jobs teach the task its usual hold, so that a new hold wakes the next job in line at once.
    await locks.addJobs(
      Array.from({ length: 20 }, (_, n) => ({ identifier: "handover_check", payload: { n } })),
    );
    await waitFor(async () => started.length === 20, { message: "the teaching jobs to run" });
    await waitFor(async () => (await parkedCount()) === 0, { message: "the line to empty" });

    // 100 runs and releases at once; 101 takes the key with 102 in line, wakes it early, and holds the key
    // until 102 was fetched here and waits to be handed it.
    const fetched102 = fetched(102);
    const held101 = nextEvent(
      locks,
      "lock:acquired",
      (e) => (e.job.payload as { n: number }).n === 101,
    );
    await locks.addJobs(
      [100, 101, 102].map((n) => ({
        identifier: "handover_check",
        payload: { n, ...(n === 101 ? { gated: true } : {}) },
      })),
    );
    await held101;
    const id102 = await fetched102;
    // (its task started before it asked for its key: wait until it waits for 101's)
    await waitFor(async () => waiting.has(id102), { message: "102 to wait for its key" });
    const handedOver = locks.status().handoffs.handedOver;

    const counts = countStatements();
    const held102 = nextEvent(
      locks,
      "lock:acquired",
      (e) => (e.job.payload as { n: number }).n === 102,
    );
    // 101's release is answered at the pass's check; 101 returns to graphile-worker after it.
    const order: string[] = [];
    const nOf = (job: { payload: unknown }) => (job.payload as { n: number }).n;
    locks.events.on("lock:released", (e) => order.push(`released ${nOf(e.job)}`));
    r.events.on("job:success", ({ job }) => order.push(`returned ${nOf(job)}`));
    gate.resolve();
    await held102;
    expect(locks.status().handoffs.handedOver).toBe(handedOver + 1);
    // The check goes in the first lock statement after the pass, answered ahead of the new hold's early wake,
    // which follows in a second statement of its transaction (an early wake costs the server more than the
    // check: 102 need not wait for it).
    expect(counts.check).toBe(0);
    expect(counts.names.map((name) => name.slice("gwl_lock_".length))).toEqual([
      "plain+gwl_wake_prewakes",
    ]);
    await waitFor(async () => order.includes("returned 101"), { message: "101 to return" });
    expect(order.indexOf("released 101")).toBeGreaterThanOrEqual(0);
    expect(order.indexOf("released 101")).toBeLessThan(order.indexOf("returned 101"));
  });

  it("a key released before the job it woke early arrives here is kept for that job, which takes it in memory", async () => {
    // The runner's connections go through a proxy, so that the woken job's fetch can be held up; the lock
    // session's do not.
    const { proxy, proxied } = await proxiedDatabase();
    const locks = newLocks();
    const { task, spans, gate } = spannedTask(locks, "kept_for_arrival", 800);
    // No polling: a poll started while the proxy is frozen would keep its worker from counting as idle. The
    // jobs are fetched on graphile-worker's notification, or by an idle worker the lock session nudges.
    const r = await runner({
      connectionString: proxied.toString(),
      concurrency: 4,
      pollInterval: 60_000,
      taskList: { kept_for_arrival: task },
    });
    cleanups.push(async () => proxy.thaw());
    locks.attach(r);
    // graphile-worker's fetches in flight
    let fetching = 0;
    r.events.on("worker:getJob:start", () => void fetching++);
    for (const done of ["worker:getJob:empty", "worker:getJob:error", "job:start"] as const)
      r.events.on(done, () => void (fetching = Math.max(0, fetching - 1)));

    // Three jobs of 800 ms teach the task its usual hold: the next job in line is woken 780 ms into a hold,
    // and a job woken early waits up to a second (the most) for its key, and so long is a key kept for it,
    // time enough for a slow server to bring 102 here.
    await locks.addJobs([0, 1, 2].map((n) => ({ identifier: "kept_for_arrival", payload: { n } })));
    await waitFor(async () => [0, 1, 2].every((n) => spans.get(n)?.end != null), {
      message: "the teaching jobs to run",
    });
    await waitFor(async () => (await parkedCount()) === 0, { message: "the line to empty" });

    // 100 runs, then 101 holds the key with 102 in line; the runner's network freezes as 101 takes the key,
    // so that 102, woken early for an idle worker here, is not fetched before 101 ends.
    // The freeze waits for every fetch in flight to come back (that of 100's worker after its completion
    // above all): one let through at the thaw could bring 102 in place of the worker nudged for it, which
    // then comes back empty and gives up the key kept for 102.
    // The worker that ran 100 fetches again once it has completed it; a freeze before that fetch came back
    // would hold it up too, and at the thaw it could bring 102 ahead of the worker nudged for 102.
    let held101 = false;
    let frozen = false;
    let worker100: string | undefined;
    let settled100 = false;
    const freezeWhenNoFetch = () => {
      if (held101 && settled100 && fetching === 0 && !frozen) {
        frozen = true;
        proxy.freeze();
      }
    };
    r.events.on("job:complete", ({ worker, job }) => {
      if ((job.payload as { n: number }).n === 100) worker100 = worker.workerId;
    });
    for (const done of ["worker:getJob:empty", "worker:getJob:error", "job:start"] as const)
      r.events.on(done, ({ worker }) => {
        if (worker100 !== undefined && worker.workerId === worker100) settled100 = true;
        freezeWhenNoFetch();
      });
    locks.events.on("lock:acquired", ({ job }) => {
      if ((job.payload as { n: number }).n !== 101) return;
      held101 = true;
      freezeWhenNoFetch();
    });
    const before = locks.status().handoffs;
    await locks.addJobs(
      [100, 101, 102].map((n) => ({
        identifier: "kept_for_arrival",
        payload: { n, ...(n === 101 ? { gated: true } : {}) },
      })),
    );
    // (100 wakes 101 early, then 101 wakes 102)
    await waitFor(async () => locks.status().handoffs.wokenHere === before.wokenHere + 2, {
      message: "101 to wake 102 early for a worker of this process",
    });
    const mid = locks.status().handoffs;
    gate.resolve();
    await waitFor(async () => spans.get(101)?.end != null, { message: "101 to end" });
    // (its release runs as its task returns)
    await sleep(50);
    expect(spans.has(102)).toBe(false);
    proxy.thaw();

    await waitFor(async () => spans.get(102)?.end != null, { message: "102 to run" });
    const after = locks.status().handoffs;
    expect({ handedOver: after.handedOver, keptForArrival: after.keptForArrival }).toEqual({
      handedOver: mid.handedOver + 1,
      keptForArrival: mid.keptForArrival + 1,
    });
    expect(spans.get(102)!.start).toBeGreaterThanOrEqual(spans.get(101)!.end!);
    await waitFor(async () => locks.status().held.length === 0, { message: "102's release" });
  });
  it("a key kept for a job woken early stays kept when the nudged worker comes back without it while another worker here brings it", async () => {
    // Two runners of this process: X runs the holder and has an idle worker, nudged for the woken job, that
    // may not take it (a forbidden flag); Y may take it, its fetch held up by a frozen proxy while the nudged
    // worker comes back empty. The key is kept until Y's fetch is back, and Y's job takes it in memory.
    const { proxy, proxied } = await proxiedDatabase();
    const locks = newLocks();
    const { task, spans, gate } = spannedTask(locks, "kept_while_fetching", 400);
    const x = await runner({
      connectionString: h.db.url,
      concurrency: 2,
      pollInterval: 60_000,
      forbiddenFlags: ["y_only"],
      taskList: { kept_while_fetching: task },
    });
    const y = await runner({
      connectionString: proxied.toString(),
      concurrency: 1,
      pollInterval: 100,
      forbiddenFlags: ["x_only"],
      taskList: { kept_while_fetching: task },
    });
    cleanups.push(async () => proxy.thaw());
    locks.attach(x);
    locks.attach(y);

    // Three jobs of 400 ms teach the task its usual hold: the next job in line is woken 380 ms into a hold,
    // and a key is kept for it for 800 ms at most.
    await locks.addJobs(
      [0, 1, 2].map((n) => ({
        identifier: "kept_while_fetching",
        payload: { n },
        flags: ["x_only"],
      })),
    );
    await waitFor(async () => [0, 1, 2].every((n) => spans.get(n)?.end != null), {
      message: "the teaching jobs to run",
    });
    await waitFor(async () => (await parkedCount()) === 0, { message: "the line to empty" });

    // 100 holds the key in X; 101 (for X) and 102 (for Y only) meet it and wait in line. 100's release wakes
    // 101, whose hold, having a line, wakes 102 early for an idle worker of this process.
    const x102 = await holdWithLine(locks, x, "kept_while_fetching", ["y_only"], locks);
    const mid = locks.status().handoffs;
    // Y's next poll is held up in flight, so that an idle worker of X is the one nudged for 102; it may not
    // take 102 and comes back empty.
    let yFetching = false;
    y.events.on("worker:getJob:start", () => {
      if (yFetching) return;
      yFetching = true;
      proxy.freeze();
    });
    await waitFor(async () => yFetching, { message: "Y to fetch" });
    await waitFor(
      async () => locks.status().handoffs.wokenHere === mid.wokenHere + 1 && x102.fetching() === 0,
      { message: "101 to wake 102 early for an idle worker of X, which comes back empty" },
    );
    gate.resolve();
    await waitFor(async () => spans.get(101)?.end != null, { message: "101 to end" });
    // (its release runs as its task returns)
    await sleep(50);
    expect(locks.status().handoffs.keptForArrival).toBe(mid.keptForArrival + 1);
    expect(spans.has(102)).toBe(false);
    proxy.thaw();

    await waitFor(async () => spans.get(102)?.end != null, { message: "102 to run" });
    expect(locks.status().handoffs.handedOver).toBe(mid.handedOver + 1);
    expect(spans.get(102)!.start).toBeGreaterThanOrEqual(spans.get(101)!.end!);
    await waitFor(async () => locks.status().held.length === 0, { message: "102's release" });
  });

  it("a runner that stops with a fetch in flight leaves nothing in flight here: no key is kept for a fetch that already came back", async () => {
    // A first runner of this process stops while its worker's fetch is held up by a frozen proxy. It detaches
    // as it begins to stop, so the return of that fetch is never heard here. Then X holds the key, and its idle
    // worker, nudged for the job woken early (102, which only Z, another process, may take), comes back
    // empty: once no other fetch of this process is out, the key must not be kept for 102 at the release.
    const { proxy, proxied } = await proxiedDatabase();
    const locks = newLocks();
    const { task, spans, gate } = spannedTask(locks, "kept_after_stop", 400);
    const staleEvents = new EventEmitter() as WorkerEvents;
    let staleWorker: Worker | undefined;
    staleEvents.on("worker:getJob:empty", ({ worker }) => void (staleWorker ??= worker));
    let staleFetching = false;
    staleEvents.on("worker:getJob:start", () => void (staleFetching = true));
    staleEvents.on("worker:getJob:empty", () => void (staleFetching = false));
    const stale = await startRunner({
      connectionString: proxied.toString(),
      concurrency: 1,
      pollInterval: 60_000,
      events: staleEvents,
      taskList: { kept_after_stop_other: async () => undefined },
    });
    cleanups.push(async () => {
      proxy.thaw();
      await stale.stop().catch(() => undefined);
    });
    locks.attach(stale);
    await waitFor(async () => staleWorker !== undefined && !staleFetching, {
      message: "the first runner's worker to be idle",
    });
    proxy.freeze();
    expect(staleWorker!.nudge()).toBe(true);
    await waitFor(async () => staleFetching, { message: "the first runner's worker to fetch" });
    const stopping = stale.stop();
    proxy.thaw();
    await stopping;

    const x = await runner({
      connectionString: h.db.url,
      concurrency: 2,
      pollInterval: 60_000,
      forbiddenFlags: ["z_only"],
      taskList: { kept_after_stop: task },
    });
    locks.attach(x);
    const other = newLocks();
    const z = spannedTask(other, "kept_after_stop", 400);
    await runner({
      connectionString: h.db.url,
      concurrency: 1,
      pollInterval: 100,
      forbiddenFlags: ["x_only"],
      taskList: { kept_after_stop: z.task },
    });

    // Three jobs of 400 ms teach X's task its usual hold: the next job in line is woken 380 ms into a hold,
    // and a key is kept for it for 800 ms at most.
    await locks.addJobs(
      [0, 1, 2].map((n) => ({ identifier: "kept_after_stop", payload: { n }, flags: ["x_only"] })),
    );
    await waitFor(async () => [0, 1, 2].every((n) => spans.get(n)?.end != null), {
      message: "the teaching jobs to run",
    });
    await waitFor(async () => (await parkedCount()) === 0, { message: "the line to empty" });

    // 100 holds the key in X; 101 (for X) and 102 (for Z only) meet it and wait in line. 100's release wakes
    // 101, whose hold, having a line, wakes 102 early for an idle worker of X, which may not take it.
    const x102 = await holdWithLine(locks, x, "kept_after_stop", ["z_only"], other);
    const mid = locks.status().handoffs;
    await waitFor(
      async () => locks.status().handoffs.wokenHere === mid.wokenHere + 1 && x102.fetching() === 0,
      { message: "101 to wake 102 early for an idle worker of X, which comes back empty" },
    );
    gate.resolve();
    await waitFor(async () => spans.get(101)?.end != null, { message: "101 to end" });
    await waitFor(async () => z.spans.get(102)?.end != null, { message: "102 to run in Z" });
    expect(locks.status().handoffs.keptForArrival).toBe(mid.keptForArrival);
    expect(z.spans.get(102)!.start).toBeGreaterThanOrEqual(spans.get(101)!.end!);
  });
});
