/**
 * Section "execution overhead": no-op jobs per second, graphile-worker alone ("plain") against the task in
 * `locks.exclusive()` with a distinct key per job ("wrapped") and two naive wrappers (method, variants and
 * configurations: bench/README.md). N jobs are inserted up front; the clock runs from `run()` (or, in the
 * worker processes of A3 and B3, the start signal) to an empty job table. A warm-up of each variant, then
 * rounds alternating the variants, medians. The wrapped runs also give the lock session's cost: connections
 * by role, backend memory, heap, locks left held.
 */
import { readFile } from "node:fs/promises";
import type pg from "pg";
import {
  fmtFixed,
  fmtInt,
  fmtPercent,
  insertJobs,
  median,
  now,
  resetJobs,
  round,
  spread,
  waitUntilNoJobs,
  forkWorkers,
  timeout,
  type BenchContext,
  type WorkerProcess,
  type Goal,
  type Section,
  type SectionResult,
  type Table,
  benchRounds,
} from "./lib.js";
import {
  APPLICATION_PREFIX,
  CONNECTION_ROLES,
  parseApplicationName,
  type ConnectionRole,
  type Progress,
  type ProcessReport,
  type ProcessVariant,
} from "./throughput-worker.js";

export const TASK = "noop";
/** Measured rounds per configuration (BENCH_ROUNDS overrides). */
const ROUNDS = benchRounds(3);

export type WorkerPreset = NonNullable<GraphileConfig.Preset["worker"]>;

export interface Config {
  id: string;
  label: string;
  /** Worker processes (bench/throughput-worker.ts), each with this concurrency and these options. */
  processes: number;
  concurrency: number;
  /** Jobs per measured run (chosen so that a run of the slowest variant takes a few seconds here). */
  jobs: number;
  /** Jobs per measured run of the naive variants (one-process configurations only). */
  naiveJobs?: number;
  /** Jobs per measured run with BENCH_QUICK=1 (every variant). */
  quickJobs: number;
  /** graphile-worker options beyond concurrency, the same for every variant. */
  worker: WorkerPreset;
  /** The issue's goal for wrapped/plain. */
  goal: number;
}

/**
 * B's settings are the best of a sweep for plain graphile-worker (60,000 jobs per run) on
 * the 2-core development machine: localQueue.size 24 / 100 / 250 / 500 / 1000 / 2000 gave about 15k / 28k
 * / 30k / 18k / 24k / 24k jobs/s with completeJobBatchDelay 0; at size 250, delays of 0…10 ms were all
 * within noise (26k–29k), -1 (no batching) 12k; maxPoolSize 26 instead of 10 did not help. Wrapped and
 * naive run with the same settings.
 *
 * Job counts make a measured run take 2 s or more here; naive is slow, so it gets fewer jobs in B.
 */
export const CONFIGS: Config[] = [
  {
    id: "A",
    label: "c=10, no batching",
    processes: 1,
    concurrency: 10,
    jobs: 12_000,
    naiveJobs: 12_000,
    quickJobs: 500,
    worker: {},
    goal: 0.95,
  },
  {
    id: "B",
    label: "c=24, localQueue 250, batched completion",
    processes: 1,
    concurrency: 24,
    jobs: 90_000,
    naiveJobs: 15_000,
    quickJobs: 2_000,
    worker: {
      localQueue: { size: 250 },
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
    },
    goal: 0.9,
  },
];

/** Worker processes of the multi-process configurations. */
const PROCESSES = 3;

/**
 * A3 and B3: A and B in 3 processes, each with A's or B's concurrency and options (so 3 × the workers in
 * all), the same job counts and the same goals, without the naive variants (a one-process comparison).
 */
export const PROCESS_CONFIGS: Config[] = CONFIGS.map(({ naiveJobs: _, ...config }) => ({
  ...config,
  id: `${config.id}${PROCESSES}`,
  label: `${PROCESSES} processes × ${config.label}`,
  processes: PROCESSES,
}));

/** How often pg_stat_activity is sampled during a run. */
const SAMPLE_INTERVAL_MS = 250;

export type VariantId = ProcessVariant;

export type RunFigures = ReturnType<typeof processRunFigures>;

export type ConfigFigures = ReturnType<typeof summarise>;
type VariantFigures = ReturnType<typeof variantFigures>;

