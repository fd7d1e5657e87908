/**
 * Throttle per key (`rate`), snooze and pause from a task, and what `canStart` and `rateStatus` say about
 * them. Starts are the instants the database admitted the jobs (`rate:admitted`, its clock). Real
 * PostgreSQL, real graphile-worker runners; the cross-process proofs are in rate.long.test.ts.
 */
import { describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  makeLocksFromPreset,
  NotPausableError,
  PauseError,
  pause,
  snooze,
  type Locks,
} from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { IdleWorkers } from "../../src/session/idle.js";
import { Wakes } from "../../src/rates/wakes.js";
import { maxStartsInWindow, minStartsInPeriods } from "../support/rates.js";
import { startRunner } from "../support/runner.js";
import { slotKeys } from "../../src/key.js";

const h = useExclusiveHarness(
  "truncate test_executions, test_events; delete from graphile_worker_locks.rates; delete from graphile_worker_locks.rate_reservations; delete from graphile_worker_locks.pauses",
);
const { db, newLocks, runner, jobRows } = h;

/** Every admission (`rate:admitted`) of `locks`, as ms on the database's clock, with the payload's `n`. */
function recordStarts(locks: Locks) {
  const starts: Array<{ n: number; at: number; attempts: number }> = [];
  locks.events.on("rate:admitted", (e) =>
    starts.push({
      n: (e.job.payload as { n: number }).n,
      at: e.at.getTime(),
      attempts: e.job.attempts,
    }),
  );
  return starts;
}

/**
 * Every job done. A row given back (its copy carries the job) whose completion graphile-worker lost when its
 * runner stopped is not waited for: the library deletes such rows itself (clean_given_back), a minute on.
 */
const drained = () =>
  waitFor(
    async () =>
      (
        await db.pool().query<{ n: number }>(
          `select count(*)::int as n from graphile_worker._private_jobs j
             where not (j.attempts >= j.max_attempts and j.locked_at is not null
               and exists (select 1 from graphile_worker_locks.given_back g where g.job_id = j.id))`,
        )
      ).rows[0]!.n === 0,
    { message: "jobs to drain", timeoutMs: 30_000 },
  );

describe("rate", () => {
  for (const lock of [false, true]) {
    it(`no window of a period holds more than limit starts; a backlog uses the rate${lock ? "" : ", in order"} (lock: ${lock})`, async () => {
      const locks = newLocks();
      const starts = recordStarts(locks);
      const throttledOrder: number[] = [];
      locks.events.on("job:throttled", (e) => {
        const n = (e.job.payload as { n: number }).n;
        if (!throttledOrder.includes(n)) throttledOrder.push(n);
      });
      let throttles = 0;
      locks.events.on("job:throttled", () => throttles++);
      const limit = 3;
      const period = 700;
      const task = locks.exclusive("rated", async (_p: { n: number; k: string }) => undefined, {
        key: (p) => ({ k: p.k }),
        lock,
        limit: lock ? 1 : undefined,
        onConflict: lock ? "reschedule" : undefined,
        reschedule: { minDelay: 50, maxDelay: 200 },
        rate: { limit, period },
      });
      const jobs = 9;
      await h.utils.addJobs(
        Array.from({ length: jobs }, (_, n) => ({ identifier: "rated", payload: { n, k: "a" } })),
      );
      const r = await runner({
        connectionString: db.url,
        concurrency: 8,
        taskList: { rated: task },
      });
      locks.attach(r);
      await drained();

      const at = starts.map((s) => s.at);
      expect(starts.map((s) => s.n).sort((a, b) => a - b)).toEqual(
        Array.from({ length: jobs }, (_, n) => n),
      );
      expect(starts.every((s) => s.attempts === 1)).toBe(true);
      expect(maxStartsInWindow(at, period)).toBe(limit);
      // Each period from the first start holds at least limit - 1 starts.
      expect(minStartsInPeriods(at, period)).toBeGreaterThanOrEqual(limit - 1);
      // At most one give-back per job (no busy loop).
      expect(throttles).toBeLessThanOrEqual(jobs);
      // Jobs given back keep their order: they start, on the database's clock, in the order they first
      // met the rate. (Not in the order of their events: two jobs admitted a few ms apart on separate
      // connections may have their answers handled in either order. Starts in the same millisecond are
      // simultaneous as far as a Date tells. With a lock, jobs whose slots come at once race for the lock,
      // and the losers park.)
      const startOf = new Map(starts.map((s) => [s.n, s.at]));
      const outOfOrder = throttledOrder
        .slice(1)
        .filter((n, i) => startOf.get(n)! < startOf.get(throttledOrder[i]!)!);
      if (!lock) expect(outOfOrder).toEqual([]);
    });
  }
});

