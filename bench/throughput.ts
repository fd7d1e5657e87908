/**
 * Section "execution overhead": how many no-op jobs per second graphile-worker runs with and without the
 * exclusive wrapper (a distinct key per job, so every job takes and releases a lock and none conflicts).
 *
 * Method, per configuration: N jobs are pre-inserted, a runner is started, and the clock runs from just
 * before `run()` until the job table is empty (the last `job:complete` event, then polling the table, as
 * completions may be written in the background or in batches); then the runner is stopped and the table
 * truncated. One warm-up run of each variant (not counted), then rounds that alternate the variants
 * (plain, wrapped, naive, plain, ...), so that drift (caches, autovacuum, thermal) hits every variant alike.
 * Figures are medians; the ratio is the ratio of the medians.
 *
 * Variants:
 * - plain: the no-op task as is.
 * - wrapped: `locks.exclusive(...)` around it; lock requests of concurrent jobs are coalesced on the one
 *   lock session. "lock stmts/job" is the number of statements sent on that session per job.
 * - naive: what you would write without the library: per job, `pg_try_advisory_lock` and then
 *   `pg_advisory_unlock` on one dedicated connection (two round trips, same key derivation), which shows
 *   what coalescing buys.
 */
import { EventEmitter } from "node:events";
import pg from "pg";
import { run } from "graphile-worker";
import type { Runner, Task, WorkerEvents } from "graphile-worker";
import type { Locks } from "../src/index.js";
import { library } from "./library.js";
import {
  fmtFixed,
  fmtInt,
  fmtPercent,
  insertJobs,
  median,
  now,
  quietLogger,
  resetJobs,
  round,
  spread,
  waitUntilNoJobs,
  type BenchContext,
  type Goal,
  type Section,
  type SectionResult,
  type Table,
} from "./lib.js";

export const TASK = "noop";
/** Measured rounds per configuration (BENCH_ROUNDS overrides). */
const ROUNDS = Math.max(1, Number(process.env.BENCH_ROUNDS ?? 3) || 3);

export type WorkerPreset = NonNullable<GraphileConfig.Preset["worker"]>;

export interface Config {
  id: string;
  label: string;
  concurrency: number;
  /** Jobs per measured run (chosen so that a run of the slowest variant takes a few seconds here). */
  jobs: number;
  /** Jobs per measured run of the naive variant. */
  naiveJobs: number;
  /** Jobs per measured run with BENCH_QUICK=1 (every variant). */
  quickJobs: number;
  /** graphile-worker options beyond concurrency, the same for every variant. */
  worker: WorkerPreset;
  /** The issue's goal for wrapped/plain. */
  goal: number;
}

/**
 * B's settings are the best of a sweep for plain graphile-worker (bench/tune.ts, 60,000 jobs per run) on
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

/** `nolock` exists in bench/profile.ts only. */
export type VariantId = "plain" | "wrapped" | "naive" | "nolock";

export interface Variant {
  id: VariantId;
  task: Task;
  /** Statements sent on the variant's lock connection so far (0 for plain). */
  statements(): number;
  /** Lock conflicts so far (must stay 0: every key is distinct). */
  conflicts(): number;
  /** Hooks the variant into the runner's events before it starts (the library's lock-ahead). */
  attach?(events: WorkerEvents): () => void;
}

/** The three variants, with what they need (a Locks instance, the naive variant's connection). */
export async function openVariants(
  ctx: BenchContext,
): Promise<{ variants: Variant[]; close(): Promise<void> }> {
  const locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  const naiveClient = new pg.Client({
    connectionString: ctx.url,
    application_name: "gwl-bench-naive",
  });
  naiveClient.on("error", () => undefined);
  try {
    await naiveClient.connect();
  } catch (error) {
    await locks.release();
    throw error;
  }
  const naive = makeNaive(naiveClient);
  return {
    variants: [
      { id: "plain", task: noop, statements: () => 0, conflicts: () => 0 },
      {
        id: "wrapped",
        task: locks.exclusive(TASK, noop, { onConflict: "drop" }),
        statements: () => locks.status().statements,
        conflicts: countConflicts(locks),
        // As the README says to run with a local queue (and a no-op without one).
        attach: (events) => locks.attach({ events }),
      },
      { id: "naive", task: naive.task, statements: naive.statements, conflicts: naive.conflicts },
    ],
    async close() {
      await locks.release();
      await naiveClient.end().catch(() => undefined);
    },
  };
}