// ---------------------------------------------------------------------------------------------------------
// One run in the worker processes

const WORKER_SCRIPT = new URL("./throughput-worker.ts", import.meta.url);

/** Resolves once the workers reported `jobs` completed jobs between them in run `run`. */
function allCompleted(workers: WorkerProcess[], run: number, jobs: number): Promise<void> {
  const completed = new Map<string, number>();
  return new Promise<void>((resolve) => {
    for (const w of workers) {
      w.onEvent = (event, data) => {
        const progress = data as Progress;
        if (event !== "progress" || progress.run !== run) return;
        completed.set(w.name, progress.completed);
        if ([...completed.values()].reduce((sum, n) => sum + n, 0) >= jobs) resolve();
      };
    }
  });
}

let lastRunId = 0;

/**
 * One measured run: insert, start the runners (the clock starts with the start signal), wait until they
 * reported every job completed and the table is empty, sample the connections and the backends' memory,
 * stop the runners. pg_stat_activity is sampled during every run, so that every variant shares that load.
 */
async function measure(
  ctx: BenchContext,
  workers: WorkerProcess[],
  config: Config,
  variant: ProcessVariant,
  jobs: number,
  roundNumber: number,
): Promise<RunFigures> {
  await resetJobs(ctx.pool);
  await insertJobs(ctx.pool, TASK, jobs);

  const runId = ++lastRunId;
  const failed = Promise.race(workers.map((w) => w.failed));
  failed.catch(() => undefined);
  const limit = timeout(
    60_000 + jobs * 5,
    `${config.id}/${variant}: ${jobs} jobs did not complete in time`,
  );
  const completed = allCompleted(workers, runId, jobs);
  const sampling = sampleBackends(ctx.pool, SAMPLE_INTERVAL_MS);
  const t0 = now();
  try {
    const started = workers.map((w) =>
      w.request({
        type: "start",
        run: runId,
        variant,
        taskIdentifier: TASK,
        concurrency: config.concurrency,
        worker: config.worker,
      }),
    );
    await Promise.race([Promise.all(started), failed, limit.promise]);
    await Promise.race([completed, failed, limit.promise]);
    await Promise.race([waitUntilNoJobs(ctx.pool, 30_000), failed, limit.promise]);
    const seconds = (now() - t0) / 1000;
    // With the runners still running: their pools are open, as they were during the run.
    const samples = await sampling.finish();
    const memory = await backendMemory(ctx, samples.at(-1)!);
    const reports = await Promise.all(
      workers.map((w) => w.request<ProcessReport>({ type: "stop" })),
    );
    const executed = reports.reduce((sum, r) => sum + r.completed, 0);
    if (executed !== jobs) {
      ctx.log(`warning: ${config.id}/${variant}: ${executed} job(s) completed, ${jobs} inserted`);
    }
    return processRunFigures(config, variant, roundNumber, jobs, seconds, reports, samples, memory);
  } finally {
    sampling.cancel();
    limit.clear();
    for (const w of workers) w.onEvent = undefined;
  }
}

function processRunFigures(
  config: Config,
  variant: ProcessVariant,
  roundNumber: number,
  jobs: number,
  seconds: number,
  reports: ProcessReport[],
  samples: Backend[][],
  memory: BackendMemory[],
) {
  const sum = (f: (r: ProcessReport) => number) => reports.reduce((total, r) => total + f(r), 0);
  const known = (values: Array<number | null>) => values.filter((v): v is number => v !== null);
  const startups = known(reports.map((r) => r.startupMs));
  const lastCompletes = known(reports.map((r) => r.lastCompleteMs));
  return {
    config: config.id,
    variant,
    round: roundNumber,
    jobs,
    seconds: round(seconds, 3),
    jobsPerSecond: Math.round(jobs / seconds),
    // The first job in any process, from its receiving the start signal.
    startupMs: startups.length > 0 ? Math.round(Math.min(...startups)) : Number.NaN,
    lastCompleteMs: lastCompletes.length > 0 ? Math.round(Math.max(...lastCompletes)) : Number.NaN,
    lockStatements: sum((r) => r.lockStatements),
    conflicts: sum((r) => r.conflicts),
    nodeCpuUsPerJob: round(sum((r) => r.cpuUs) / jobs, 1),
    processes: reports,
    session: {
      samples: samples.length,
      connections: connectionRanges(
        samples,
        reports.map((r) => r.name),
      ),
      memory,
      heldAfterRun: Math.max(...reports.map((r) => r.heldAfterRun)),
    },
  };
}

