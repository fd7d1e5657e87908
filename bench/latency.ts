/**
 * Section "latency": I/O-bound tasks, where what a user feels is latency, not CPU (method and variants:
 * bench/README.md). The task waits 1, 5, 20 or 100 ms on a timer; every job has its own key. Variants,
 * alternating within each round (A B C D, then D C B A) after a warm-up: plain graphile-worker, wrapped by
 * `locks.exclusive()`, the que-locks-shaped wrapper, and one empty statement before the task. A: c=10, no
 * local queue; B: c=24, local queue 200, batched completion; each in 1 and 3 worker processes
 * (latency-worker.ts, forked once and kept). BENCH_LATENCY=A1:20,B3:5 runs only those cases
 * (configuration, processes, task ms).
 */
import {
  benchRounds,
  fmtFixed,
  fmtInt,
  goal,
  insertJobs,
  median,
  percentile,
  round,
} from "./lib.js";
import { runWorkers, table, withWorkers, type BenchContext, type Section } from "./lib.js";
import type { WorkerPreset, WorkerProcess } from "./lib.js";
import { LATENCY_TASK, type LatencyReport, type LatencyVariant } from "./latency-worker.js";
import type { StartRequest } from "./latency-worker.js";
import { cpuBetween, cpuSnapshot, type CpuUse } from "./cpu.js";