export interface RunFigures {
  config: string;
  variant: VariantId;
  /** 0 for the warm-up. */
  round: number;
  jobs: number;
  /** From just before `run()` until the job table was empty. */
  seconds: number;
  jobsPerSecond: number;
  /** From just before `run()` until the first job started (runner start-up, included in `seconds`). */
  startupMs: number;
  /** From just before `run()` until the last `job:complete` event. */
  lastCompleteMs: number;
  /** Statements sent on the lock connection during the run (wrapped, naive). */
  lockStatements: number;
  /** Conflicts seen (must be 0: every key is distinct). */
  conflicts: number;
  /** CPU time of this Node.js process (user + system) per job, in microseconds. */
  nodeCpuUsPerJob: number;
}

/** A no-op task. */
const noop: Task = async () => undefined;

function countConflicts(locks: Locks): () => number {
  let conflicts = 0;
  locks.events.on("lock:conflict", () => {
    conflicts++;
  });
  return () => conflicts;
}

/**
 * Per job: try_lock, the task, unlock, each lock call a round trip on one shared connection. Calls are
 * queued here, one at a time (what node-postgres does itself, but without its deprecation warning for
 * queries issued while another runs).
 */
function makeNaive(client: pg.Client): { task: Task; statements(): number; conflicts(): number } {
  let statements = 0;
  let conflicts = 0;
  let tail: Promise<unknown> = Promise.resolve();
  const call = (name: string, fn: string, key: string): Promise<boolean> => {
    statements++;
    const result = tail.then(() =>
      client.query<{ ok: boolean }>({
        name,
        text: `select ${fn}($1::bigint) as ok`,
        values: [key],
      }),
    );
    tail = result.catch(() => undefined);
    return result.then(({ rows }) => rows[0]!.ok);
  };
  const task: Task = async (payload, helpers) => {
    const key = library.lockKey(TASK, payload).toString();
    if (!(await call("bench_naive_try_lock", "pg_try_advisory_lock", key))) {
      conflicts++;
      return;
    }
    try {
      await noop(payload, helpers);
    } finally {
      await call("bench_naive_unlock", "pg_advisory_unlock", key);
    }
  };
  return { task, statements: () => statements, conflicts: () => conflicts };
}

function timeout(ms: number, message: string): { promise: Promise<never>; clear(): void } {
  let timer: NodeJS.Timeout | undefined;
  const promise = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(message)), ms);
  });
  promise.catch(() => undefined);
  return { promise, clear: () => clearTimeout(timer) };
}