// ---------------------------------------------------------------------------------------------------------
// Lock session cost: connections and backend memory

/** A connection of the benchmark, told apart by its application_name. */
export interface Backend {
  pid: number;
  processName: string;
  role: ConnectionRole;
}

/** The fewest and the most connections of one kind a process had open, over a run's samples. */
export interface Range {
  min: number;
  max: number;
}

export interface BackendMemory extends Backend {
  /** From /proc/<pid>/status: the resident set, and its anonymous part. */
  vmRssKiB: number;
  /**
   * Includes the pages a backend still shares, copy-on-write, with the postmaster it was forked from (the
   * same in every backend), which is why the table shows USS instead.
   */
  rssAnonKiB: number;
  /**
   * From /proc/<pid>/smaps_rollup: the unique set (Private_Clean + Private_Dirty, what the backend's exit
   * would free: its caches, prepared statements, work memory) and the proportional set (Pss: shared
   * pages, such as shared buffers, divided among the processes that map them).
   */
  ussKiB: number;
  pssKiB: number;
}

/** The benchmark's named connections to its database, now. */
async function namedBackends(pool: pg.Pool): Promise<Backend[]> {
  const { rows } = await pool.query<{ pid: number; application_name: string }>(
    `select pid, application_name from pg_stat_activity
      where datname = current_database() and application_name like $1`,
    [`${APPLICATION_PREFIX}/%`],
  );
  return rows.flatMap((row) => {
    const parsed = parseApplicationName(row.application_name);
    return parsed ? [{ pid: row.pid, ...parsed }] : [];
  });
}

/**
 * Samples the named connections every `intervalMs` until `finish()`, which takes one more sample and
 * resolves them all; `cancel()` only stops the loop (on errors).
 */
function sampleBackends(
  pool: pg.Pool,
  intervalMs: number,
): { finish(): Promise<Backend[][]>; cancel(): void } {
  const samples: Backend[][] = [];
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  let wake: (() => void) | undefined;
  const loop = (async () => {
    for (;;) {
      await new Promise<void>((resolve) => {
        wake = resolve;
        timer = setTimeout(resolve, intervalMs);
      });
      if (stopped) return;
      samples.push(await namedBackends(pool));
    }
  })();
  loop.catch(() => undefined);
  const cancel = () => {
    stopped = true;
    clearTimeout(timer);
    wake?.();
  };
  return {
    async finish() {
      cancel();
      await loop;
      samples.push(await namedBackends(pool));
      return samples;
    },
    cancel,
  };
}

function connectionRanges(
  samples: Backend[][],
  processNames: string[],
): Record<string, Record<ConnectionRole, Range>> {
  const range = (processName: string, role: ConnectionRole): Range => {
    const counts = samples.map(
      (sample) => sample.filter((b) => b.processName === processName && b.role === role).length,
    );
    return { min: Math.min(...counts), max: Math.max(...counts) };
  };
  return Object.fromEntries(
    processNames.map((name) => [
      name,
      Object.fromEntries(CONNECTION_ROLES.map((role) => [role, range(name, role)])) as Record<
        ConnectionRole,
        Range
      >,
    ]),
  );
}

/** A backend's memory from /proc; null if `pid` is not a PostgreSQL process of this machine. */
async function readBackendMemory(backend: Backend): Promise<BackendMemory | null> {
  try {
    const [comm, status, rollup] = await Promise.all(
      ["comm", "status", "smaps_rollup"].map((file) =>
        readFile(`/proc/${backend.pid}/${file}`, "utf8"),
      ),
    );
    if (!comm!.startsWith("postgres")) return null;
    const kib = (text: string, field: string) =>
      Number(new RegExp(`^${field}:\\s+(\\d+) kB$`, "m").exec(text)?.[1] ?? Number.NaN);
    return {
      ...backend,
      vmRssKiB: kib(status!, "VmRSS"),
      rssAnonKiB: kib(status!, "RssAnon"),
      ussKiB: kib(rollup!, "Private_Clean") + kib(rollup!, "Private_Dirty"),
      pssKiB: kib(rollup!, "Pss"),
    };
  } catch {
    return null;
  }
}

