/**
 * The latency section: I/O-bound tasks, where what a user feels is latency, not CPU. The task waits 1, 5,
 * 20 or 100 ms on a timer (as an HTTP call would); every job has its own key, so none conflicts. Variants,
 * alternating within each round after a warm-up: plain graphile-worker, the task wrapped by
 * `locks.exclusive()` (`drop`, `locks.attach` on the runner), and the que-locks-shaped wrapper (a pool
 * connection per running job: try-lock, task, unlock), and one empty statement before the task on a
 * connection of the process's own (no lock: the cost of one round trip per job, the floor of any lock taken
 * before the task). Configurations: A, concurrency 10 without the local
 * queue; B, concurrency 24 with a local queue of 200 and batched completion; each in 1 and 3 worker
 * processes (bench/latency-worker.ts, forked once and kept).
 *
 * Figures: throughput over the run's span (first `job:start` to last `job:success`, across processes) as a
 * ratio to plain's in the same round; the time added before the task's body (from `job:start`), p50 and
 * p99; its parts from the lock session's probe (waiting to send the lock statement, its round trip) and the
 * release (unlock request to answer, which no job waits for); and the floor, the round trip of an empty
 * statement on a connection of the same process during the same runs.
 *
 * BENCH_LATENCY=A1:20,B3:5 runs only those configurations (config, processes, task ms).
 */
import {
  benchRounds,
  fmtFixed,
  fmtInt,
  forkWorkers,
  insertJobs,
  median,
  resetJobs,
  round,
  waitUntilNoJobs,
  type BenchContext,
  type Goal,
  type Section,
  type SectionResult,
  type Table,
  type WorkerProcess,
} from "./lib.js";
import {
  LATENCY_TASK,
  type LatencyReport,
  type LatencyVariant,
  type StartRequest,
} from "./latency-worker.js";
import type { WorkerPreset } from "./lib.js";

const ROUNDS = benchRounds(2);
const TASK_MS = [1, 5, 20, 100];
const PROCESSES = [1, 3];
const VARIANTS: LatencyVariant[] = ["plain", "wrapped", "queLocks", "roundTrip"];

interface LatencyConfig {
  id: "A" | "B";
  label: string;
  concurrency: number;
  worker: WorkerPreset;
}