/** One measured run: insert, start the runner, wait until every job is gone, stop. */
export async function measure(
  ctx: BenchContext,
  config: Pick<Config, "id" | "concurrency" | "worker">,
  variant: Variant,
  jobs: number,
  roundNumber: number,
  /** For instruments (bench/profile.ts): called just before `run()` and once the table is empty. */
  hooks: { started?(): void; drained?(): void } = {},
): Promise<RunFigures> {
  await resetJobs(ctx.pool);
  await insertJobs(ctx.pool, TASK, jobs);

  const events = new EventEmitter() as WorkerEvents;
  const detach = variant.attach?.(events);
  let completed = 0;
  let failed = 0;
  let firstError: unknown;
  let startedAt = Number.NaN;
  let lastCompleteAt = Number.NaN;
  let allComplete!: () => void;
  const done = new Promise<void>((resolve) => {
    allComplete = resolve;
  });
  events.once("job:start", () => {
    startedAt = now();
  });
  events.on("job:complete", ({ error }) => {
    if (error) {
      failed++;
      firstError ??= error;
    }
    if (++completed === jobs) {
      lastCompleteAt = now();
      allComplete();
    }
  });

  const statementsBefore = variant.statements();
  const conflictsBefore = variant.conflicts();
  // Generous: the slowest variant here does well over 1,000 jobs/s.
  const limit = timeout(
    60_000 + jobs * 5,
    `${config.id}/${variant.id}: ${jobs} jobs did not complete in time`,
  );
  hooks.started?.();
  const cpuBefore = process.cpuUsage();
  const t0 = now();
  let runner: Runner | undefined;
  try {
    runner = await run({
      connectionString: ctx.url,
      concurrency: config.concurrency,
      taskList: { [TASK]: variant.task },
      noHandleSignals: true,
      // Irrelevant: every job is in the table before the runner starts.
      pollInterval: 1000,
      logger: quietLogger,
      events,
      preset: { worker: { ...config.worker } },
    });
    const stoppedEarly = runner.promise.then(() => {
      throw new Error(`${config.id}/${variant.id}: the runner stopped before every job completed`);
    });
    stoppedEarly.catch(() => undefined);
    await Promise.race([done, stoppedEarly, limit.promise]);
    if (failed > 0) {
      throw new Error(
        `${config.id}/${variant.id}: ${failed} job(s) failed, first: ${String(firstError)}`,
        {
          cause: firstError,
        },
      );
    }
    await Promise.race([waitUntilNoJobs(ctx.pool, 30_000), limit.promise]);
    const seconds = (now() - t0) / 1000;
    const cpu = process.cpuUsage(cpuBefore);
    hooks.drained?.();
    return {
      config: config.id,
      variant: variant.id,
      round: roundNumber,
      jobs,
      seconds: round(seconds, 3),
      jobsPerSecond: Math.round(jobs / seconds),
      startupMs: Math.round(startedAt - t0),
      lastCompleteMs: Math.round(lastCompleteAt - t0),
      lockStatements: variant.statements() - statementsBefore,
      conflicts: variant.conflicts() - conflictsBefore,
      nodeCpuUsPerJob: round((cpu.user + cpu.system) / jobs, 1),
    };
  } catch (error) {
    // Report this error, not a follow-up one from stopping a runner that already failed.
    await runner?.stop().catch(() => undefined);
    runner = undefined;
    throw error;
  } finally {
    limit.clear();
    await runner?.stop();
    detach?.();
  }
}

export interface ConfigFigures {
  id: string;
  label: string;
  concurrency: number;
  worker: WorkerPreset;
  rounds: number;
  variants: Record<
    Exclude<VariantId, "nolock">,
    {
      /** Jobs per measured run. */
      jobs: number;
      medianJobsPerSecond: number;
      /** (max − min) / median of the rounds' jobs/s. */
      spread: number;
      /** CPU time of the Node.js process per job (µs), median over the rounds. */
      medianNodeCpuUsPerJob: number;
      /** Lock statements per job over all rounds. */
      lockStatementsPerJob: number;
      /** Jobs per lock statement (the coalescing factor). */
      jobsPerLockStatement: number;
    }
  >;
  /** Ratio of the medians. */
  wrappedOverPlain: number;
  naiveOverPlain: number;
  goal: number;
  goalMet: boolean;
  runs: RunFigures[];
}

