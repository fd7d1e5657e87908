/**
 * Section "limits": what several limits per job (`limits`) cost. In one process, a real graphile-worker
 * runner (concurrency 8, no lock-ahead):
 * - no contention: no-op jobs of distinct keys, with no lock (graphile-worker alone: what one lock statement
 *   per job costs is the next row less this one), 1 limit (a plain exclusive task), 1 limit in a group
 *   (what the group of the further limits costs by itself), 2 and 3 limits:
 *   jobs/s, lock statements per job (the lock session's count) and PostgreSQL's CPU per job (cpu.ts). The
 *   variants alternate, BENCH_ROUNDS rounds, medians.
 * - contended: `reschedule` jobs of 20 ms over 8 tenants with two limits (1 per tenant, a cap of 4 in all,
 *   a group), against the ideal makespan (jobs × 20 ms / 4); hand-off is the gap from the end that freed a
 *   cap slot to the next start while jobs waited.
 * BENCH_LIMITS=contended (or uncontended) runs one part alone, for an A/B of the other.
 */
import type { Runner } from "graphile-worker";
import type { ExclusiveOptions, Locks } from "../src/index.js";
import { processSched } from "./cpu.js";
import { library, timingProbe } from "./library.js";
import { fmtFixed, fmtInt, goal, machineClock as clock, median, sleep } from "./lib.js";
import { percentile, quietLogger, resetJobs, sizedSection, startRunner, table } from "./lib.js";
import { waitUntilNoJobs, type BenchContext, type Goal, type Table } from "./lib.js";
import { resetServerStats, serverStatsTables } from "./server-stats.js";
import {
  NOOP_CONCURRENCY as CONCURRENCY,
  noopRun,
  type NoopPayload,
  type NoopRun,
} from "./noop-run.js";

const TASK_MS = 20;
const CAP = 4;
const TENANTS = 8;
const SIZES = {
  full: { jobs: 3000, contended: 800 },
  quick: { jobs: 300, contended: 160 },
};

type Payload = NoopPayload;

/** The parts BENCH_LIMITS names (default both). */
const PARTS = (process.env.BENCH_LIMITS ?? "uncontended,contended").split(",");

const byJob = (p: Payload) => p.i;
/**
 * `reference`: a row for reading the others, without a goal of its own. `options: null`: a plain
 * graphile-worker task, no lock (what one lock statement per job costs is the plain exclusive row less it).
 */
const VARIANTS: Array<{
  label: string;
  options: ExclusiveOptions<Payload> | null;
  reference?: boolean;
}> = [
  { label: "no lock (graphile-worker alone)", options: null, reference: true },
  { label: "1 limit (plain exclusive)", options: { key: byJob } },
  // (the second and third limits have groups: this row is what a group costs a single limit)
  { label: "1 limit, in a group", options: { key: byJob, lockGroup: "first" }, reference: true },
  {
    label: "2 limits",
    options: { limits: [{ key: byJob }, { key: byJob, group: "second" }] },
  },
  {
    label: "3 limits",
    options: {
      limits: [{ key: byJob }, { key: byJob, group: "second" }, { key: byJob, group: "third" }],
    },
  },
];

/**
 * The contended run: executions recorded on this process's clock, and where the time between them goes.
 * Every job is followed by its place in the enqueue (`i`, which its copies keep when it parks): when the
 * worker got it (each fetch), when it parked (`job:rescheduled`), and when its task started and ended.
 */