/**
 * The memory of the lock sessions' and graphile-worker's backends among `sample`, read from /proc: only
 * when the server is the embedded one, which runs on this machine (a pid of another host means nothing).
 */
async function backendMemory(ctx: BenchContext, sample: Backend[]): Promise<BackendMemory[]> {
  if (ctx.postgresServer !== "embedded") return [];
  const read = await Promise.all(
    sample.filter((b) => b.role !== "locks-pool").map(readBackendMemory),
  );
  return read.filter((m): m is BackendMemory => m !== null);
}

// ---------------------------------------------------------------------------------------------------------
// The section

/**
 * One warm-up run of each variant (a quarter of the jobs, at least 100; not counted), then ROUNDS rounds
 * that alternate the variants.
 */
async function alternate<V extends { id: VariantId }>(
  ctx: BenchContext,
  config: { id: string },
  variants: V[],
  jobsOf: (variant: V) => number,
  one: (variant: V, jobs: number, roundNumber: number) => Promise<RunFigures>,
): Promise<RunFigures[]> {
  const runs: RunFigures[] = [];
  for (const variant of variants) {
    const warmJobs = Math.max(100, Math.round(jobsOf(variant) / 4));
    ctx.log(`throughput ${config.id}: warm-up ${variant.id} (${warmJobs} jobs)`);
    runs.push(await one(variant, warmJobs, 0));
  }
  for (let r = 1; r <= ROUNDS; r++) {
    for (const variant of variants) {
      const figures = await one(variant, jobsOf(variant), r);
      ctx.log(
        `throughput ${config.id}: round ${r} ${variant.id.padEnd(7)} ${fmtInt(figures.jobsPerSecond).padStart(7)} jobs/s` +
          ` (${figures.seconds.toFixed(2)} s, start-up ${figures.startupMs} ms` +
          `${figures.lockStatements ? `, ${figures.lockStatements} lock statements` : ""})`,
      );
      if (figures.conflicts > 0) {
        ctx.log(
          `warning: ${figures.conflicts} lock conflict(s) in ${config.id}/${variant.id}, where every key is distinct`,
        );
      }
      runs.push(figures);
    }
  }
  return runs;
}

async function runConfig(
  ctx: BenchContext,
  config: Config,
  workers: WorkerProcess[],
): Promise<ConfigFigures> {
  const ids: VariantId[] = config.naiveJobs
    ? ["plain", "wrapped", "naive", "naiveConn"]
    : ["plain", "wrapped"];
  const jobsOf = (variant: { id: VariantId }) =>
    ctx.quick
      ? config.quickJobs
      : variant.id === "naive" || variant.id === "naiveConn"
        ? (config.naiveJobs ?? config.jobs)
        : config.jobs;
  const runs = await alternate(
    ctx,
    config,
    ids.map((id) => ({ id })),
    jobsOf,
    (variant, n, r) => measure(ctx, workers, config, variant.id, n, r),
  );
  return summarise(config, runs);
}

export const throughput: Section = {
  id: "throughput",
  title: "Execution overhead",
  async run(ctx): Promise<SectionResult> {
    const results: ConfigFigures[] = [];
    // One process for A and B, then three for A3 and B3, so that idle worker processes do not share
    // the machine. --expose-gc: the heap figures are taken after a full collection.
    const naivePoolSize = Math.max(...CONFIGS.map((c) => c.concurrency));
    for (const configs of [CONFIGS, PROCESS_CONFIGS]) {
      const processes = configs[0]!.processes;
      ctx.log(`throughput: starting ${processes} worker process(es)`);
      const env = { DATABASE_URL: ctx.url, NAIVE_POOL_SIZE: String(naivePoolSize) };
      const workers = await forkWorkers(WORKER_SCRIPT, processes, env, ["--expose-gc"]);
      try {
        for (const config of configs) results.push(await runConfig(ctx, config, workers));
      } finally {
        await Promise.all(workers.map((w) => w.stop()));
      }
    }
    const costs = results.map(sessionCost);
    return {
      tables: [...tables(results), sessionTable(costs, ctx)],
      goals: [...goals(results), ...sessionGoals(costs)],
      figures: { rounds: ROUNDS, configs: results, sessionCost: costs },
    };
  },
};