describe("rate: burst, failures, reservations", () => {
  it("burst: at most `burst` starts in any window of period × burst / limit, and `limit` in any period", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const task = locks.exclusive("bursty", async () => undefined, {
      lock: false,
      key: () => "one",
      rate: { limit: 4, period: 800, burst: 2 },
    });
    await h.utils.addJobs(
      Array.from({ length: 7 }, (_, n) => ({ identifier: "bursty", payload: { n } })),
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 8,
      taskList: { bursty: task },
    });
    locks.attach(r);
    await drained();
    const at = starts.map((s) => s.at);
    expect(at).toHaveLength(7);
    expect(maxStartsInWindow(at, 400)).toBe(2);
    expect(maxStartsInWindow(at, 800)).toBeLessThanOrEqual(4);
  });

  it("a job that fails still counted its start", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const task = locks.exclusive(
      "failing",
      async (p: { n: number }) => {
        if (p.n === 0) throw new Error("boom");
      },
      { lock: false, key: () => "one", rate: { limit: 1, period: 800 } },
    );
    await h.utils.addJob("failing", { n: 0 }, { maxAttempts: 1 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { failing: task },
    });
    locks.attach(r);
    await waitFor(async () => starts.length === 1);
    await h.utils.addJob("failing", { n: 1 });
    await waitFor(async () => starts.length === 2, { message: "the second start" });
    expect(starts.map((s) => s.n)).toEqual([0, 1]);
    expect(starts[1]!.at - starts[0]!.at).toBeGreaterThanOrEqual(800);
  });

  it("a reservation whose job is gone does not hold its slot", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const throttled = new Map<number, string>();
    locks.events.on("job:throttled", (e) =>
      throttled.set((e.job.payload as { n: number }).n, e.newJobId),
    );
    const period = 2000;
    const task = locks.exclusive("gone", async () => undefined, {
      lock: false,
      key: () => "one",
      rate: { limit: 1, period },
    });
    await h.utils.addJob("gone", { n: 0 });
    const r = await runner({ connectionString: db.url, concurrency: 4, taskList: { gone: task } });
    locks.attach(r);
    await waitFor(async () => starts.length === 1);
    await h.utils.addJob("gone", { n: 1 });
    await waitFor(async () => throttled.has(1), { message: "job 1 to meet the rate" });
    await h.q("delete from graphile_worker._private_jobs where id = $1", [throttled.get(1)]);
    await h.utils.addJob("gone", { n: 2 });
    await waitFor(async () => throttled.has(2), { message: "job 2 to meet the rate" });
    const { rows } = await h.q<{ at: Date }>(
      "select at from graphile_worker_locks.rate_reservations where job_id = $1",
      [throttled.get(2)],
    );
    // Job 2 has the slot job 1 had reserved, one period after job 0 (not two).
    expect(rows[0]!.at.getTime()).toBe(starts[0]!.at + period);
    await waitFor(async () => starts.length === 2, { message: "job 2 to start" });
    expect(starts[1]!.n).toBe(2);
  });
});

