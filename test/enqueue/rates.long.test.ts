/**
 * The long checks of rate-limited and debounced enqueues (CI runs them with TEST_LONG=1):
 *
 * - `enqueueRate` under 50 concurrent enqueuers on separate connections, single and bulk, some in callers'
 *   transactions that roll back, over several windows: exactly `limit` admitted in the first window, no
 *   window of `period` ever holds more than `limit` of the stamps the database recorded, and every stamp
 *   is a job (nothing of a rolled-back transaction counts).
 * - `debounce` under 20 concurrent enqueuers streaming bursts on a few keys, with a real runner recording
 *   every run on the database's clock: each job answered to an enqueue runs exactly once, with the payload
 *   of the last enqueue collapsed into it, started after every enqueue it answered, and never due later than
 *   `maxWait` after its first enqueue nor `delay` after its last; in trailing and in leading mode.
 */
import type { Job } from "graphile-worker";
import pg from "pg";
import { beforeAll, describe, expect, it } from "vitest";
import { enqueueRateKey, type AddJobResult } from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { startRunner } from "../support/runner.js";
import { recordRateStamps } from "../support/rates.js";
import { useUniqueHarness } from "../support/unique.js";

const h = useUniqueHarness();
const { db, cleanups, client, jobCount } = h;

const NOW_US = "select (extract(epoch from clock_timestamp()) * 1e6)::bigint::text as us";
async function clockOf(c: pg.Client | pg.Pool): Promise<number> {
  const { rows } = await c.query<{ us: string }>(NOW_US);
  return Number(rows[0]!.us);
}

beforeAll(async () => {
  await h.locks.migrate();
  await recordRateStamps(db.pool());
});

describe("enqueueRate under 50 concurrent enqueuers", () => {
  it("admits exactly `limit` in the first window and never more than `limit` in any window", async () => {
    const period = 1000;
    const limit = 5;
    const keys = ["a", "b"];
    const connections = await Promise.all(Array.from({ length: 50 }, () => client()));
    const enqueueRate = { limit, period, key: (p: { k: string }) => p.k };

    // The first window: every enqueuer at once, on one key.
    const first = await Promise.all(
      connections.map((c, i) =>
        h.locks.addJob("burst", { k: "a", i }, { enqueueRate, pgClient: c }),
      ),
    );
    expect(first.filter((r) => r.outcome === "added")).toHaveLength(limit);
    expect(first.filter((r) => r.outcome === "rateLimited")).toHaveLength(50 - limit);

    // Then four seconds of single and bulk enqueues on two keys, a fifth of them in transactions that roll
    // back.
    const deadline = Date.now() + 4000;
    let committedAdds = 0;
    await Promise.all(
      connections.map(async (c, i) => {
        for (let n = 0; Date.now() < deadline; n++) {
          const k = keys[(i + n) % keys.length]!;
          const rollBack = (i + n) % 5 === 0;
          if (rollBack) await c.query("begin");
          let results: AddJobResult[];
          if (n % 3 === 0) {
            results = await h.locks.addJobs(
              [0, 1].map((m) => ({ identifier: "stream", payload: { k, i, n, m }, enqueueRate })),
              { pgClient: c },
            );
          } else {
            results = [await h.locks.addJob("stream", { k, i, n }, { enqueueRate, pgClient: c })];
          }
          if (rollBack) await c.query("rollback");
          else committedAdds += results.filter((r) => r.outcome === "added").length;
        }
      }),
    );
    for (const k of keys) {
      const { rows } = await db
        .pool()
        .query<{ us: string }>(
          "select (extract(epoch from stamp) * 1e6)::bigint::text as us from test_rate_stamps where rate_key = $1 order by stamp",
          [enqueueRateKey("burst", k)],
        );
      const stamps = rows.map((r) => Number(r.us));
      // (stamps of rolled-back transactions were rolled back with them: the log holds committed jobs only)
      for (let i = 0; i + limit < stamps.length; i++) {
        expect(
          stamps[i + limit]! - stamps[i]!,
          `key ${k}, stamps ${i}..${i + limit}`,
        ).toBeGreaterThanOrEqual(period * 1000);
      }
    }
    const { rows } = await db
      .pool()
      .query<{ n: number }>("select count(*)::int as n from test_rate_stamps");
    expect(rows[0]!.n).toBe(limit + committedAdds);
    expect(await jobCount("task_identifier in ('burst', 'stream')")).toBe(limit + committedAdds);
    expect(committedAdds).toBeGreaterThan(limit);
  }, 120_000);
});

interface Enqueue {
  key: string;
  n: number;
  before: number;
  after: number;
  result: AddJobResult;
}
interface Run {
  jobId: string;
  payload: { key: string; n: number };
  runAt: number;
  start: number;
}