/** One variant's figures over its measured runs (at least one). */
function variantFigures(mine: RunFigures[]) {
  const rates = mine.map((r) => r.jobsPerSecond);
  const totalJobs = mine.reduce((sum, r) => sum + r.jobs, 0);
  const statements = mine.reduce((sum, r) => sum + r.lockStatements, 0);
  return {
    jobs: mine[0]!.jobs,
    medianJobsPerSecond: Math.round(median(rates)),
    spread: round(spread(rates), 3),
    medianNodeCpuUsPerJob: round(median(mine.map((r) => r.nodeCpuUsPerJob)), 1),
    lockStatementsPerJob: round(statements / totalJobs, 4),
    jobsPerLockStatement: statements > 0 ? round(totalJobs / statements, 1) : 0,
  };
}

function summarise(config: Config, runs: RunFigures[]) {
  const measured = runs.filter((r) => r.round > 0);
  const per = (variant: VariantId) => {
    const mine = measured.filter((r) => r.variant === variant);
    return mine.length > 0 ? variantFigures(mine) : undefined;
  };
  const plain = per("plain")!;
  const wrapped = per("wrapped")!;
  const naive = per("naive");
  const naiveConn = per("naiveConn");
  const over = (v: VariantFigures | undefined) =>
    v ? round(v.medianJobsPerSecond / plain.medianJobsPerSecond, 3) : null;
  const wrappedOverPlain = round(wrapped.medianJobsPerSecond / plain.medianJobsPerSecond, 3);
  return {
    id: config.id,
    label: config.label,
    processes: config.processes,
    concurrency: config.concurrency,
    worker: config.worker,
    rounds: ROUNDS,
    variants: {
      plain,
      wrapped,
      ...(naive ? { naive } : {}),
      ...(naiveConn ? { naiveConn } : {}),
    },
    wrappedOverPlain,
    naiveOverPlain: over(naive),
    naiveConnOverPlain: over(naiveConn),
    goal: config.goal,
    goalMet: wrappedOverPlain >= config.goal,
    runs,
  };
}

function tables(results: ConfigFigures[]): Table[] {
  const jobsPerRun = (c: ConfigFigures) =>
    !c.variants.naive || c.variants.naive.jobs === c.variants.plain.jobs
      ? fmtInt(c.variants.plain.jobs)
      : `${fmtInt(c.variants.plain.jobs)} (naive ${fmtInt(c.variants.naive.jobs)})`;
  const summary: Table = {
    title: `Execution overhead: no-op task, jobs/s (median of ${ROUNDS} alternating runs; ± = spread (max−min)/median)`,
    columns: [
      { header: "config", align: "left" },
      { header: "jobs/run", align: "right" },
      { header: "plain", align: "right" },
      { header: "wrapped", align: "right" },
      { header: "wrapped/plain", align: "right" },
      { header: "goal", align: "right" },
      { header: "met", align: "left" },
      { header: "lock stmts/job", align: "right" },
      { header: "naive", align: "right" },
      { header: "naive/plain", align: "right" },
      { header: "naive, conn/job", align: "right" },
      { header: "its /plain", align: "right" },
      { header: "node CPU µs/job p/w/n/c", align: "right" },
    ],
    rows: results.map((c) => [
      `${c.id}: ${c.label}`,
      jobsPerRun(c),
      `${fmtInt(c.variants.plain.medianJobsPerSecond)} ±${fmtPercent(c.variants.plain.spread)}`,
      `${fmtInt(c.variants.wrapped.medianJobsPerSecond)} ±${fmtPercent(c.variants.wrapped.spread)}`,
      fmtFixed(c.wrappedOverPlain, 2),
      `≥ ${fmtFixed(c.goal, 2)}`,
      c.goalMet ? "yes" : "NO",
      fmtFixed(c.variants.wrapped.lockStatementsPerJob, 3),
      c.variants.naive
        ? `${fmtInt(c.variants.naive.medianJobsPerSecond)} ±${fmtPercent(c.variants.naive.spread)}`
        : "–",
      c.naiveOverPlain === null ? "–" : fmtFixed(c.naiveOverPlain, 2),
      c.variants.naiveConn
        ? `${fmtInt(c.variants.naiveConn.medianJobsPerSecond)} ±${fmtPercent(c.variants.naiveConn.spread)}`
        : "–",
      c.naiveConnOverPlain === null ? "–" : fmtFixed(c.naiveConnOverPlain, 2),
      [c.variants.plain, c.variants.wrapped, c.variants.naive, c.variants.naiveConn]
        .map((v) => (v ? fmtInt(v.medianNodeCpuUsPerJob) : "–"))
        .join(" / "),
    ]),
    notes: [
      "plain: graphile-worker alone; wrapped: locks.exclusive() with a distinct key per job;",
      "naive: pg_try_advisory_lock + pg_advisory_unlock per job on one connection (2 statements/job);",
      "naive, conn/job: the same on a connection of the job's own, from a pool of one per worker (que-locks' design).",
      "lock stmts/job: statements on the lock session per job (< 1: lock/unlock requests coalesced).",
      "node CPU µs/job: CPU time (user + system) of the worker process(es) per job, plain / wrapped / naive / conn/job.",
      `${CONFIGS.map((c) => c.id).join(", ")}: one worker process; ${PROCESS_CONFIGS.map((c) => c.id).join(", ")}: ${PROCESSES}, ` +
        "each with the same concurrency and options and its own runner",
      "(and Locks instance, with attach()); clock from the start signal to an empty table; lock stmts/job and",
      "node CPU summed over the processes. No naive variant in several: it is a one-process comparison of coalescing.",
    ],
  };
  return [summary];
}

