/**
 * Throttle per key across processes: 3 worker processes (test/fixtures/worker.ts) × concurrency 8 share a
 * backlog of thousands of jobs over several keys. Every start is the instant the database admitted the job
 * (its clock), recorded by the process that ran it; every start is taken as the left edge of a window.
 * Snooze and pause across processes and a restart of a worker. Run with TEST_LONG=1.
 */
import { makeWorkerUtils, type WorkerUtils } from "graphile-worker";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { useTestDatabase, waitFor } from "../support/db.js";
import { maxConcurrencyPerKey, readExecutions } from "../support/executions.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";
import {
  maxStartsInWindow,
  minStartsInPeriods,
  startsPerPeriod,
  minStartsInWindow,
} from "../support/rates.js";

const db = useTestDatabase();
let utils: WorkerUtils;

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url });
});
afterAll(async () => {
  await utils?.release();
});

const q = <R extends object>(text: string, values: unknown[] = []) =>
  db.pool().query<R & Record<string, unknown>>(text, values);

async function reset() {
  await q(
    `truncate test_executions, test_events; delete from graphile_worker._private_jobs;
     delete from graphile_worker_locks.rates; delete from graphile_worker_locks.rate_reservations;
     delete from graphile_worker_locks.pauses`,
  );
}

/**
 * Waits until no job is left but rows given back to the queue (their copies carry on) whose completion
 * graphile-worker lost when a worker stopped: the library removes those within a minute or two
 * (clean_given_back), not part of what is checked here.
 */
async function drained(timeoutMs: number): Promise<void> {
  await waitFor(
    async () =>
      (
        await q<{ n: number }>(
          `select count(*)::int as n from graphile_worker._private_jobs j
           where not (j.attempts >= j.max_attempts and j.locked_at is not null
             and exists (select 1 from graphile_worker_locks.given_back g where g.job_id = j.id))`,
        )
      ).rows[0]!.n === 0,
    { timeoutMs, intervalMs: 200, message: "all jobs to finish" },
  );
}

/** Each key's starts, as ms on the database's clock. */
async function startsByKey(): Promise<Map<string, Array<{ n: number; at: number }>>> {
  const { rows } = await q<{ k: string; n: number; at: string }>(
    `select lock_key as k, (detail->>'n')::int as n, (extract(epoch from at) * 1000)::float8 as at
     from test_events where kind = 'admitted' order by at`,
  );
  const byKey = new Map<string, Array<{ n: number; at: number }>>();
  for (const r of rows) {
    const list = byKey.get(r.k) ?? [];
    list.push({ n: r.n, at: Number(r.at) });
    byKey.set(r.k, list);
  }
  return byKey;
}

describe("rate across 3 processes", () => {
  // (`ride`: a `drop` task with a lock of each job's own, whose rate is asked in its lock statement)
  for (const { lock, ride } of [
    { lock: false, ride: false },
    { lock: true, ride: false },
    { lock: true, ride: true },
  ]) {
    it(`a backlog of thousands over 3 keys: never more than limit starts in any period, each job once, no attempt burned; at least limit - 1 starts in each period from the first start, at most about one give-back per job (lock: ${lock}${ride ? ", in its lock statement" : ""})`, async () => {
      await reset();
      const limit = 20;
      // (long enough that a busy machine's fetch latency is small beside the spacing of the slots)
      const period = 4000;
      const keys = ["a", "b", "c"];
      const perKey = lock && !ride ? 200 : 400;
      const workers: WorkerProcess[] = [];
      try {
        for (const name of ["r1", "r2", "r3"]) {
          workers.push(
            await startWorkerProcess(db.url, {
              name,
              concurrency: 8,
              attach: true,
              rate: { limit, period, lock, ride },
            }),
          );
        }
        await utils.addJobs(
          keys.flatMap((k) =>
            Array.from({ length: perKey }, (_, i) => ({
              identifier: "rated",
              payload: { k, n: keys.indexOf(k) * perKey + i },
            })),
          ),
        );
        await drained(240_000);
      } finally {
        await Promise.all(workers.map((w) => w.stop()));
      }

      const byKey = await startsByKey();
      for (const k of keys) {
        const at = byKey.get(k)!.map((s) => s.at);
        expect(at).toHaveLength(perKey);
        expect(maxStartsInWindow(at, period), `key ${k}`).toBeLessThanOrEqual(limit);
        // How well the rate was used: the fewest starts in a period, the periods taken one after another
        // from the key's first start (the backlog exists from it), and in a window [s, s + period) from any
        // start s a period or more after the first; and the longest stretch without a start.
        const sorted = [...at].sort((x, y) => x - y);
        const gap = Math.max(...sorted.slice(1).map((t, i) => t - sorted[i]!));
        const fewest = minStartsInPeriods(at, period);
        // (the reading asserted: "starts per period", as the bench's rate row counts them)
        // (the message lists every period's starts, so that a shortfall says where it fell)
        expect(
          fewest,
          `key ${k}, starts per period: ${startsPerPeriod(at, period).join(" ")}`,
        ).toBeGreaterThanOrEqual(limit - 1);
        console.log(
          `lock: ${lock}${ride ? " (ride)" : ""}, key ${k}: fewest starts in a period from the first ${fewest} of ${limit}; in a window from any start after the first period ${minStartsInWindow(at, period, period)}; longest gap ${gap} ms`,
        );
      }
      const runs = await q<{ note: string; n: number; attempts: number }>(
        "select note, count(*)::int as n, max(attempts) as attempts from test_executions where task = 'rated' group by note",
      );
      expect(runs.rows).toHaveLength(keys.length * perKey);
      expect(runs.rows.every((r) => r.n === 1 && r.attempts === 1)).toBe(true);
      // With a lock per key, no two executions of a key overlap, whichever processes ran them (recorded start
      // and end on the database's clock).
      if (lock && !ride) {
        const most = maxConcurrencyPerKey(await readExecutions(db.pool(), "rated"));
        expect(Object.fromEntries(most)).toEqual(Object.fromEntries(keys.map((k) => [k, 1])));
      }
      // With a lock, a job the rate refuses never holds its key's lock: a lock conflict is a job whose slot
      // has come meeting the lock of another job that the rate let start.
      const events = await q<{ kind: string; n: number }>(
        `select kind, count(*)::int as n from test_events
         where kind in ('job:throttled', 'lock:conflict', 'job:rescheduled') group by kind`,
      );
      const count = (kind: string) => events.rows.find((r) => r.kind === kind)?.n ?? 0;
      console.log(
        `lock: ${lock}${ride ? " (ride)" : ""}: ${count("job:throttled")} give-backs over the rate, ${count("lock:conflict")} lock conflicts, ${count("job:rescheduled")} parks for ${keys.length * perKey} jobs`,
      );
      // About one give-back per job, never a loop (with a lock too: a copy whose slot moved later, behind
      // jobs that started late waiting for the key's lock, is woken at its new slot, not given back again).
      expect(count("job:throttled")).toBeLessThanOrEqual(keys.length * perKey * 1.1);
      // Each job has a key of its own: none may meet it held.
      if (ride) expect(count("lock:conflict")).toBe(0);
      // Jobs waiting for their slots at once (up to the concurrency of each process) share graphile-worker's
      // abort signal: what they wait on must not add a listener each to it, which Node.js warns of as a leak.
      const warnings = await q<{ detail: { name: string; message: string } }>(
        "select detail from test_events where kind = 'warning' and detail->>'name' = 'MaxListenersExceededWarning'",
      );
      expect(warnings.rows.map((r) => r.detail)).toEqual([]);
    }, 360_000);
  }
  // The runs above print both readings. lock: false, TEST_LONG=1 at load 10 to 22 on 2 cores: 20 of 20 in
  // each period from the first start; 14 to 19 in the worst window from a start after the first period: a
  // backlog's slots repeat the first burst a period on, so such a window stays full only while each start
  // is later than its slot by less than the gap between two starts of that burst. Spacing the slots
  // period / limit apart gave 17 to 20 in that window but 1.03 to 1.32 give-backs per job (0.95 without),
  // and 18 in one period under extra load: not kept. lock: true, at load 1 to 2: 20 of 20 in each period,
  // 19 to 20 in the worst window, 0.9 give-backs per job. (The jobs of a period start one after another,
  // each waiting for the key's lock, so the next period's slots come later than planned: each copy is
  // planned again when its process wakes it, sql/000010.sql.)
});