const CONFIGS: LatencyConfig[] = [
  { id: "A", label: "c=10, no local queue", concurrency: 10, worker: {} },
  {
    id: "B",
    label: "c=24, localQueue 200, batched completion",
    concurrency: 24,
    worker: { localQueue: { size: 200 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 },
  },
];

/** The goals for wrapped/plain, by task duration. */
const RATIO_GOALS: Record<number, number> = { 5: 0.93, 20: 0.97 };

interface Case {
  config: LatencyConfig;
  processes: number;
  taskMs: number;
  name: string;
}

function cases(): Case[] {
  const wanted = (process.env.BENCH_LATENCY ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  const all = CONFIGS.flatMap((config) =>
    PROCESSES.flatMap((processes) =>
      TASK_MS.map((taskMs) => ({
        config,
        processes,
        taskMs,
        name: `${config.id}${processes}:${taskMs}`,
      })),
    ),
  );
  return wanted.length === 0 ? all : all.filter((c) => wanted.includes(c.name));
}

/** Jobs for a run of about `seconds` of plain graphile-worker (CPU caps the short tasks). */
function jobsFor(c: Case, seconds: number): number {
  const perSecond = Math.min(
    (c.processes * c.config.concurrency * 1000) / (c.taskMs + 1),
    c.processes * 1000,
  );
  return Math.max(30, Math.round(perSecond * seconds));
}

export interface LatencyRun {
  case: string;
  variant: LatencyVariant;
  round: number;
  jobs: number;
  spanMs: number;
  jobsPerSecond: number;
  lockStatementsPerJob: number;
  reports: LatencyReport[];
}

async function measure(
  ctx: BenchContext,
  workers: WorkerProcess[],
  c: Case,
  variant: LatencyVariant,
  jobs: number,
  roundNumber: number,
): Promise<LatencyRun> {
  await resetJobs(ctx.pool);
  await insertJobs(ctx.pool, LATENCY_TASK, jobs);
  const used = workers.slice(0, c.processes);
  const start: StartRequest = {
    type: "start",
    variant,
    taskMs: c.taskMs,
    concurrency: c.config.concurrency,
    worker: c.config.worker,
  };
  await Promise.all(used.map((w) => w.request(start)));
  const failed = Promise.race(used.map((w) => w.failed));
  await Promise.race([waitUntilNoJobs(ctx.pool, 120_000), failed]);
  const reports = await Promise.all(used.map((w) => w.request<LatencyReport>({ type: "stop" })));
  const completed = reports.reduce((n, r) => n + r.completed, 0);
  const failures = reports.reduce((n, r) => n + r.failed + r.conflicts, 0);
  if (failures > 0 || completed !== jobs) {
    throw new Error(
      `${c.name}/${variant}: ${completed} of ${jobs} jobs succeeded, ${failures} failed or conflicted`,
    );
  }
  const first = Math.min(...reports.flatMap((r) => (r.firstStart === null ? [] : [r.firstStart])));
  const last = Math.max(...reports.flatMap((r) => (r.lastSuccess === null ? [] : [r.lastSuccess])));
  const spanMs = last - first;
  return {
    case: c.name,
    variant,
    round: roundNumber,
    jobs,
    spanMs: round(spanMs, 1),
    jobsPerSecond: Math.round((jobs * 1000) / spanMs),
    lockStatementsPerJob: round(reports.reduce((n, r) => n + r.lockStatements, 0) / jobs, 3),
    reports,
  };
}

function percentile(values: number[], p: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = Float64Array.from(values).sort();
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;
}

const ms = (value: number): string => fmtFixed(value, 2);
const pair = (values: number[]): string =>
  `${ms(percentile(values, 50))} / ${ms(percentile(values, 99))}`;

export interface CaseFigures {
  case: string;
  label: string;
  wrappedRatio: number;
  queLocksRatio: number;
  /** One empty statement before each job, no lock, against plain. */
  roundTripRatio: number;
  plainJobsPerSecond: number;
  /** p50 and p99 in ms. */
  added: { p50: number; p99: number };
  queLocksAdded: { p50: number; p99: number };
  lockWait: { p50: number; p99: number };
  lockRoundTrip: { p50: number; p99: number };
  release: { p50: number; p99: number };
  floor: { p50: number; p99: number };
  floorAtStart: { p50: number; p99: number };
  startToSuccessP50: { plain: number; wrapped: number; queLocks: number };
  lockStatementsPerJob: number;
}

function summarize(c: Case, runs: LatencyRun[]): CaseFigures {
  const measured = runs.filter((r) => r.round > 0);
  const of = (v: LatencyVariant) => measured.filter((r) => r.variant === v);
  const samples = (v: LatencyVariant, pick: (r: LatencyReport) => number[]) =>
    of(v).flatMap((run) => run.reports.flatMap(pick));
  const ratio = (v: LatencyVariant) =>
    median(
      of(v).map((run) => {
        const plain = of("plain").find((p) => p.round === run.round)!;
        return run.jobsPerSecond / plain.jobsPerSecond;
      }),
    );
  const pp = (values: number[]) => ({
    p50: round(percentile(values, 50), 3),
    p99: round(percentile(values, 99), 3),
  });
  return {
    case: c.name,
    label: `${c.config.id}${c.processes}: ${c.config.label}, ${c.processes} process${c.processes > 1 ? "es" : ""}, ${c.taskMs} ms task`,
    wrappedRatio: round(ratio("wrapped"), 3),
    queLocksRatio: round(ratio("queLocks"), 3),
    roundTripRatio: round(ratio("roundTrip"), 3),
    plainJobsPerSecond: median(of("plain").map((r) => r.jobsPerSecond)),
    added: pp(samples("wrapped", (r) => r.beforeBody)),
    queLocksAdded: pp(samples("queLocks", (r) => r.beforeBody)),
    lockWait: pp(samples("wrapped", (r) => r.lockWait)),
    lockRoundTrip: pp(samples("wrapped", (r) => r.lockRoundTrip)),
    release: pp(samples("wrapped", (r) => r.release)),
    floor: pp(samples("wrapped", (r) => r.floor)),
    floorAtStart: pp(samples("wrapped", (r) => r.floorAtStart)),
    startToSuccessP50: {
      plain: round(
        percentile(
          samples("plain", (r) => r.startToSuccess),
          50,
        ),
        2,
      ),
      wrapped: round(
        percentile(
          samples("wrapped", (r) => r.startToSuccess),
          50,
        ),
        2,
      ),
      queLocks: round(
        percentile(
          samples("queLocks", (r) => r.startToSuccess),
          50,
        ),
        2,
      ),
    },
    lockStatementsPerJob: median(of("wrapped").map((r) => r.lockStatementsPerJob)),
  };
}

export const latency: Section = {
  id: "latency",
  title: "latency: I/O-bound tasks, time added per job and throughput lost",
  async run(ctx): Promise<SectionResult> {
    const selected = cases();
    const workers = await forkWorkers(
      new URL("./latency-worker.ts", import.meta.url),
      Math.max(...selected.map((c) => c.processes)),
      { DATABASE_URL: ctx.url },
    );
    const runs: LatencyRun[] = [];
    const figures: CaseFigures[] = [];
    try {
      for (const c of selected) {
        const caseRuns: LatencyRun[] = [];
        const jobs = jobsFor(c, ctx.quick ? 0.25 : 1.5);
        for (const variant of VARIANTS)
          caseRuns.push(await measure(ctx, workers, c, variant, Math.ceil(jobs / 4), 0));
        for (let r = 1; r <= (ctx.quick ? 1 : ROUNDS); r++) {
          // A B C, then C B A: drift hits every variant alike.
          const order = r % 2 === 1 ? VARIANTS : [...VARIANTS].reverse();
          for (const variant of order)
            caseRuns.push(await measure(ctx, workers, c, variant, jobs, r));
        }
        runs.push(...caseRuns);
        const f = summarize(c, caseRuns);
        figures.push(f);
        ctx.log(
          `latency ${c.name}: wrapped/plain ${fmtFixed(f.wrappedRatio, 3)}, que-locks ${fmtFixed(f.queLocksRatio, 3)}, round trip ${fmtFixed(f.roundTripRatio, 3)}, ` +
            `added p50/p99 ${ms(f.added.p50)}/${ms(f.added.p99)} ms, floor p50 ${ms(f.floor.p50)} ms, at start ${ms(f.floorAtStart.p50)} ms`,
        );
      }
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }

    const table: Table = {
      title: `Latency: I/O-bound tasks, distinct keys (${ROUNDS} rounds; ms as p50 / p99)`,
      columns: [
        { header: "case", align: "left" },
        { header: "plain jobs/s" },
        { header: "wrapped/plain" },
        { header: "que-locks/plain" },
        { header: "round trip/plain" },
        { header: "added before body" },
        { header: "que-locks added" },
        { header: "wait to send" },
        { header: "lock round trip" },
        { header: "release" },
        { header: "floor" },
        { header: "floor at start" },
        { header: "start→success p50 plain/wrapped" },
        { header: "stmts/job" },
      ],
      rows: figures.map((f) => [
        f.case,
        fmtInt(f.plainJobsPerSecond),
        fmtFixed(f.wrappedRatio, 3),
        fmtFixed(f.queLocksRatio, 3),
        fmtFixed(f.roundTripRatio, 3),
        `${ms(f.added.p50)} / ${ms(f.added.p99)}`,
        `${ms(f.queLocksAdded.p50)} / ${ms(f.queLocksAdded.p99)}`,
        `${ms(f.lockWait.p50)} / ${ms(f.lockWait.p99)}`,
        `${ms(f.lockRoundTrip.p50)} / ${ms(f.lockRoundTrip.p99)}`,
        `${ms(f.release.p50)} / ${ms(f.release.p99)}`,
        `${ms(f.floor.p50)} / ${ms(f.floor.p99)}`,
        `${ms(f.floorAtStart.p50)} / ${ms(f.floorAtStart.p99)}`,
        `${ms(f.startToSuccessP50.plain)} / ${ms(f.startToSuccessP50.wrapped)}`,
        fmtFixed(f.lockStatementsPerJob, 2),
      ]),
      notes: [
        "case: configuration (A: c=10, no local queue; B: c=24, localQueue 200, batched completion, attach), processes, task ms.",
        "round trip/plain: one empty statement on a connection of the process's own before each job, no lock: the floor of a lock taken before the task.",
        "added before body: graphile-worker's job:start to the task body's first line, wrapped (plain's is a few µs).",
        "wait to send / lock round trip: a lock request until its statement leaves, then until it is answered.",
        "release: an unlock request until its answer (no job waits for it).",
        "floor: an empty statement's round trip, same process, same runs, every 5 ms; at start: sent at a job's start, as the lock is.",
      ],
    };

    const goals: Goal[] = [];
    const section = "latency";
    for (const f of figures) {
      const c = selected.find((s) => s.name === f.case)!;
      if (c.config.id === "A") {
        for (const [name, floor] of [
          ["floor", f.floor],
          ["floor at start", f.floorAtStart],
        ] as const) {
          goals.push({
            section,
            name: `${f.case} added p50 − ${name} p50 (ms)`,
            target: "≤ 0.2",
            value: f.added.p50 - floor.p50,
            threshold: 0.2,
            met: f.added.p50 <= floor.p50 + 0.2,
          });
        }
        goals.push({
          section,
          name: `${f.case} added p99 (ms)`,
          target: "< 5",
          value: f.added.p99,
          threshold: 5,
          met: f.added.p99 < 5,
        });
      }
      const goal = RATIO_GOALS[c.taskMs];
      if (goal !== undefined) {
        goals.push({
          section,
          name: `${f.case} wrapped/plain`,
          target: `≥ ${goal}`,
          value: f.wrappedRatio,
          threshold: goal,
          met: f.wrappedRatio >= goal,
        });
      }
      goals.push({
        section,
        name: `${f.case} wrapped/plain − que-locks/plain`,
        target: "≥ 0 (ahead of que-locks)",
        value: f.wrappedRatio - f.queLocksRatio,
        threshold: 0,
        met: f.wrappedRatio >= f.queLocksRatio,
      });
    }
    return { tables: [table], goals, figures: { cases: figures, runs: stripSamples(runs) } };
  },
};

/** The runs without their per-job samples (kept as percentiles in the cases), for results.full.json. */
function stripSamples(runs: LatencyRun[]): unknown[] {
  return runs.map(({ reports, ...run }) => ({
    ...run,
    processes: reports.map((r) => ({
      completed: r.completed,
      lockStatements: r.lockStatements,
      beforeBody: pair(r.beforeBody),
      floor: pair(r.floor),
      floorAtStart: pair(r.floorAtStart),
    })),
  }));
}