async function contended(ctx: BenchContext, jobs: number) {
  const locks: Locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  const runs: Array<{ start: number; end: number; i: number }> = [];
  const fetches: number[][] = Array.from({ length: jobs }, () => []);
  let parks = 0;
  locks.events.on("job:rescheduled", () => parks++);
  // The lock session's statements: how long a lock request waited to be sent, and its round trip.
  const lockWaits: number[] = [];
  const lockTrips: number[] = [];
  timingProbe?.setTimingProbe({
    lock(queuedAt, sentAt, answeredAt) {
      lockWaits.push(sentAt - queuedAt);
      lockTrips.push(answeredAt - sentAt);
    },
    unlock() {},
  });
  let runner: Runner | undefined;
  try {
    type P = { t: number; i: number };
    const task = locks.exclusive(
      "limits_contended",
      async (payload: P) => {
        const start = clock();
        await new Promise((resolve) => setTimeout(resolve, TASK_MS));
        runs.push({ start, end: clock(), i: payload.i });
      },
      {
        onConflict: "reschedule",
        limits: [{ key: (p: P) => p.t }, { key: () => "cap", limit: CAP, group: "bench-cap" }],
      },
    );
    await locks.connect();
    runner = await startRunner({
      connectionString: ctx.url,
      concurrency: CONCURRENCY,
      taskList: {
        limits_contended: (payload, helpers) => {
          fetches[(payload as P).i]?.push(clock());
          return task(payload, helpers);
        },
      },
      pollInterval: 2000,
    });
    locks.attach(runner);
    await resetJobs(ctx.pool);
    await resetServerStats(ctx.pool);
    const schedBefore = processSched(locks.status().pid);
    const started = clock();
    await locks.addJobs(
      Array.from({ length: jobs }, (_, i) => ({
        identifier: "limits_contended",
        payload: { t: i % TENANTS, i },
      })),
    );
    // (the executions are counted here first: a count of the jobs table every few ms would load the server
    // whose hand-offs the run measures)
    const deadline = clock() + 300_000;
    while (runs.length < jobs && clock() < deadline) await sleep(50);
    const schedAfter = processSched(locks.status().pid);
    await waitUntilNoJobs(ctx.pool, 300_000);
    const serverStats = await serverStatsTables(ctx.pool, "the contended run", jobs);
    const lastEnd = Math.max(...runs.map((r) => r.end));
    const makespan = lastEnd - started;
    // Hand-off: for each start after the first CAP, the gap since the latest end before it, split at the
    // starting job's last fetch before its start: end → fetch (unlock, wake, graphile-worker's fetch) and
    // fetch → start (the lock statement). A fetch before that end counts as 0 for the first part.
    const ends = runs.map((r) => r.end).sort((a, b) => a - b);
    const gaps: number[] = [];
    const toFetch: number[] = [];
    const toStart: number[] = [];
    for (const r of [...runs].sort((a, b) => a.start - b.start).slice(CAP)) {
      let latest = -Infinity;
      for (const e of ends) {
        if (e > r.start) break;
        latest = e;
      }
      if (latest === -Infinity) continue;
      gaps.push(r.start - latest);
      const fetched = Math.max(...fetches[r.i]!.filter((f) => f <= r.start));
      toFetch.push(Math.max(0, fetched - latest));
      toStart.push(r.start - Math.max(fetched, latest));
    }
    // The cap's idle time: from the enqueue to the last end, how long fewer than CAP jobs ran, and the
    // longest such stretch.
    const marks = runs
      .flatMap((r) => [
        { at: r.start, d: 1 },
        { at: r.end, d: -1 },
      ])
      .sort((a, b) => a.at - b.at || a.d - b.d);
    let running = 0;
    let since = started;
    let underCapMs = 0;
    let longestUnderCapMs = 0;
    for (const m of marks) {
      if (running < CAP) {
        underCapMs += m.at - since;
        longestUnderCapMs = Math.max(longestUnderCapMs, m.at - since);
      }
      running += m.d;
      since = m.at;
    }
    const fetchCounts = fetches.map((f) => f.length);
    return {
      executions: runs.length,
      makespanMs: makespan,
      idealMs: (jobs * TASK_MS) / CAP,
      handoffP50Ms: percentile(gaps, 50),
      handoffP90Ms: percentile(gaps, 90),
      endToFetchP50Ms: percentile(toFetch, 50),
      fetchToStartP50Ms: percentile(toStart, 50),
      fetchesPerJob: fetchCounts.reduce((a, b) => a + b, 0) / jobs,
      parksPerJob: parks / jobs,
      jobsNeverParked: fetchCounts.filter((n) => n === 1).length / jobs,
      firstStartMs: Math.min(...runs.map((r) => r.start)) - started,
      runP50Ms: percentile(
        runs.map((r) => r.end - r.start),
        50,
      ),
      underCapShare: underCapMs / makespan,
      longestUnderCapMs,
      lockWaitP50Ms: percentile(lockWaits, 50),
      // The lock session's backend over the run, per job: its CPU, and its wait for a core.
      lockBackendUsPerJob:
        schedBefore && schedAfter ? ((schedAfter.runMs - schedBefore.runMs) * 1000) / jobs : null,
      lockBackendWaitUsPerJob:
        schedBefore && schedAfter ? ((schedAfter.waitMs - schedBefore.waitMs) * 1000) / jobs : null,
      lockTripP50Ms: percentile(lockTrips, 50),
      serverStats,
    };
  } finally {
    timingProbe?.setTimingProbe(null);
    await runner?.stop();
    await locks.release();
    await resetJobs(ctx.pool);
  }
}