export const throughput: Section = {
  id: "throughput",
  title: "Execution overhead",
  async run(ctx): Promise<SectionResult> {
    const { variants, close } = await openVariants(ctx);
    const results: ConfigFigures[] = [];
    try {
      for (const config of CONFIGS) {
        const jobsOf = (variant: Variant) =>
          ctx.quick ? config.quickJobs : variant.id === "naive" ? config.naiveJobs : config.jobs;
        const runs: RunFigures[] = [];
        for (const variant of variants) {
          const warmJobs = Math.max(100, Math.round(jobsOf(variant) / 4));
          ctx.log(`throughput ${config.id}: warm-up ${variant.id} (${warmJobs} jobs)`);
          runs.push(await measure(ctx, config, variant, warmJobs, 0));
        }
        for (let r = 1; r <= ROUNDS; r++) {
          for (const variant of variants) {
            const figures = await measure(ctx, config, variant, jobsOf(variant), r);
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
        results.push(summarise(config, runs));
      }
    } finally {
      await close();
    }
    return {
      tables: tables(results),
      goals: goals(results),
      figures: { rounds: ROUNDS, configs: results },
    };
  },
};

function summarise(config: Config, runs: RunFigures[]): ConfigFigures {
  const measured = runs.filter((r) => r.round > 0);
  const per = (variant: Exclude<VariantId, "nolock">) => {
    const mine = measured.filter((r) => r.variant === variant);
    const rates = mine.map((r) => r.jobsPerSecond);
    const totalJobs = mine.reduce((sum, r) => sum + r.jobs, 0);
    const statements = mine.reduce((sum, r) => sum + r.lockStatements, 0);
    return {
      jobs: mine[0]?.jobs ?? 0,
      medianJobsPerSecond: Math.round(median(rates)),
      spread: round(spread(rates), 3),
      medianNodeCpuUsPerJob: round(median(mine.map((r) => r.nodeCpuUsPerJob)), 1),
      lockStatementsPerJob: round(statements / totalJobs, 4),
      jobsPerLockStatement: statements > 0 ? round(totalJobs / statements, 1) : 0,
    };
  };
  const variants = { plain: per("plain"), wrapped: per("wrapped"), naive: per("naive") };
  const wrappedOverPlain = round(
    variants.wrapped.medianJobsPerSecond / variants.plain.medianJobsPerSecond,
    3,
  );
  return {
    id: config.id,
    label: config.label,
    concurrency: config.concurrency,
    worker: config.worker,
    rounds: ROUNDS,
    variants,
    wrappedOverPlain,
    naiveOverPlain: round(
      variants.naive.medianJobsPerSecond / variants.plain.medianJobsPerSecond,
      3,
    ),
    goal: config.goal,
    goalMet: wrappedOverPlain >= config.goal,
    runs,
  };
}

function tables(results: ConfigFigures[]): Table[] {
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
      { header: "node CPU µs/job p/w/n", align: "right" },
    ],
    rows: results.map((c) => [
      `${c.id}: ${c.label}`,
      c.variants.naive.jobs === c.variants.plain.jobs
        ? fmtInt(c.variants.plain.jobs)
        : `${fmtInt(c.variants.plain.jobs)} (naive ${fmtInt(c.variants.naive.jobs)})`,
      `${fmtInt(c.variants.plain.medianJobsPerSecond)} ±${fmtPercent(c.variants.plain.spread)}`,
      `${fmtInt(c.variants.wrapped.medianJobsPerSecond)} ±${fmtPercent(c.variants.wrapped.spread)}`,
      fmtFixed(c.wrappedOverPlain, 2),
      `≥ ${fmtFixed(c.goal, 2)}`,
      c.goalMet ? "yes" : "NO",
      fmtFixed(c.variants.wrapped.lockStatementsPerJob, 3),
      `${fmtInt(c.variants.naive.medianJobsPerSecond)} ±${fmtPercent(c.variants.naive.spread)}`,
      fmtFixed(c.naiveOverPlain, 2),
      [c.variants.plain, c.variants.wrapped, c.variants.naive]
        .map((v) => fmtInt(v.medianNodeCpuUsPerJob))
        .join(" / "),
    ]),
    notes: [
      "plain: graphile-worker alone; wrapped: locks.exclusive() with a distinct key per job;",
      "naive: pg_try_advisory_lock + pg_advisory_unlock per job on one connection (2 statements/job).",
      "lock stmts/job: statements on the lock session per job (< 1: lock/unlock requests coalesced).",
      "node CPU µs/job: CPU time (user + system) of this Node.js process per job, plain / wrapped / naive.",
    ],
  };
  const detail: Table = {
    title: "Execution overhead: every run (round 0 = warm-up, not counted)",
    columns: [
      { header: "config", align: "left" },
      { header: "round", align: "right" },
      { header: "variant", align: "left" },
      { header: "jobs", align: "right" },
      { header: "seconds", align: "right" },
      { header: "jobs/s", align: "right" },
      { header: "start-up ms", align: "right" },
      { header: "lock stmts", align: "right" },
      { header: "node CPU µs/job", align: "right" },
    ],
    rows: results.flatMap((c) =>
      c.runs.map((r) => [
        c.id,
        String(r.round),
        r.variant,
        fmtInt(r.jobs),
        r.seconds.toFixed(2),
        fmtInt(r.jobsPerSecond),
        String(r.startupMs),
        r.variant === "plain" ? "" : fmtInt(r.lockStatements),
        fmtInt(r.nodeCpuUsPerJob),
      ]),
    ),
  };
  return [summary, detail];
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