describe("rate: the sweep", () => {
  it("removes a key's log once its newest start is a period old, and ended pauses; a log still counting stays, and the rate holds after", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    type P = { k: string; n: number; pauseMs?: number };
    let paused = false;
    const body = async (p: P) => {
      if (p.pauseMs && !paused) {
        paused = true;
        throw new PauseError(p.pauseMs);
      }
    };
    const rules = (period: number) => ({
      lock: false,
      key: (p: P) => p.k,
      rate: { limit: 2, period },
    });
    const short = locks.exclusive("swept", body, rules(300));
    const long = locks.exclusive("swept_long", body, rules(60_000));
    await h.utils.addJobs([
      { identifier: "swept", payload: { k: "a", n: 0 } },
      { identifier: "swept", payload: { k: "b", n: 1, pauseMs: 200 }, maxAttempts: 1 },
      { identifier: "swept_long", payload: { k: "a", n: 2 } },
    ]);
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { swept: short, swept_long: long },
    });
    locks.attach(r);
    await drained();
    const logs = async () => (await h.q("select 1 from graphile_worker_locks.rates")).rows.length;
    const pauses = async () =>
      (await h.q("select 1 from graphile_worker_locks.pauses")).rows.length;
    expect(await logs()).toBe(3);
    expect(await pauses()).toBe(1);
    // A period (and the pause) later, two logs and the pause no longer count; the long period's log does.
    await new Promise((resolve) => setTimeout(resolve, 400));
    expect(await locks.sweep()).toBe(3);
    expect(await logs()).toBe(1);
    expect(await pauses()).toBe(0);
    expect(await locks.sweep()).toBe(0);
    // The long period's log still counts: one more start now, the next waits for its slot a minute on.
    await h.utils.addJobs([
      { identifier: "swept_long", payload: { k: "a", n: 3 } },
      { identifier: "swept_long", payload: { k: "a", n: 4 } },
    ]);
    await waitFor(async () => starts.some((x) => x.n >= 3), { message: "one more start" });
    await new Promise((resolve) => setTimeout(resolve, 300));
    expect(starts.filter((x) => x.n >= 3)).toHaveLength(1);
  });
});