export const limits = sizedSection(
  { id: "limits", title: "Several limits per job", sizes: SIZES, rounds: 3 },
  async (ctx, size, rounds) => {
    const goals: Goal[] = [];
    const tables: Table[] = [];
    const figures: Record<string, unknown> = {};
    if (PARTS.includes("uncontended")) {
      const { table: t, goals: g, results } = await uncontended(ctx, size.jobs, rounds);
      tables.push(t);
      goals.push(...g);
      figures.uncontended = { variants: VARIANTS.map((v) => v.label), results };
    }
    if (PARTS.includes("contended")) {
      ctx.log("limits: contended");
      const c = await contended(ctx, size.contended);
      const ratio = c.makespanMs / c.idealMs;
      // The floor: each of the CAP slots runs jobs / CAP jobs one after another, each its run (as long as
      // runs took) and at least one lock statement's round trip before it (the unlock that frees the slot and
      // the next job's lock ride in one statement), after the first start.
      const floor =
        (c.firstStartMs + (size.contended / CAP) * (c.runP50Ms + c.lockTripP50Ms)) / c.idealMs;
      goals.push(
        goal(
          "limits: contended makespan vs ideal",
          `≤ 1.25× (floor this run ${fmtFixed(floor, 2)})`,
          ratio,
          ratio <= 1.25,
        ),
        goal("limits: contended hand-off p50", "< 5 ms", c.handoffP50Ms, c.handoffP50Ms < 5),
      );
      const us = (v: number | null) => (v === null ? "–" : fmtInt(v));
      tables.push(
        table(
          `Several limits, contended (${size.contended} reschedule jobs of ${TASK_MS} ms, ${TENANTS} tenants, 1 per tenant and ${CAP} in all)`,
          "makespan ms | ideal ms | ratio | floor | hand-off p50 ms | hand-off p90 ms",
          [
            [
              fmtInt(c.makespanMs),
              fmtInt(c.idealMs),
              fmtFixed(ratio, 2),
              fmtFixed(floor, 2),
              fmtFixed(c.handoffP50Ms, 1),
              fmtFixed(c.handoffP90Ms, 1),
            ],
          ],
          [
            "floor: the first start, then each slot's jobs one after another, each a run (p50) after one lock statement's round trip (p50), over the ideal.",
          ],
        ),
        table(
          "Where the contended run's time goes (per job, and each hand-off split at the starting job's fetch)",
          "fetches/job | parks/job | jobs run at first fetch | end → fetch p50 ms | fetch → start p50 ms | lock request queued p50 ms | lock statement round trip p50 ms | lock backend CPU µs/job | its wait for a core µs/job | under the cap | longest under the cap ms | first start ms | a run p50 ms",
          [
            [
              fmtFixed(c.fetchesPerJob, 2),
              fmtFixed(c.parksPerJob, 2),
              `${fmtInt(c.jobsNeverParked * 100)} %`,
              fmtFixed(c.endToFetchP50Ms, 1),
              fmtFixed(c.fetchToStartP50Ms, 1),
              fmtFixed(c.lockWaitP50Ms, 1),
              fmtFixed(c.lockTripP50Ms, 1),
              us(c.lockBackendUsPerJob),
              us(c.lockBackendWaitUsPerJob),
              `${fmtInt(c.underCapShare * 100)} %`,
              fmtInt(c.longestUnderCapMs),
              fmtInt(c.firstStartMs),
              fmtFixed(c.runP50Ms, 1),
            ],
          ],
          [
            "lock backend: the lock session's server process over the run (its schedstat; embedded or local server only), per job.",
          ],
        ),
      );
      tables.push(...c.serverStats);
      figures.contended = { ...c, serverStats: undefined, floor };
    }
    return { tables, goals, figures };
  },
);

