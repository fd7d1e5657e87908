/**
 * Section "throughput": no-op jobs per second, graphile-worker alone ("plain") against the task in
 * `locks.exclusive()` with a distinct key per job ("wrapped") and two naive wrappers, in worker processes
 * (throughput-worker.ts) forked once per process count and kept (method and configurations:
 * bench/README.md). The jobs are inserted up front; the clock runs from the start signal to an empty job
 * table. A warm-up of each variant, then rounds alternating the variants; medians. The wrapped runs also
 * give the lock session's cost: connections by role, backend memory, heap, locks left held.
 */
import { readFile } from "node:fs/promises";
import type pg from "pg";
import { benchRounds, fmtFixed, fmtInt, fmtPercent, goal, insertJobs, median } from "./lib.js";
import { round, runWorkers, sleep, spread, table, withWorkers } from "./lib.js";
import type { BenchContext, Section } from "./lib.js";
import type { WorkerPreset, WorkerProcess } from "./lib.js";
import { APPLICATION_PREFIX, CONNECTION_ROLES, type ConnectionRole } from "./throughput-worker.js";
import type { ProcessReport, ProcessVariant, Progress, StartRequest } from "./throughput-worker.js";

const TASK = "noop";
const ROUNDS = benchRounds(3);
/** Worker processes of A3 and B3. */
const PROCESSES = 3;
/** How often pg_stat_activity is sampled during a run. */
const SAMPLE_INTERVAL_MS = 250;
const WORKER_SCRIPT = new URL("./throughput-worker.ts", import.meta.url);

interface Config {
  id: string;
  label: string;
  processes: number;
  concurrency: number;
  /** Jobs per measured run: a run of the slowest variant takes 2 s or more here. */
  jobs: number;
  /** Jobs per measured run of the naive variants (one-process configurations only: they run none else). */
  naiveJobs?: number;
  /** Jobs per run with BENCH_QUICK=1. */
  quickJobs: number;
  /** graphile-worker options beyond concurrency, the same for every variant. */
  worker: WorkerPreset;
  /** The goal for wrapped/plain. */
  goal: number;
}

/**
 * B's settings are the best of a sweep for plain graphile-worker on the 2-core development machine
 * (localQueue.size 24 to 2000, completeJobBatchDelay -1 to 10 ms, maxPoolSize 10 and 26).
 */
const ONE_PROCESS: Config[] = [
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
    worker: { localQueue: { size: 250 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 },
    goal: 0.9,
  },
];
/** A3 and B3: A and B in 3 processes, each with A's or B's settings and its own runner and Locks. */
const SEVERAL: Config[] = ONE_PROCESS.map(({ naiveJobs: _, ...c }) => ({
  ...c,
  id: `${c.id}${PROCESSES}`,
  label: `${PROCESSES} processes × ${c.label}`,
  processes: PROCESSES,
}));

// ---------------------------------------------------------------------------------------------------------
// One run, and the lock session's connections and backends meanwhile

type Backend = { pid: number; processName: string; role: ConnectionRole };
type Range = { min: number; max: number };
type Memory = { role: ConnectionRole; ussKiB: number; pssKiB: number };
type RunFigures = Awaited<ReturnType<typeof measure>>;

/** The benchmark's named connections (`gwl-bench-tp/<process>/<role>`), now. */
async function namedBackends(pool: pg.Pool): Promise<Backend[]> {
  const { rows } = await pool.query<{ pid: number; application_name: string }>(
    `select pid, application_name from pg_stat_activity
      where datname = current_database() and application_name like $1`,
    [`${APPLICATION_PREFIX}/%`],
  );
  return rows.map(({ pid, application_name }) => {
    const [, processName, role] = application_name.split("/");
    return { pid, processName: processName!, role: role as ConnectionRole };
  });
}