describe("snooze and pause", () => {
  it("snooze gives the job back for a while without counting an attempt", async () => {
    const locks = newLocks();
    const runs: Array<{ attempts: number; at: number }> = [];
    const snoozed: Date[] = [];
    locks.events.on("job:snoozed", (e) => snoozed.push(e.runAt));
    const task = locks.exclusive("snoozer", async (_p, helpers) => {
      const { rows } = await h.q<{ now: Date }>("select clock_timestamp() as now");
      runs.push({ attempts: helpers.job.attempts, at: rows[0]!.now.getTime() });
      if (runs.length === 1) snooze(400);
    });
    // (one attempt: a counted attempt would leave the copy nothing to run with)
    await h.utils.addJob("snoozer", { n: 0 }, { maxAttempts: 1 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { snoozer: task },
    });
    locks.attach(r);
    await drained();
    expect(runs).toHaveLength(2);
    expect(runs.map((x) => x.attempts)).toEqual([1, 1]);
    expect(runs[1]!.at).toBeGreaterThanOrEqual(snoozed[0]!.getTime());
    expect(snoozed[0]!.getTime() - runs[0]!.at).toBeGreaterThanOrEqual(400);
  });

  it("pause stops the key's jobs in every instance and across a restart, until it ends on its own", async () => {
    const rules = {
      lock: false,
      key: (p: { account: string; n: number }) => ({ account: p.account }),
      rate: { limit: 100, period: 60_000 },
    } as const;
    const define = (locks: Locks, paused: { n: number }) =>
      locks.exclusive(
        "api_call",
        async (p: { account: string; n: number }) => {
          if (p.n === 0 && paused.n++ === 0) throw new PauseError(1500);
        },
        rules,
      );
    const first = newLocks();
    const starts = recordStarts(first);
    const pausedEvents: Date[] = [];
    first.events.on("job:paused", (e) => pausedEvents.push(e.until));
    const paused = { n: 0 };
    await h.utils.addJob("api_call", { account: "a", n: 0 }, { maxAttempts: 1 });
    const r1 = await startRunner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { api_call: define(first, paused) },
    });
    let stopped = false;
    h.cleanups.push(async () => stopped || r1.stop());
    first.attach(r1);
    await waitFor(async () => pausedEvents.length === 1, { message: "the pause" });
    const until = pausedEvents[0]!.getTime();
    await h.utils.addJob("api_call", { account: "a", n: 1 });
    await h.utils.addJob("api_call", { account: "b", n: 2 });
    await waitFor(async () => starts.some((s) => s.n === 2), { message: "account b to run" });
    // A restart: this worker stops, another instance (its own connections) takes over.
    stopped = true;
    await r1.stop();
    const second = newLocks();
    const later = recordStarts(second);
    const task2 = define(second, paused);
    expect(await second.canStart("api_call", { account: "a", n: 9 })).toEqual({
      ok: false,
      blockers: [expect.objectContaining({ kind: "paused", until: new Date(until) })],
    });
    expect((await second.rateStatus()).paused).toEqual([
      expect.objectContaining({
        label: 'gwl:v1:rate:api_call:{"account":"a"}',
        until: new Date(until),
      }),
    ]);
    await h.utils.addJob("api_call", { account: "a", n: 3 });
    const r2 = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { api_call: task2 },
    });
    second.attach(r2);
    await drained();
    const all = [...starts, ...later];
    expect(all.find((s) => s.n === 2)!.at).toBeLessThan(until);
    for (const n of [0, 1, 3]) {
      const s = all.find((x) => x.n === n && x.at >= until);
      expect(s, `job ${n} after the pause`).toBeDefined();
    }
    // Account a's jobs enqueued during the pause start after it, none before.
    const ofA = all.filter((s) => s.n === 1 || s.n === 3);
    expect(ofA).toHaveLength(2);
    expect(ofA.every((s) => s.at >= until)).toBe(true);
    expect((await second.rateStatus()).paused).toEqual([]);
  });

  it("a PauseError from a task that cannot pause fails its job with a NotPausableError", async () => {
    const locks = newLocks();
    const plain = locks.exclusive("plain", async () => pause(1000), {});
    const keyed = locks.exclusive("keyed", async () => pause(1000, { scope: "rate" }), {
      pausable: true,
    });
    await h.utils.addJob("plain", {}, { maxAttempts: 1 });
    await h.utils.addJob("keyed", {}, { maxAttempts: 1 });
    await runner({ connectionString: db.url, concurrency: 2, taskList: { plain, keyed } });
    const failed = await waitFor(async () => {
      const rows = (await jobRows()).filter((j) => j.last_error);
      return rows.length === 2 && rows;
    });
    expect(failed.map((j) => j.last_error)).toEqual([
      expect.stringContaining("Task 'plain' threw a PauseError, but the task can pause only with"),
      expect.stringContaining("it has no `rate` to pause"),
    ]);
    expect(new NotPausableError("t", "x").code).toBe("GWL_NOT_PAUSABLE");
  });
});