/** The uncontended rows: a warm-up of each variant, then `rounds` rounds alternating them; medians. */
async function uncontended(ctx: BenchContext, jobs: number, rounds: number) {
  const results = VARIANTS.map(() => [] as NoopRun[]);
  for (const v of VARIANTS) await noopRun(ctx, "limits_bench", v.options, Math.min(300, jobs));
  for (let r = 0; r < rounds; r++) {
    for (let i = 0; i < VARIANTS.length; i++) {
      ctx.log(`limits: ${VARIANTS[i]!.label}, round ${r + 1}/${rounds}`);
      results[i]!.push(await noopRun(ctx, "limits_bench", VARIANTS[i]!.options, jobs));
    }
  }
  const med = results.map((rs) => ({
    jobsPerSecond: median(rs.map((x) => x.jobsPerSecond)),
    statementsPerJob: median(rs.map((x) => x.statementsPerJob)),
    serverCpuUsPerJob: median(rs.map((x) => x.serverCpuUsPerJob)),
  }));
  const base = med[1]!;
  // One lock statement's share of PostgreSQL's CPU per job: the plain exclusive job's less a plain one's.
  const lockCpu = base.serverCpuUsPerJob - med[0]!.serverCpuUsPerJob;
  const goals: Goal[] = [];
  for (let i = 2; i < med.length; i++) {
    if (VARIANTS[i]!.reference) continue;
    goals.push(
      goal(
        `limits: ${VARIANTS[i]!.label}, lock statements per job vs 1 limit`,
        "no more (no extra round trip)",
        med[i]!.statementsPerJob,
        med[i]!.statementsPerJob <= base.statementsPerJob * 1.05,
      ),
    );
    const further = VARIANTS[i]!.options!.limits!.length - 1;
    const added = (med[i]!.serverCpuUsPerJob - base.serverCpuUsPerJob) / further;
    goals.push(
      goal(
        `limits: ${VARIANTS[i]!.label}, PostgreSQL CPU per further limit ÷ one lock statement's (${fmtInt(lockCpu)} µs)`,
        "≤ 1",
        added / lockCpu,
        added <= lockCpu,
      ),
    );
  }
  return {
    results,
    goals,
    table: table(
      `Several limits per job, no contention (${jobs} no-op jobs of distinct keys, concurrency ${CONCURRENCY}, medians of ${rounds} alternating rounds)`,
      "variant | jobs/s | lock statements/job | PostgreSQL CPU µs/job",
      VARIANTS.map((v, i) => [
        v.label,
        fmtInt(med[i]!.jobsPerSecond),
        fmtFixed(med[i]!.statementsPerJob, 2),
        fmtInt(med[i]!.serverCpuUsPerJob),
      ]),
      [
        "PostgreSQL CPU is every server process's, over the run (cpu.ts): the lock statements' share of it is what a limit adds.",
        "One lock statement's share: the plain exclusive row less the no-lock row.",
      ],
    ),
  };
}