/**
 * The memory of the lock sessions' and graphile-worker's backends in `sample`, from
 * /proc/<pid>/smaps_rollup: USS (Private_Clean + Private_Dirty: what the backend's exit would free) and Pss
 * (shared pages divided among the processes that map them). Only when the server is the embedded one, on
 * this machine (another host's pid means nothing here).
 */
async function backendMemory(ctx: BenchContext, sample: Backend[]): Promise<Memory[]> {
  if (ctx.postgresServer !== "embedded") return [];
  const read = async ({ pid, role }: Backend): Promise<Memory[]> => {
    try {
      const [comm, rollup] = await Promise.all([
        readFile(`/proc/${pid}/comm`, "utf8"),
        readFile(`/proc/${pid}/smaps_rollup`, "utf8"),
      ]);
      const kib = (field: string) =>
        Number(new RegExp(`^${field}:\\s+(\\d+) kB$`, "m").exec(rollup)?.[1] ?? Number.NaN);
      return comm.startsWith("postgres")
        ? [{ role, ussKiB: kib("Private_Clean") + kib("Private_Dirty"), pssKiB: kib("Pss") }]
        : [];
    } catch {
      return [];
    }
  };
  return (await Promise.all(sample.filter((b) => b.role !== "locks-pool").map(read))).flat();
}

let lastRunId = 0;

/**
 * One run: insert, start the runners, wait until they reported every job completed and the table is
 * empty, take a last sample of the connections and the backends' memory, stop the runners.
 * pg_stat_activity is sampled every SAMPLE_INTERVAL_MS during every run, so that every variant shares
 * that load.
 */
async function measure(
  ctx: BenchContext,
  workers: WorkerProcess[],
  config: Config,
  variant: ProcessVariant,
  jobs: number,
  roundNumber: number,
) {
  await insertJobs(ctx.pool, TASK, jobs);
  const run = ++lastRunId;
  const completed = new Map<string, number>();
  const done = new Promise<void>((resolve) => {
    for (const w of workers) {
      w.onEvent = (event, data) => {
        if (event !== "progress" || (data as Progress).run !== run) return;
        completed.set(w.name, (data as Progress).completed);
        if ([...completed.values()].reduce((sum, n) => sum + n, 0) >= jobs) resolve();
      };
    }
  });
  const samples: Backend[][] = [];
  let sampling = true;
  const loop = (async () => {
    for (;;) {
      await sleep(SAMPLE_INTERVAL_MS);
      if (!sampling) return;
      samples.push(await namedBackends(ctx.pool));
    }
  })();
  loop.catch(() => undefined);
  let memory: Memory[] = [];
  const start: StartRequest = {
    type: "start",
    run,
    variant,
    taskIdentifier: TASK,
    concurrency: config.concurrency,
    worker: config.worker,
  };
  const { reports, ms } = await runWorkers<ProcessReport>(workers, ctx.pool, start, {
    timeoutMs: 60_000 + jobs * 5,
    done,
    // With the runners still running: their pools are open, as they were during the run.
    atEnd: async () => {
      sampling = false;
      await loop;
      samples.push(await namedBackends(ctx.pool));
      memory = await backendMemory(ctx, samples.at(-1)!);
    },
  }).finally(() => {
    sampling = false;
    for (const w of workers) w.onEvent = undefined;
  });
  const sum = (f: (r: ProcessReport) => number) => reports.reduce((total, r) => total + f(r), 0);
  if (sum((r) => r.completed) !== jobs) {
    ctx.log(
      `warning: ${config.id}/${variant}: ${sum((r) => r.completed)} job(s) completed, ${jobs} inserted`,
    );
  }
  // Connections of each role per process, fewest and most over the samples.
  const counts = (role: ConnectionRole) =>
    samples.flatMap((s) =>
      reports.map((r) => s.filter((b) => b.processName === r.name && b.role === role).length),
    );
  const connections = Object.fromEntries(
    CONNECTION_ROLES.map((role) => [
      role,
      { min: Math.min(...counts(role)), max: Math.max(...counts(role)) },
    ]),
  ) as Record<ConnectionRole, Range>;
  return {
    config: config.id,
    variant,
    round: roundNumber,
    jobs,
    seconds: round(ms / 1000, 3),
    jobsPerSecond: Math.round((jobs * 1000) / ms),
    lockStatements: sum((r) => r.lockStatements),
    conflicts: sum((r) => r.conflicts),
    nodeCpuUsPerJob: round(sum((r) => r.cpuUs) / jobs, 1),
    reports,
    samples: samples.length,
    connections,
    memory,
  };
}