describe("canStart, rateStatus, validation", () => {
  it("canStart names the rate that blocks a payload and when its next slot frees", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const task = locks.exclusive("report", async () => undefined, {
      lock: false,
      rate: { limit: 2, period: 60_000, key: (p: { user: number }) => p.user },
    });
    await h.utils.addJobs([
      { identifier: "report", payload: { user: 1 } },
      { identifier: "report", payload: { user: 1 } },
    ]);
    await runner({ connectionString: db.url, concurrency: 2, taskList: { report: task } });
    await drained();
    const first = Math.min(...starts.map((s) => s.at));
    expect(await locks.canStart("report", { user: 1 })).toEqual({
      ok: false,
      blockers: [
        expect.objectContaining({
          kind: "rate",
          group: "report",
          limit: 2,
          used: 2,
          waiting: 0,
          nextAt: new Date(first + 60_000),
        }),
      ],
    });
    expect(await locks.canStart("report", { user: 2 })).toEqual({ ok: true, blockers: [] });
    expect((await locks.rateStatus()).throttled).toEqual([
      expect.objectContaining({ label: "gwl:v1:rate:report:1", used: 2, limit: 2, period: 60_000 }),
    ]);
  });

  it("bad rate options are refused naming the option", () => {
    const locks = newLocks();
    const bad: Array<[object, string]> = [
      [{ rate: { limit: 0, period: 1000 } }, "`rate.limit`"],
      [{ rate: { limit: 2, period: 0 } }, "`rate.period`"],
      [{ rate: { limit: 2, period: 1000, burst: 3 } }, "`rate.burst`"],
      [{ rate: { limit: 2, period: 1000, key: "x" } }, "`rate.key`"],
      [{ rate: { limit: 2, period: 1000, every: 1 } }, "unknown option `every`"],
      [{ lock: false }, "`lock: false` needs a `rate`"],
      [{ lock: false, rate: { limit: 1, period: 1 }, limit: 2 }, "`limit` needs a lock"],
      [{ pausable: "yes" }, "`pausable`"],
    ];
    for (const [options, message] of bad) {
      expect(() => locks.exclusive("t", async () => undefined, options)).toThrow(
        InvalidArgumentError,
      );
      expect(() => locks.exclusive("t", async () => undefined, options)).toThrow(message);
    }
    expect(() => snooze(-1)).toThrow("`snooze` needs a non-negative number");
    // The preset (and a task file) refuse them at start-up, naming the task.
    expect(() =>
      makeLocksFromPreset({
        worker: {
          connectionString: db.url,
          locks: { tasks: { api_call: { rate: { limit: 10, period: -1 } } } },
        },
      }),
    ).toThrow(/task 'api_call'.*`rate.period`/);
  });
});

describe("rate: wakes", () => {
  it("a process sends one wake statement at a time; the wakes due meanwhile go together in the next", async () => {
    let inFlight = 0;
    let most = 0;
    let statements = 0;
    const woken: string[] = [];
    const wakes = new Wakes(new IdleWorkers(), async (reserved) => {
      inFlight++;
      statements++;
      most = Math.max(most, inFlight);
      try {
        // (a wake statement that takes a while, as on a busy server)
        await db.pool().query("select pg_sleep(0.05)");
        woken.push(...reserved);
        return [];
      } finally {
        inFlight--;
      }
    });
    const copies = Array.from({ length: 20 }, (_, i) => String(100 + i));
    copies.forEach((copy, i) => wakes.in(i, copy));
    await waitFor(async () => woken.length === copies.length, { message: "every copy woken" });
    wakes.clear();
    expect([...woken].sort()).toEqual(copies);
    expect(most).toBe(1);
    expect(statements).toBeLessThan(copies.length);
  });
});

describe("rate: a reserved slot", () => {
  it("a job that asks for its reserved slot just ahead of it is held and starts at the slot, not sent back to wait", async () => {
    const job = await h.utils.addJob("held", { n: 0 });
    // Key 42, limit 1 per 400 ms: its last start 100 ms ago, so the next slot is 300 ms ahead, reserved
    // for the job.
    await h.q(
      `insert into graphile_worker_locks.rates (rate_key, label, lim, burst, period, starts)
       values (42, 'held', 1, 1, interval '400 milliseconds', array[clock_timestamp() - interval '100 milliseconds'])`,
    );
    await h.q(
      `insert into graphile_worker_locks.rate_reservations (job_id, rate_key, at, run_at)
       select $1, 42, r.starts[1] + r.period, now() from graphile_worker_locks.rates r where r.rate_key = 42`,
      [job.id],
    );
    const slot = (
      await h.q(
        "select at::text as at from graphile_worker_locks.rate_reservations where job_id = $1",
        [job.id],
      )
    ).rows[0] as { at: string };
    const { rows } = await h.q(
      `select r.admitted, r.reason
       from graphile_worker_locks.rate_start($1, 42, 'held', 1, interval '400 milliseconds', 1, '{}', null,
         interval '0', interval '1 second', interval '20 milliseconds', interval '1 second') r`,
      [job.id],
    );
    expect(rows[0]).toEqual({ admitted: true, reason: null });
    // (exactness: its start, now the key's last, is not before its slot)
    const { rows: log } = await h.q(
      "select starts[1] >= $1::timestamptz as ok from graphile_worker_locks.rates where rate_key = 42",
      [slot.at],
    );
    expect(log).toEqual([{ ok: true }]);
  });
});