describe("snooze and pause across processes", () => {
  it("a pause holds in every process and across a restart; a snooze gives the job back for its delay, no attempt counted", async () => {
    await reset();
    const options = { concurrency: 8, attach: true, rate: { limit: 1000, period: 1000 } };
    const workers: WorkerProcess[] = [];
    try {
      for (const name of ["p1", "p2", "p3"]) {
        workers.push(await startWorkerProcess(db.url, { name, ...options }));
      }
      await utils.addJob("rated", { k: "p", n: 0, pause: 4000 }, { maxAttempts: 1 });
      const until = await waitFor(async () => {
        const { rows } = await q<{ until: Date }>("select until from graphile_worker_locks.pauses");
        return rows[0]?.until;
      });
      await utils.addJobs([
        ...Array.from({ length: 30 }, (_, i) => ({
          identifier: "rated",
          payload: { k: "p", n: 1 + i },
        })),
        ...Array.from({ length: 30 }, (_, i) => ({
          identifier: "rated",
          payload: { k: "q", n: 100 + i, snooze: i % 3 === 0 ? 1500 : undefined },
          maxAttempts: 1,
        })),
      ]);
      // A restart of one worker while the key is paused.
      await workers.shift()!.stop();
      workers.push(await startWorkerProcess(db.url, { name: "p4", ...options }));
      await drained(60_000);

      const byKey = await startsByKey();
      const p = byKey.get("p")!;
      expect(p.filter((s) => s.n !== 0).length).toBe(30);
      expect(p.filter((s) => s.at < until.getTime()).map((s) => s.n)).toEqual([0]);
      expect(p.filter((s) => s.n === 0 && s.at >= until.getTime())).toHaveLength(1);
      // The other key ran meanwhile.
      expect(byKey.get("q")!.some((s) => s.at < until.getTime())).toBe(true);
      // Each snoozed job ran twice, the second time no sooner than its snooze's end, no attempt counted.
      const snoozes = await q<{ n: number; run_at: string }>(
        "select (detail->>'n')::int as n, detail->>'runAt' as run_at from test_events where kind = 'job:snoozed'",
      );
      expect(snoozes.rows).toHaveLength(10);
      for (const { n, run_at } of snoozes.rows) {
        const runs = byKey.get("q")!.filter((s) => s.n === n);
        expect(runs).toHaveLength(2);
        expect(runs[1]!.at).toBeGreaterThanOrEqual(new Date(run_at).getTime());
        expect(runs[1]!.at - runs[0]!.at).toBeGreaterThanOrEqual(1500);
      }
      const attempts = await q<{ attempts: number }>(
        "select distinct attempts from test_executions where task = 'rated'",
      );
      expect(attempts.rows).toEqual([{ attempts: 1 }]);
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }
  }, 180_000);
});