// ---------------------------------------------------------------------------------------------------------
// The section

/** A warm-up run of each variant (a quarter of the jobs, at least 100), then ROUNDS rounds alternating them. */
async function runConfig(ctx: BenchContext, config: Config, workers: WorkerProcess[]) {
  const variants: ProcessVariant[] = config.naiveJobs
    ? ["plain", "wrapped", "naive", "naiveConn"]
    : ["plain", "wrapped"];
  const jobsOf = (v: ProcessVariant) =>
    ctx.quick ? config.quickJobs : v.startsWith("naive") ? config.naiveJobs! : config.jobs;
  const runs: RunFigures[] = [];
  for (let r = 0; r <= ROUNDS; r++) {
    for (const v of variants) {
      const jobs = r === 0 ? Math.max(100, Math.round(jobsOf(v) / 4)) : jobsOf(v);
      const f = await measure(ctx, workers, config, v, jobs, r);
      ctx.log(
        `throughput ${config.id}: ${r === 0 ? "warm-up" : `round ${r}`} ${v.padEnd(9)} ${fmtInt(f.jobsPerSecond).padStart(7)} jobs/s` +
          ` (${f.seconds.toFixed(2)} s${f.lockStatements ? `, ${f.lockStatements} lock statements` : ""})` +
          (f.conflicts > 0
            ? `; warning: ${f.conflicts} lock conflict(s), where every key is distinct`
            : ""),
      );
      runs.push(f);
    }
  }
  return summarise(config, runs);
}

function summarise(config: Config, runs: RunFigures[]) {
  const measured = runs.filter((r) => r.round > 0);
  const per = (variant: ProcessVariant) => {
    const mine = measured.filter((r) => r.variant === variant);
    if (mine.length === 0) return undefined;
    const rates = mine.map((r) => r.jobsPerSecond);
    const jobs = mine.reduce((sum, r) => sum + r.jobs, 0);
    return {
      jobs: mine[0]!.jobs,
      medianJobsPerSecond: Math.round(median(rates)),
      spread: round(spread(rates), 3),
      medianNodeCpuUsPerJob: round(median(mine.map((r) => r.nodeCpuUsPerJob)), 1),
      lockStatementsPerJob: round(mine.reduce((sum, r) => sum + r.lockStatements, 0) / jobs, 4),
    };
  };
  const variants = {
    plain: per("plain")!,
    wrapped: per("wrapped")!,
    naive: per("naive"),
    naiveConn: per("naiveConn"),
  };
  const over = (v: typeof variants.naive) =>
    v ? round(v.medianJobsPerSecond / variants.plain.medianJobsPerSecond, 3) : null;
  const wrappedOverPlain = over(variants.wrapped)!;
  // The lock session's cost, from the wrapped runs.
  const wrapped = measured.filter((r) => r.variant === "wrapped");
  const range = (role: ConnectionRole): Range => ({
    min: Math.min(...wrapped.map((r) => r.connections[role].min)),
    max: Math.max(...wrapped.map((r) => r.connections[role].max)),
  });
  const memory = (role: ConnectionRole) => {
    const all = wrapped.flatMap((r) => r.memory.filter((m) => m.role === role));
    return all.length === 0
      ? null
      : { ussKiB: median(all.map((m) => m.ussKiB)), pssKiB: median(all.map((m) => m.pssKiB)) };
  };
  const heap = (variant: ProcessVariant) =>
    median(
      measured
        .filter((r) => r.variant === variant)
        .flatMap((r) => r.reports.map((p) => p.heapUsedBytes)),
    );
  return {
    ...config,
    variants,
    wrappedOverPlain,
    naiveOverPlain: over(variants.naive),
    naiveConnOverPlain: over(variants.naiveConn),
    goalMet: wrappedOverPlain >= config.goal,
    session: {
      samples: wrapped.reduce((sum, r) => sum + r.samples, 0),
      connections: Object.fromEntries(
        CONNECTION_ROLES.map((role) => [role, range(role)]),
      ) as Record<ConnectionRole, Range>,
      lockBackend: memory("lock"),
      workerBackend: memory("worker"),
      heapAfterPlainBytes: heap("plain"),
      heapAfterWrappedBytes: heap("wrapped"),
      heldAfterRun: Math.max(0, ...wrapped.flatMap((r) => r.reports.map((p) => p.heldAfterRun))),
    },
    runs,
  };
}