function goals(results: ConfigFigures[]): Goal[] {
  return results.map((c) => ({
    section: "throughput",
    name: `${c.id}: ${c.label}`,
    target: `wrapped/plain ≥ ${fmtFixed(c.goal, 2)}`,
    value: c.wrappedOverPlain,
    threshold: c.goal,
    met: c.goalMet,
  }));
}

// ---------------------------------------------------------------------------------------------------------
// Lock session cost: summary

export type SessionCostFigures = ReturnType<typeof sessionCost>;

function sessionCost(c: ConfigFigures) {
  const measured = c.runs.filter((r) => r.round > 0);
  const sessions = measured.filter((r) => r.variant === "wrapped").map((r) => r.session);
  const ranges = sessions.flatMap((s) => Object.values(s.connections));
  const connections = Object.fromEntries(
    CONNECTION_ROLES.map((role) => [
      role,
      ranges.length > 0
        ? {
            min: Math.min(...ranges.map((r) => r[role].min)),
            max: Math.max(...ranges.map((r) => r[role].max)),
          }
        : { min: Number.NaN, max: Number.NaN },
    ]),
  ) as Record<ConnectionRole, Range>;
  const memory = (role: ConnectionRole) => {
    const all = sessions.flatMap((s) => s.memory.filter((m) => m.role === role));
    if (all.length === 0) return null;
    const m = (f: (b: BackendMemory) => number) => Math.round(median(all.map(f)));
    return {
      backends: all.length,
      vmRssKiB: m((b) => b.vmRssKiB),
      rssAnonKiB: m((b) => b.rssAnonKiB),
      ussKiB: m((b) => b.ussKiB),
      pssKiB: m((b) => b.pssKiB),
    };
  };
  const heap = (variant: VariantId): number | null => {
    const values = measured
      .filter((r) => r.variant === variant)
      .flatMap((r) => r.processes.filter((p) => p.gc).map((p) => p.heapUsedBytes));
    return values.length > 0 ? median(values) : null;
  };
  return {
    config: c.id,
    processes: c.processes,
    runs: sessions.length,
    samples: sessions.reduce((sum, s) => sum + s.samples, 0),
    connections,
    lockBackend: memory("lock"),
    workerBackend: memory("worker"),
    heapAfterPlainBytes: heap("plain"),
    heapAfterWrappedBytes: heap("wrapped"),
    heldAfterRun: Math.max(0, ...sessions.map((s) => s.heldAfterRun)),
    lockStatementsPerJob: c.variants.wrapped.lockStatementsPerJob,
  };
}

const fmtRange = (r: Range) =>
  r.min === r.max ? fmtInt(r.min) : `${fmtInt(r.min)}–${fmtInt(r.max)}`;
const fmtMiB = (bytes: number) => fmtFixed(bytes / 2 ** 20, 1);