/** 20 enqueuers streaming on `keys` for `ms`, with gaps of up to 150 ms; every enqueue recorded. */
async function stream(
  task: string,
  keys: readonly string[],
  ms: number,
  debounce: { delay: number; maxWait: number; leading?: boolean },
): Promise<Enqueue[]> {
  const connections = await Promise.all(Array.from({ length: 20 }, () => client()));
  const enqueues: Enqueue[] = [];
  const deadline = Date.now() + ms;
  let n = 0;
  await Promise.all(
    connections.map(async (c, i) => {
      for (let j = 0; Date.now() < deadline; j++) {
        const key = keys[(i + j) % keys.length]!;
        const mine = n++;
        const before = await clockOf(c);
        const result = await h.locks.addJob(
          task,
          { key, n: mine },
          { debounce: { ...debounce, key: (p: { key: string }) => p.key }, pgClient: c },
        );
        const after = await clockOf(c);
        enqueues.push({ key, n: mine, before, after, result });
        await new Promise((resolve) => setTimeout(resolve, ((i * 37 + j * 53) % 150) + 1));
      }
    }),
  );
  return enqueues;
}

/** Runs of `task` recorded by a real runner, with the job's run_at and its start on the database's clock. */
async function recordRuns(task: string): Promise<Run[]> {
  const runs: Run[] = [];
  const runner = await startRunner({
    connectionString: db.url,
    concurrency: 4,
    taskList: {
      [task]: async (payload, helpers) => {
        const { rows } = await helpers.query<{ us: string }>(NOW_US);
        runs.push({
          jobId: helpers.job.id,
          payload: payload as Run["payload"],
          runAt: new Date((helpers.job as Job).run_at).getTime() * 1000,
          start: Number(rows[0]!.us),
        });
      },
    },
  });
  cleanups.push(() => runner.stop());
  return runs;
}

/** The properties of a debounce, checked on what the enqueuers and the runner recorded. */
function checkDebounce(
  enqueues: Enqueue[],
  runs: Run[],
  debounce: { delay: number; maxWait: number; leading?: boolean },
): void {
  const byJob = new Map<string, Enqueue[]>();
  for (const e of enqueues) {
    expect(["added", "debounced"]).toContain(e.result.outcome);
    const list = byJob.get(e.result.job!.id) ?? [];
    list.push(e);
    byJob.set(e.result.job!.id, list);
  }
  expect(enqueues.some((e) => e.result.outcome === "debounced")).toBe(true);
  // Exactly one run per job answered, and no other run.
  expect(runs.map((r) => r.jobId).sort()).toEqual([...byJob.keys()].sort());
  expect(new Set(runs.map((r) => r.jobId)).size).toBe(runs.length);
  const ms = 1000;
  for (const run of runs) {
    const answered = byJob.get(run.jobId)!;
    const added = answered.filter((e) => e.result.outcome === "added");
    expect(added, `job ${run.jobId}: one enqueue added it`).toHaveLength(1);
    // The payload is the last collapsed enqueue's (the highest revision it was answered with).
    const last = answered.reduce((a, b) =>
      Number(b.result.job!.revision) > Number(a.result.job!.revision) ? b : a,
    );
    expect(run.payload, `job ${run.jobId}`).toEqual({ key: last.key, n: last.n });
    // Started after every enqueue it answered was made, and not before it was due.
    for (const e of answered) expect(run.start, `job ${run.jobId}`).toBeGreaterThan(e.before);
    expect(run.start).toBeGreaterThanOrEqual(run.runAt);
    // Never due later than maxWait after its first enqueue, nor later than delay after its last.
    expect(run.runAt, `job ${run.jobId}: maxWait`).toBeLessThanOrEqual(
      added[0]!.after + debounce.maxWait * ms,
    );
    expect(run.runAt, `job ${run.jobId}: delay`).toBeLessThanOrEqual(
      Math.max(...answered.map((e) => e.after)) + debounce.delay * ms,
    );
  }
}

describe("debounce under 20 concurrent enqueuers, with a real runner", () => {
  for (const leading of [false, true]) {
    it(`runs each burst exactly once, never past maxWait (${leading ? "leading" : "trailing"})`, async () => {
      const task = leading ? "debounce_leading" : "debounce_trailing";
      const debounce = { delay: 300, maxWait: 1000, leading };
      const runs = await recordRuns(task);
      const enqueues = await stream(task, ["x", "y", "z"], 6000, debounce);
      await waitFor(async () => (await jobCount(`task_identifier = '${task}'`)) === 0, {
        message: "every debounced job to run",
        timeoutMs: 60_000,
      });
      checkDebounce(enqueues, runs, debounce);
      // The stream never lets a key go quiet for long: some run was due before `delay` after its last
      // enqueue, so at its burst's cap (first + maxWait).
      const capped = runs.filter((run) => {
        const answered = enqueues.filter((e) => e.result.job!.id === run.jobId);
        return run.runAt < Math.max(...answered.map((e) => e.before)) + debounce.delay * 1000;
      });
      expect(capped.length).toBeGreaterThan(0);
    }, 120_000);
  }
});