type ConfigFigures = ReturnType<typeof summarise>;

export const throughput: Section = {
  id: "throughput",
  title: "Execution overhead",
  async run(ctx) {
    const results: ConfigFigures[] = [];
    // One process for A and B, then three for A3 and B3, so that idle worker processes do not share the
    // machine. --expose-gc: the heap figures are taken after a full collection.
    const env = {
      DATABASE_URL: ctx.url,
      NAIVE_POOL_SIZE: String(Math.max(...ONE_PROCESS.map((c) => c.concurrency))),
    };
    for (const configs of [ONE_PROCESS, SEVERAL]) {
      ctx.log(`throughput: starting ${configs[0]!.processes} worker process(es)`);
      await withWorkers(
        WORKER_SCRIPT,
        configs[0]!.processes,
        env,
        async (workers) => {
          for (const config of configs) results.push(await runConfig(ctx, config, workers));
        },
        ["--expose-gc"],
      );
    }
    const connections = results.map((c) => c.session.connections.lock);
    const fewest = Math.min(...connections.map((r) => r.min));
    const most = Math.max(...connections.map((r) => r.max));
    const held = Math.max(...results.map((c) => c.session.heldAfterRun));
    const oneSession = fewest === 1 && most === 1;
    const goals = [
      ...results.map((c) =>
        goal(
          `${c.id}: ${c.label}`,
          `wrapped/plain ≥ ${fmtFixed(c.goal, 2)}`,
          c.wrappedOverPlain,
          c.goalMet,
        ),
      ),
      goal(
        "lock session: connections per worker process",
        "= 1 (every process, every sample)",
        most !== 1 ? most : fewest,
        oneSession,
      ),
      goal("lock session: locks held after a run", "= 0", held, held === 0),
    ];
    return {
      tables: [overheadTable(results), sessionTable(results, oneSession, held === 0)],
      goals,
      figures: { rounds: ROUNDS, configs: results },
    };
  },
};