function sessionTable(costs: SessionCostFigures[], ctx: BenchContext): Table {
  const memory = (m: SessionCostFigures["lockBackend"]) =>
    m ? `${fmtMiB(m.ussKiB * 1024)} / ${fmtMiB(m.pssKiB * 1024)}` : "n/a";
  const heap = (c: SessionCostFigures) =>
    c.heapAfterPlainBytes === null || c.heapAfterWrappedBytes === null
      ? "n/a"
      : `${fmtMiB(c.heapAfterPlainBytes)} / ${fmtMiB(c.heapAfterWrappedBytes)} ` +
        `(${c.heapAfterWrappedBytes >= c.heapAfterPlainBytes ? "+" : "−"}${fmtMiB(Math.abs(c.heapAfterWrappedBytes - c.heapAfterPlainBytes))})`;
  const connectionsGoal = sessionGoals(costs)[0]!;
  const heldGoal = sessionGoals(costs)[1]!;
  const row = (metric: string, cell: (c: SessionCostFigures) => string, goal = "") => [
    metric,
    ...costs.map(cell),
    goal,
  ];
  return {
    title: "Lock session cost, wrapped runs (per worker process; medians over the measured rounds)",
    columns: [
      { header: "", align: "left" },
      ...costs.map((c) => ({
        header: `${c.config} (${c.processes} process${c.processes > 1 ? "es" : ""})`,
        align: "right" as const,
      })),
      { header: "goal", align: "left" },
    ],
    rows: [
      row(
        "lock session connections per process",
        (c) => fmtRange(c.connections.lock),
        `= 1: ${connectionsGoal.met ? "met" : "MISSED"}`,
      ),
      row("library pool connections per process", (c) => fmtRange(c.connections["locks-pool"])),
      row("graphile-worker pool connections per process", (c) => fmtRange(c.connections.worker)),
      row("pg_stat_activity samples", (c) => fmtInt(c.samples)),
      row("lock session backend USS / Pss, MiB", (c) => memory(c.lockBackend)),
      row("graphile-worker pool backend USS / Pss, MiB", (c) => memory(c.workerBackend)),
      row("Node.js heap after a plain / wrapped run, MiB", heap),
      row(
        "locks held after a run",
        (c) => fmtInt(c.heldAfterRun),
        `= 0: ${heldGoal.met ? "met" : "MISSED"}`,
      ),
      row("lock statements per executed job", (c) => fmtFixed(c.lockStatementsPerJob, 3)),
    ],
    notes: [
      `Connections: pg_stat_activity, every connection named ${APPLICATION_PREFIX}/<process>/<role>; fewest–most per process over the`,
      `samples (every ${SAMPLE_INTERVAL_MS} ms during each run, from the bench's process, and once the table was empty).`,
      "Library pool: the Locks instance's own pool (enqueues, introspection; its migration check at start), not used by",
      "exclusive execution.",
      ctx.postgresServer === "embedded"
        ? "Backend memory, once the table was empty, from /proc/<pid>/smaps_rollup: USS (Private_Clean + Private_Dirty: what"
        : "Backend memory: n/a, the server is not the embedded one on this machine (/proc/<pid> would be another process).",
      ...(ctx.postgresServer === "embedded"
        ? [
            "the backend's exit would free) and Pss (shared pages divided among their users); graphile-worker: the median",
            "of its pool's backends (up to maxPoolSize, 10, per process).",
          ]
        : []),
      "Node.js heap: heapUsed after the runner stopped and a full GC (worker processes run with --expose-gc), after",
      "plain runs against after wrapped runs, medians over processes and rounds.",
    ],
  };
}

function sessionGoals(costs: SessionCostFigures[]): Goal[] {
  const lock = costs.map((c) => c.connections.lock);
  const fewest = Math.min(...lock.map((r) => r.min));
  const most = Math.max(...lock.map((r) => r.max));
  const held = Math.max(...costs.map((c) => c.heldAfterRun));
  return [
    {
      section: "throughput",
      name: "lock session: connections per worker process",
      target: "= 1 (every process, every sample)",
      value: most !== 1 ? most : fewest,
      threshold: 1,
      met: fewest === 1 && most === 1,
    },
    {
      section: "throughput",
      name: "lock session: locks held after a run",
      target: "= 0",
      value: held,
      threshold: 0,
      met: held === 0,
    },
  ];
}
