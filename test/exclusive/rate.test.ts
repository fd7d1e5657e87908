/**
 * Throttle per key (`rate`), snooze and pause from a task, and what `canStart` and `rateStatus` say about
 * them. Starts are the instants the database admitted the jobs (`rate:admitted`, its clock). Real
 * PostgreSQL, real graphile-worker runners; the cross-process proofs are in rate.long.test.ts.
 */
import { describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  NotPausableError,
  PauseError,
  pause,
  snooze,
  type Locks,
} from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { maxStartsInWindow, minStartsInWindow } from "../support/rates.js";

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

const drained = () =>
  waitFor(async () => (await jobRows()).length === 0, {
    message: "jobs to drain",
    timeoutMs: 60_000,
  });

describe("rate", () => {
  for (const lock of [false, true]) {
    it(`no window of a period holds more than limit starts; a backlog uses the rate, in order (lock: ${lock})`, async () => {
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
      const jobs = 12;
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
      expect(minStartsInWindow(at, period)).toBeGreaterThanOrEqual(limit - 1);
      // Jobs given back keep their order: they start in the order they first met the rate.
      const admittedAfterThrottle = starts
        .map((s) => s.n)
        .filter((n) => throttledOrder.includes(n));
      expect(admittedAfterThrottle).toEqual(throttledOrder);
      // At most one give-back per job (no busy loop).
      expect(throttles).toBeLessThanOrEqual(jobs);
    });
  }
});