function overheadTable(results: ConfigFigures[]) {
  const rate = (v: ConfigFigures["variants"]["naive"]) =>
    v ? `${fmtInt(v.medianJobsPerSecond)} ±${fmtPercent(v.spread)}` : "–";
  const ratio = (value: number | null) => (value === null ? "–" : fmtFixed(value, 2));
  return table(
    `Execution overhead: no-op task, jobs/s (median of ${ROUNDS} alternating runs; ± = spread (max−min)/median)`,
    "config | jobs/run | plain | wrapped | wrapped/plain | goal | <met | lock stmts/job | naive | naive/plain | naive, conn/job | its /plain | node CPU µs/job p/w/n/c",
    results.map(({ variants: v, ...c }) => [
      `${c.id}: ${c.label}`,
      !v.naive || v.naive.jobs === v.plain.jobs
        ? fmtInt(v.plain.jobs)
        : `${fmtInt(v.plain.jobs)} (naive ${fmtInt(v.naive.jobs)})`,
      rate(v.plain),
      rate(v.wrapped),
      fmtFixed(c.wrappedOverPlain, 2),
      `≥ ${fmtFixed(c.goal, 2)}`,
      c.goalMet ? "yes" : "NO",
      fmtFixed(v.wrapped.lockStatementsPerJob, 3),
      rate(v.naive),
      ratio(c.naiveOverPlain),
      rate(v.naiveConn),
      ratio(c.naiveConnOverPlain),
      [v.plain, v.wrapped, v.naive, v.naiveConn]
        .map((x) => (x ? fmtInt(x.medianNodeCpuUsPerJob) : "–"))
        .join(" / "),
    ]),
    [
      "naive: pg_try_advisory_lock + pg_advisory_unlock per job on one connection; conn/job: on a connection of the",
      "job's own (que-locks' design). lock stmts/job: on the lock session (< 1: coalesced). node CPU: p/w/n/c = plain /",
      `wrapped / naive / conn/job, summed over the processes. ${SEVERAL.map((c) => c.id).join(", ")}: ${PROCESSES} processes, no naive variant.`,
    ],
  );
}

function sessionTable(results: ConfigFigures[], connectionsMet: boolean, heldMet: boolean) {
  const mib = (bytes: number) => fmtFixed(bytes / 2 ** 20, 1);
  const range = (r: Range) =>
    r.min === r.max ? fmtInt(r.min) : `${fmtInt(r.min)}–${fmtInt(r.max)}`;
  const memory = (m: { ussKiB: number; pssKiB: number } | null) =>
    m ? `${mib(m.ussKiB * 1024)} / ${mib(m.pssKiB * 1024)}` : "n/a";
  const heap = ({
    heapAfterPlainBytes: plain,
    heapAfterWrappedBytes: wrapped,
  }: ConfigFigures["session"]) =>
    Number.isNaN(plain) || Number.isNaN(wrapped)
      ? "n/a"
      : `${mib(plain)} / ${mib(wrapped)} (${wrapped >= plain ? "+" : "−"}${mib(Math.abs(wrapped - plain))})`;
  const row = (
    metric: string,
    cell: (s: ConfigFigures["session"], c: ConfigFigures) => string,
    goalCell = "",
  ) => [metric, ...results.map((c) => cell(c.session, c)), goalCell];
  return table(
    "Lock session cost, wrapped runs (per worker process; medians over the measured rounds)",
    ` | ${results.map((c) => `${c.id} (${c.processes} process${c.processes > 1 ? "es" : ""})`).join(" | ")} | <goal`,
    [
      row(
        "lock session connections per process",
        (s) => range(s.connections.lock),
        `= 1: ${connectionsMet ? "met" : "MISSED"}`,
      ),
      row("library pool connections per process", (s) => range(s.connections["locks-pool"])),
      row("graphile-worker pool connections per process", (s) => range(s.connections.worker)),
      row("pg_stat_activity samples", (s) => fmtInt(s.samples)),
      row("lock session backend USS / Pss, MiB", (s) => memory(s.lockBackend)),
      row("graphile-worker pool backend USS / Pss, MiB", (s) => memory(s.workerBackend)),
      row("Node.js heap after a plain / wrapped run, MiB", heap),
      row(
        "locks held after a run",
        (s) => fmtInt(s.heldAfterRun),
        `= 0: ${heldMet ? "met" : "MISSED"}`,
      ),
      row("lock statements per executed job", (_s, c) =>
        fmtFixed(c.variants.wrapped.lockStatementsPerJob, 3),
      ),
    ],
    [
      `Connections: fewest–most per process over the samples of pg_stat_activity (every ${SAMPLE_INTERVAL_MS} ms, and once the table`,
      "was empty). Memory of a backend: from /proc/<pid>/smaps_rollup once the table was empty (embedded server only).",
      "Heap: heapUsed after the runner stopped and a full GC, after plain runs against after wrapped runs.",
    ],
  );
}