describe("rate: a copy whose slot moved later", () => {
  it("is not woken at its old slot: its reservation and run_at move to the new one, and its process wakes it then", async () => {
    // Key 43, limit 2 per 3 s: two starts 100 ms ago and 50 ms ago. Copy `late` reserved a slot as planned
    // when it was given back (a start expected long ago that came only now): its slot is now the first
    // start's plus the period. Copy `next`, behind it in line, planned after `late`: the second start's plus
    // the period. Copy `near` of key 44 (limit 1 per 400 ms, started 100 ms ago): its slot is 300 ms away,
    // as planned.
    const late = await h.utils.addJob("moved", { n: 0 }, { runAt: new Date(Date.now() + 60_000) });
    const next = await h.utils.addJob("moved", { n: 1 }, { runAt: new Date(Date.now() + 60_000) });
    const near = await h.utils.addJob("moved", { n: 2 }, { runAt: new Date(Date.now() + 60_000) });
    await h.q(
      `insert into graphile_worker_locks.rates (rate_key, label, lim, burst, period, starts) values
         (43, 'moved', 2, 2, interval '3 seconds',
          array[clock_timestamp() - interval '100 milliseconds', clock_timestamp() - interval '50 milliseconds']),
         (44, 'near', 1, 1, interval '400 milliseconds', array[clock_timestamp() - interval '100 milliseconds'])`,
    );
    await h.q(
      `insert into graphile_worker_locks.rate_reservations (job_id, rate_key, at, run_at)
       values ($1, 43, clock_timestamp() - interval '10 milliseconds', now() - interval '1 hour'),
              ($2, 43, clock_timestamp(), now() - interval '1 hour'),
              ($3, 44, clock_timestamp() + interval '300 milliseconds', now() - interval '1 hour')`,
      [late.id, next.id, near.id],
    );
    const { rows } = await h.q(
      `select r.copy_id::text as copy_id, extract(epoch from r.at - s.starts[1]) * 1000 as after_first,
         extract(epoch from r.at - s.starts[2]) * 1000 as after_second
       from graphile_worker_locks.wake_reserved_planned($1, interval '750 milliseconds',
         interval '20 milliseconds') r
       cross join graphile_worker_locks.rates s where s.rate_key = 43 order by r.at`,
      [[late.id, next.id, near.id]],
    );
    // `late` and `next` are answered with their new slots (each a period after a start); `near` is woken.
    expect(rows.map((r) => r.copy_id)).toEqual([late.id, next.id]);
    expect(Math.round(rows[0]!.after_first)).toBe(3000);
    expect(Math.round(rows[1]!.after_second)).toBe(3000);
    const { rows: jobs } = await h.q(
      `select j.id::text as id, extract(epoch from j.run_at - v.at) * 1000 as before_slot,
         j.run_at < now() as runnable
       from graphile_worker._private_jobs j join graphile_worker_locks.rate_reservations v on v.job_id = j.id
       where j.id = any($1) order by j.id`,
      [[late.id, next.id, near.id]],
    );
    expect(jobs.map((j) => [j.id, j.runnable])).toEqual([
      [late.id, false],
      [next.id, false],
      [near.id, true],
    ]);
    // (a moved copy's run_at: its new slot less the lead)
    expect(jobs.slice(0, 2).map((j) => Math.round(j.before_slot))).toEqual([-20, -20]);

    // The process's wakes: a copy answered as moved is woken again, ahead of its new slot.
    const sent: string[][] = [];
    const wakes = new Wakes(new IdleWorkers(), async (reserved) => {
      sent.push(reserved);
      return sent.length === 1 ? [{ copy: reserved[0]!, delayMs: 150 }] : [];
    });
    const t0 = performance.now();
    wakes.in(0, "7");
    await waitFor(async () => sent.length === 2, { message: "the moved copy woken again" });
    wakes.clear();
    expect(sent).toEqual([["7"], ["7"]]);
    expect(performance.now() - t0).toBeGreaterThanOrEqual(150);
  });
});