const ROUNDS = benchRounds(2);
const VARIANTS: LatencyVariant[] = ["plain", "wrapped", "queLocks", "roundTrip"];
const CONFIGS: Array<{ id: string; label: string; concurrency: number; worker: WorkerPreset }> = [
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

const wanted = (process.env.BENCH_LATENCY ?? "")
  .split(",")
  .map((s) => s.trim())
  .filter(Boolean);
const CASES = CONFIGS.flatMap((config) =>
  [1, 3].flatMap((processes) =>
    [1, 5, 20, 100].map((taskMs) => ({
      config,
      processes,
      taskMs,
      name: `${config.id}${processes}:${taskMs}`,
    })),
  ),
).filter((c) => wanted.length === 0 || wanted.includes(c.name));
type Case = (typeof CASES)[number];

/** Jobs for a run of about `seconds` of plain graphile-worker (CPU caps the short tasks). */
const jobsFor = (c: Case, seconds: number): number =>
  Math.max(
    30,
    Math.round(
      Math.min((c.processes * c.config.concurrency * 1000) / (c.taskMs + 1), c.processes * 1000) *
        seconds,
    ),
  );

async function measure(
  ctx: BenchContext,
  workers: WorkerProcess[],
  c: Case,
  variant: LatencyVariant,
  jobs: number,
  roundNumber: number,
) {
  await insertJobs(ctx.pool, LATENCY_TASK, jobs);
  const start: StartRequest = {
    type: "start",
    variant,
    taskMs: c.taskMs,
    concurrency: c.config.concurrency,
    worker: c.config.worker,
  };
  const before = cpuSnapshot();
  let cpu: CpuUse | undefined;
  const { reports } = await runWorkers<LatencyReport>(
    workers.slice(0, c.processes),
    ctx.pool,
    start,
    // (before the runners stop, while their pool backends are there to be read)
    { timeoutMs: 120_000, atEnd: async () => void (cpu = cpuBetween(before, cpuSnapshot())) },
  );
  const sum = (f: (r: LatencyReport) => number) => reports.reduce((n, r) => n + f(r), 0);
  if (sum((r) => r.failed + r.conflicts) > 0 || sum((r) => r.completed) !== jobs) {
    throw new Error(
      `${c.name}/${variant}: ${sum((r) => r.completed)} of ${jobs} jobs succeeded, ${sum((r) => r.failed + r.conflicts)} failed or conflicted`,
    );
  }
  const first = Math.min(...reports.flatMap((r) => r.firstStart ?? []));
  const spanMs = Math.max(...reports.flatMap((r) => r.lastSuccess ?? [])) - first;
  const lockStatementsPerJob = round(sum((r) => r.lockStatements) / jobs, 3);
  return {
    case: c.name,
    variant,
    round: roundNumber,
    jobs,
    spanMs: round(spanMs, 1),
    jobsPerSecond: Math.round((jobs * 1000) / spanMs),
    lockStatementsPerJob,
    /** CPU per job, µs. */
    cpuPerJob: Object.fromEntries(
      Object.entries(cpu!).map(([k, ms]) => [k, Math.round((ms * 1000) / jobs)]),
    ) as Record<keyof CpuUse, number>,
    reports,
  };
}
type LatencyRun = Awaited<ReturnType<typeof measure>>;

function summarise(c: Case, runs: LatencyRun[]) {
  const of = (v: LatencyVariant) => runs.filter((r) => r.round > 0 && r.variant === v);
  const samples = (v: LatencyVariant, pick: (r: LatencyReport) => number[]) =>
    of(v).flatMap((run) => run.reports.flatMap(pick));
  const ratio = (v: LatencyVariant) =>
    round(
      median(
        of(v).map(
          (run) =>
            run.jobsPerSecond / of("plain").find((p) => p.round === run.round)!.jobsPerSecond,
        ),
      ),
      3,
    );
  const at = (values: number[], p: number, digits = 3) =>
    round(percentile(values, p, true), digits);
  const pp = (values: number[]) => ({ p50: at(values, 50), p99: at(values, 99) });
  const wrapped = (pick: (r: LatencyReport) => number[]) => pp(samples("wrapped", pick));
  /** p50 of `pick` per variant, in ms to 2 decimals. */
  const p50s = <V extends LatencyVariant>(variants: V[], pick: (r: LatencyReport) => number[]) =>
    Object.fromEntries(variants.map((v) => [v, at(samples(v, pick), 50, 2)])) as Record<V, number>;
  return {
    case: c.name,
    config: c.config.id,
    taskMs: c.taskMs,
    wrappedRatio: ratio("wrapped"),
    queLocksRatio: ratio("queLocks"),
    /** One empty statement before each job, no lock, against plain. */
    roundTripRatio: ratio("roundTrip"),
    plainJobsPerSecond: median(of("plain").map((r) => r.jobsPerSecond)),
    added: wrapped((r) => r.beforeBody),
    queLocksAdded: pp(samples("queLocks", (r) => r.beforeBody)),
    lockWait: wrapped((r) => r.lockWait),
    lockRoundTrip: wrapped((r) => r.lockRoundTrip),
    release: wrapped((r) => r.release),
    floor: wrapped((r) => r.floor),
    floorAtStart: wrapped((r) => r.floorAtStart),
    startToSuccessP50: p50s(["plain", "wrapped"], (r) => r.startToSuccess),
    /** A worker's job:success to its next job:start. */
    nextStartP50: p50s(VARIANTS, (r) => r.nextStart),
    /** Per variant, µs per job (median of the measured rounds): see cpu.ts. */
    cpuPerJob: Object.fromEntries(
      VARIANTS.map((v) => {
        const perJob = (k: keyof CpuUse) =>
          Math.round(median(of(v).map((run) => run.cpuPerJob[k])));
        return [
          v,
          {
            server: perJob("serverMs"),
            worker: perJob("workerMs"),
            waiting: perJob("serverWaitMs") + perJob("workerWaitMs"),
          },
        ];
      }),
    ) as Record<LatencyVariant, { server: number; worker: number; waiting: number }>,
    lockStatementsPerJob: median(of("wrapped").map((r) => r.lockStatementsPerJob)),
  };
}

const ms = (value: number): string => fmtFixed(value, 2);
const pair = ({ p50, p99 }: { p50: number; p99: number }) => `${ms(p50)} / ${ms(p99)}`;

export const latency: Section = {
  id: "latency",
  title: "latency: I/O-bound tasks, time added per job and throughput lost",
  async run(ctx) {
    const figures: Array<ReturnType<typeof summarise>> = [];
    const runs: unknown[] = [];
    const script = new URL("./latency-worker.ts", import.meta.url);
    await withWorkers(
      script,
      Math.max(...CASES.map((c) => c.processes)),
      { DATABASE_URL: ctx.url },
      async (workers) => {
        for (const c of CASES) {
          const caseRuns: LatencyRun[] = [];
          const jobs = jobsFor(c, ctx.quick ? 0.25 : 1.5);
          for (let r = 0; r <= (ctx.quick ? 1 : ROUNDS); r++) {
            // The warm-up (a quarter of the jobs) in order; then A B C D, D C B A: drift hits every variant alike.
            const order = r % 2 === 1 || r === 0 ? VARIANTS : [...VARIANTS].reverse();
            for (const v of order)
              caseRuns.push(
                await measure(ctx, workers, c, v, r === 0 ? Math.ceil(jobs / 4) : jobs, r),
              );
          }
          const f = summarise(c, caseRuns);
          figures.push(f);
          runs.push(...caseRuns.map(({ reports: _, ...run }) => run));
          ctx.log(
            `latency ${c.name}: wrapped/plain ${fmtFixed(f.wrappedRatio, 3)}, que-locks ${fmtFixed(f.queLocksRatio, 3)}, round trip ${fmtFixed(f.roundTripRatio, 3)}, ` +
              `added p50/p99 ${pair(f.added)} ms, floor p50 ${ms(f.floor.p50)} ms, at start ${ms(f.floorAtStart.p50)} ms`,
          );
        }
      },
    );

    const goals = figures.flatMap((f) => [
      ...(f.config === "A"
        ? [
            ...(["floor", "floor at start"] as const).map((name) => {
              const floor = name === "floor" ? f.floor : f.floorAtStart;
              return goal(
                `${f.case} added p50 − ${name} p50 (ms)`,
                "≤ 0.2",
                f.added.p50 - floor.p50,
                f.added.p50 <= floor.p50 + 0.2,
              );
            }),
            goal(`${f.case} added p99 (ms)`, "< 5", f.added.p99, f.added.p99 < 5),
          ]
        : []),
      ...(RATIO_GOALS[f.taskMs] === undefined
        ? []
        : [
            goal(
              `${f.case} wrapped/plain`,
              `≥ ${RATIO_GOALS[f.taskMs]}`,
              f.wrappedRatio,
              f.wrappedRatio >= RATIO_GOALS[f.taskMs]!,
            ),
          ]),
      goal(
        `${f.case} wrapped/plain − que-locks/plain`,
        "≥ 0 (ahead of que-locks)",
        f.wrappedRatio - f.queLocksRatio,
        f.wrappedRatio >= f.queLocksRatio,
      ),
    ]);
    const summary = table(
      `Latency: I/O-bound tasks, distinct keys (${ROUNDS} rounds; ms as p50 / p99)`,
      "case | plain jobs/s | wrapped/plain | que-locks/plain | round trip/plain | added before body | que-locks added | wait to send | lock round trip | release | floor | floor at start | start→success p50 plain/wrapped | success→next start p50 plain/wrapped/que-locks/round trip | stmts/job",
      figures.map((f) => [
        f.case,
        fmtInt(f.plainJobsPerSecond),
        fmtFixed(f.wrappedRatio, 3),
        fmtFixed(f.queLocksRatio, 3),
        fmtFixed(f.roundTripRatio, 3),
        ...[
          f.added,
          f.queLocksAdded,
          f.lockWait,
          f.lockRoundTrip,
          f.release,
          f.floor,
          f.floorAtStart,
        ].map(pair),
        `${ms(f.startToSuccessP50.plain)} / ${ms(f.startToSuccessP50.wrapped)}`,
        VARIANTS.map((v) => ms(f.nextStartP50[v])).join(" / "),
        fmtFixed(f.lockStatementsPerJob, 2),
      ]),
      [
        "case: configuration (A: c=10, no local queue; B: c=24, localQueue 200, batched completion, attach), processes, task ms.",
        "round trip/plain: one empty statement on a connection of the process's own before each job, no lock: the floor of a lock taken before the task.",
        "added before body: graphile-worker's job:start to the task body's first line, wrapped (plain's is a few µs).",
        "wait to send / lock round trip: a lock request until its statement leaves, then until it is answered.",
        "release: an unlock request until its answer (no job waits for it).",
        "floor: an empty statement's round trip, same process, same runs, every 5 ms; at start: sent at a job's start, as the lock is.",
        "success→next start: a worker's job:success to its next job:start (graphile-worker's completion and next fetch; que-locks' unlock comes before).",
      ],
    );
    const cpu = table(
      "Latency: CPU per job, µs (PostgreSQL's processes / the worker processes' main threads / time both waited for a core)",
      "case | plain | wrapped | que-locks | round trip | wrapped − plain | round trip − plain",
      figures.map((f) => {
        const c = f.cpuPerJob;
        const use = (v: LatencyVariant) => `${c[v].server} / ${c[v].worker} / ${c[v].waiting}`;
        const minus = (v: LatencyVariant) =>
          [
            c[v].server - c.plain.server,
            c[v].worker - c.plain.worker,
            c[v].waiting - c.plain.waiting,
          ]
            .map((n) => (n > 0 ? `+${n}` : String(n)))
            .join(" / ");
        return [f.case, ...VARIANTS.map(use), minus("wrapped"), minus("roundTrip")];
      }),
      [
        "From Linux's per-thread schedstat, two snapshots a run, divided by the run's jobs; medians of the measured rounds. The server's figure includes the bench's own statements (the floor's, the count of jobs left), alike in every variant.",
      ],
    );
    return { tables: [summary, cpu], goals, figures: { cases: figures, runs } };
  },
};