describe("rate with an execution lock", () => {
  it("a job over the rate is given back without ever taking its key's lock", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const took: number[] = [];
    for (const kind of ["lock:acquired", "lock:conflict"] as const)
      locks.events.on(kind, (e) => took.push((e.job.payload as { n: number }).n));
    const throttled = new Map<number, string>();
    locks.events.on("job:throttled", (e) =>
      throttled.set((e.job.payload as { n: number }).n, e.newJobId),
    );
    const task = locks.exclusive("locked", async () => undefined, {
      key: () => "one",
      onConflict: "reschedule",
      rate: { limit: 1, period: 60_000 },
    });
    await h.utils.addJob("locked", { n: 0 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { locked: task },
    });
    locks.attach(r);
    await waitFor(async () => starts.length === 1, { message: "job 0 to start" });
    await h.utils.addJob("locked", { n: 1 });
    await waitFor(async () => throttled.has(1), { message: "job 1 to meet the rate" });
    // Job 0 took the key to run; job 1 never touched it (its copy waits for its slot, a period on).
    expect(took).toEqual([0]);
    expect(starts.map((s) => s.n)).toEqual([0]);
    await h.q("delete from graphile_worker._private_jobs where id = $1", [throttled.get(1)]);
  });

  it("a job whose key is at most half used counts its start before it takes its lock, and takes it back when it meets its lock held", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const parked: number[] = [];
    locks.events.on("job:rescheduled", (e) => parked.push((e.job.payload as { n: number }).n));
    // (two slots: a job of one slot and one limit asks its rate in its lock statement, rate-ride.test.ts)
    const task = locks.exclusive("counted", async () => undefined, {
      key: () => "one",
      limit: 2,
      onConflict: "reschedule",
      reschedule: { minDelay: 50, maxDelay: 200 },
      rate: { limit: 10, period: 60_000 },
    });
    const slots = slotKeys("counted", "one", 2, null).map(String);
    // Every log the key's row holds, as written (a probe's start, then its refund).
    await h.q(`
      create table if not exists test_rate_logs (id bigserial primary key, n int not null);
      truncate test_rate_logs;
      create or replace function test_record_rate_log() returns trigger language plpgsql as $$
      begin
        insert into test_rate_logs (n) values (cardinality(new.starts));
        return null;
      end;
      $$;
      drop trigger if exists test_rate_logs on graphile_worker_locks.rates;
      create trigger test_rate_logs after insert or update on graphile_worker_locks.rates
        for each row when (new.label like '%:counted:%') execute function test_record_rate_log();`);
    const holder = await db.pool().connect();
    try {
      await holder.query("select pg_advisory_lock(k) from unnest($1::bigint[]) k", [slots]);
      await h.utils.addJob("counted", { n: 0 });
      const r = await runner({
        connectionString: db.url,
        concurrency: 4,
        taskList: { counted: task },
      });
      locks.attach(r);
      await waitFor(async () => parked.includes(0), { message: "job 0 to park" });
      // Its probe counted its start (a log of 1), then took it back (a log of 0) when the lock was held.
      const logs = async () =>
        (await h.q<{ n: number }>("select n from test_rate_logs order by id")).rows.map((x) => x.n);
      await waitFor(async () => (await logs()).length >= 2, {
        message: "the start and its refund",
      });
      expect((await logs()).slice(0, 2)).toEqual([1, 0]);
      // (its copy, back from the park while the lock is still held, may count and take back again: never
      // more than that one start in the log)
      expect(Math.max(...(await logs()))).toBe(1);
      const log = async () =>
        (
          await h.q<{ n: number }>(
            "select cardinality(starts) as n from graphile_worker_locks.rates where label like '%:counted:%'",
          )
        ).rows[0]?.n;
      expect(starts).toEqual([]);
      await holder.query("select pg_advisory_unlock(k) from unnest($1::bigint[]) k", [slots]);
      // Its copy starts once the key is free, counted once.
      await waitFor(async () => starts.length === 1, { message: "job 0 to start" });
      await drained();
      expect(await log()).toBe(1);
      expect(starts.map((x) => x.n)).toEqual([0]);
      // Its start is the instant its probe counted it: the one in the log.
      const { rows } = await h.q<{ at: number }>(
        "select (extract(epoch from starts[1]) * 1000)::float8 as at from graphile_worker_locks.rates where label like '%:counted:%'",
      );
      expect(Math.abs(rows[0]!.at - starts[0]!.at)).toBeLessThan(1);
    } finally {
      await holder.query("select pg_advisory_unlock_all()");
      holder.release();
      await h.q("drop trigger if exists test_rate_logs on graphile_worker_locks.rates");
    }
  });

  it("a job that meets its key's lock held once its slot came keeps its reservation through the park", async () => {
    const locks = newLocks();
    const starts = recordStarts(locks);
    const parked = new Map<number, string>();
    locks.events.on("job:rescheduled", (e) =>
      parked.set((e.job.payload as { n: number }).n, e.newJobId),
    );
    const throttled = new Map<number, string>();
    locks.events.on("job:throttled", (e) =>
      throttled.set((e.job.payload as { n: number }).n, e.newJobId),
    );
    // (two slots, as above)
    const task = locks.exclusive("kept", async () => undefined, {
      key: () => "one",
      limit: 2,
      onConflict: "reschedule",
      reschedule: { minDelay: 50, maxDelay: 200 },
      rate: { limit: 1, period: 60_000 },
    });
    const slots = slotKeys("kept", "one", 2, null).map(String);
    // The key's lock is held elsewhere (another connection), so job 0, whose slot is now, parks.
    const holder = await db.pool().connect();
    try {
      await holder.query("select pg_advisory_lock(k) from unnest($1::bigint[]) k", [slots]);
      await h.utils.addJob("kept", { n: 0 });
      const r = await runner({
        connectionString: db.url,
        concurrency: 4,
        taskList: { kept: task },
      });
      locks.attach(r);
      await waitFor(async () => parked.has(0), { message: "job 0 to park" });
      // Its copy holds its reservation: job 1 plans its slot after job 0's and goes back to the queue
      // rather than finding the slot free and parking behind the lock as well.
      await h.utils.addJob("kept", { n: 1 });
      await waitFor(async () => throttled.has(1) || parked.has(1), { message: "job 1 decided" });
      expect(parked.has(1)).toBe(false);
      // (job 0's copy may park again, by its safety net, while the lock is held: hence its payload)
      const { rows } = await h.q<{ n: number }>(
        `select (j.payload->>'n')::int as n from graphile_worker_locks.rate_reservations r
         join graphile_worker._private_jobs j on j.id = r.job_id order by r.pos`,
      );
      expect(rows.map((x) => x.n)).toEqual([0, 1]);
      await holder.query("select pg_advisory_unlock(k) from unnest($1::bigint[]) k", [slots]);
      // The copy runs (by its safety net or a wake) at its reserved slot.
      await waitFor(async () => starts.length === 1, { message: "job 0 to start" });
      expect(starts.map((s) => s.n)).toEqual([0]);
    } finally {
      await holder.query("select pg_advisory_unlock_all()");
      holder.release();
    }
    await h.q("delete from graphile_worker._private_jobs where id = $1", [throttled.get(1)]);
  });
});
