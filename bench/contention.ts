/**
 * Section "contention": 2,000 jobs over 10 keys, 20 ms tasks, 3 worker processes (contention-worker.ts)
 * × concurrency 8, per conflict strategy and against graphile-worker's queueName anchors (method and
 * variants: bench/README.md). The jobs go in with one statement; the clock runs from just before it to the
 * end of the last execution. Every process records each execution's start and end (inside the task, on the
 * common clock `performance.timeOrigin + performance.now()`, offsets measured over IPC), each fetch, unlock
 * and park; `analyse` turns them into makespan, fetches, hand-offs, overlap and FIFO figures. A warm-up of
 * each variant, then BENCH_ROUNDS alternating rounds (medians), then one raise run stopped at a time limit.
 */
import { highestConcurrency } from "../scripts/overlap.js";
import type { Locks } from "../src/index.js";
import { library } from "./library.js";
import {
  countJobs,
  fmtFixed,
  fmtInt,
  fmtPercent,
  forkWorkers,
  median,
  quietLogger,
  resetJobs,
  round,
  sleep,
  spread,
  type BenchContext,
  type Goal,
  type Section,
  type SectionResult,
  type Table,
  type WorkerProcess,
  benchRounds,
} from "./lib.js";
import {
  QUEUE_TASK,
  STRATEGY_TASKS,
  TASK_MS,
  clock,
  strategyOptions,
  type ContentionPayload,
  type ExecutionRecord,
  type FetchRecord,
  type WorkerRecords,
} from "./contention-worker.js";

const WORKER_SCRIPT = new URL("./contention-worker.ts", import.meta.url);
const PROCESSES = 3;
const CONCURRENCY = 8;
const KEYS = 10;
/** graphile-worker's default: jobs due in the future (safety nets, retries) are found by polling. */
const POLL_INTERVAL_MS = 2000;
/**
 * The second anchor's: graphile-worker does not NOTIFY when a named queue frees, and a worker fetches its
 * next job before its completion (which unlocks the queue) has committed, so a queue can sit until a poll.
 */
const FAST_POLL_INTERVAL_MS = 100;
const ROUNDS = benchRounds(3);

const SIZES = {
  full: { jobs: 2000, warmJobs: 200, raiseLimitMs: 45_000 },
  quick: { jobs: 200, warmJobs: 50, raiseLimitMs: 6_000 },
};

interface Variant {
  id: string;
  label: string;
  task: string;
  /** One named queue per key (the anchor). */
  queues: boolean;
  /** graphile-worker's poll interval for this run (the runners are restarted when it changes). */
  pollInterval: number;
  /**
   * Whether the jobs carry their key's flag and the runners skip the keys their process holds
   * (`forbiddenFlags: locks.forbiddenFlags`; the runners are restarted when it changes).
   */
  skipHeld?: boolean;
  /**
   * Enqueued with `locks.addJobs` (a Locks instance of the bench's, the task defined as the workers define
   * it) instead of graphile-worker's `add_jobs`: the jobs after each key's first are added waiting in line.
   */
  viaLocks?: boolean;
}

const def = (id: string, label: string, task: string, more: Partial<Variant> = {}): Variant => ({
  id,
  label,
  task,
  queues: task === QUEUE_TASK,
  pollInterval: POLL_INTERVAL_MS,
  ...more,
});
const VARIANTS = {
  drop: def("drop", "drop", STRATEGY_TASKS.drop),
  reschedule: def("reschedule", "reschedule", STRATEGY_TASKS.reschedule),
  rescheduleLine: def(
    "rescheduleLine",
    "reschedule, enqueued with locks.addJobs",
    STRATEGY_TASKS.reschedule,
    { viaLocks: true },
  ),
  rescheduleSkip: def(
    "rescheduleSkip",
    "reschedule, forbiddenFlags: locks.forbiddenFlags",
    STRATEGY_TASKS.reschedule,
    { skipHeld: true },
  ),
  raise: def("raise", "raise", STRATEGY_TASKS.raise),
  queueName: def("queueName", "graphile-worker queueName (anchor)", QUEUE_TASK),
  queueName100: def(
    "queueName100",
    `graphile-worker queueName, poll ${FAST_POLL_INTERVAL_MS} ms (anchor)`,
    QUEUE_TASK,
    { pollInterval: FAST_POLL_INTERVAL_MS },
  ),
};
type VariantId = keyof typeof VARIANTS;
const VARIANT_IDS = Object.keys(VARIANTS) as VariantId[];

/** BENCH_CONTENTION (comma-separated variant ids) runs only those variants, for experiments. */
const wanted: VariantId[] = process.env.BENCH_CONTENTION
  ? (process.env.BENCH_CONTENTION.split(",").filter((v) =>
      (VARIANT_IDS as string[]).includes(v),
    ) as VariantId[])
  : VARIANT_IDS;

const GOALS = {
  fetchesPerExecuted: 2,
  makespanOverIdeal: 1.1,
  handoffP50Ms: 5,
  handoffP99Ms: 50,
  outOfOrderPerKey: 1,
};

// ---------------------------------------------------------------------------------------------------------
// Worker processes

/** The runners' current settings, the same in every worker process. */
const runnerSettings = { pollInterval: POLL_INTERVAL_MS, skipHeld: false };

/**
 * Offset of each process's clock from ours: over IPC, the sample with the shortest round trip, offset =
 * theirs − midpoint of ours; its uncertainty is half that round trip.
 */
async function clockOffsets(
  workers: WorkerProcess[],
): Promise<Array<{ name: string; offsetMs: number; uncertaintyMs: number }>> {
  const result = [];
  for (const w of workers) {
    let best = { offsetMs: Number.NaN, uncertaintyMs: Number.POSITIVE_INFINITY };
    for (let i = 0; i < 10; i++) {
      const sent = clock();
      const theirs = await w.request<number>({ type: "clock" });
      const received = clock();
      if ((received - sent) / 2 < best.uncertaintyMs) {
        best = {
          offsetMs: theirs - (sent + received) / 2,
          uncertaintyMs: (received - sent) / 2,
        };
      }
    }
    result.push({
      name: w.name,
      offsetMs: round(best.offsetMs, 3),
      uncertaintyMs: round(best.uncertaintyMs, 3),
    });
  }
  return result;
}

// ---------------------------------------------------------------------------------------------------------
// One run

interface Quantiles {
  n: number;
  p50: number;
  p90: number;
  p99: number;
  max: number;
  mean: number;
}

export type RunFigures = ReturnType<typeof analyse>;

function quantiles(values: number[]): Quantiles {
  if (values.length === 0) {
    return { n: 0, p50: Number.NaN, p90: Number.NaN, p99: Number.NaN, max: Number.NaN, mean: 0 };
  }
  const sorted = [...values].sort((a, b) => a - b);
  const at = (p: number) => {
    const index = (sorted.length - 1) * p;
    const lo = Math.floor(index);
    const hi = Math.ceil(index);
    return sorted[lo]! + (sorted[hi]! - sorted[lo]!) * (index - lo);
  };
  const r = (v: number) => round(v, 2);
  return {
    n: values.length,
    p50: r(at(0.5)),
    p90: r(at(0.9)),
    p99: r(at(0.99)),
    max: r(sorted.at(-1)!),
    mean: r(values.reduce((a, b) => a + b, 0) / values.length),
  };
}

/** Length of the longest strictly increasing subsequence (patience sorting). */
function longestIncreasing(values: readonly number[]): number {
  const tails: number[] = [];
  for (const v of values) {
    let lo = 0;
    let hi = tails.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (tails[mid]! < v) lo = mid + 1;
      else hi = mid;
    }
    tails[lo] = v;
  }
  return tails.length;
}

/** The bench's own Locks instance, for the variants enqueued through it (one per run of the section). */
let enqueuers: { ctx: BenchContext; locks: Locks; tasks: Set<string> } | null = null;

function enqueuer(ctx: BenchContext, strategy: keyof typeof STRATEGY_TASKS): Locks {
  const task = STRATEGY_TASKS[strategy];
  if (enqueuers?.ctx !== ctx) {
    enqueuers = {
      ctx,
      locks: library.makeLocks({ connectionString: ctx.url, logger: quietLogger }),
      tasks: new Set(),
    };
  }
  const { locks, tasks } = enqueuers;
  if (!tasks.has(task)) {
    // As the workers define it: the definition is what addJobs reads.
    locks.exclusive<ContentionPayload>(task, async () => undefined, strategyOptions(strategy));
    tasks.add(task);
  }
  return locks;
}

/**
 * Inserts the jobs in one statement; resolves each job's rank in the enqueue order (job id order) by its
 * payload's `seq` (a parked copy has a new id but the same payload).
 */
async function insertContentionJobs(
  ctx: BenchContext,
  variant: Variant,
  jobs: number,
): Promise<Map<number, number>> {
  if (variant.viaLocks) {
    // (only `reschedule` jobs are added waiting in line: the variants enqueued this way are of that task)
    const locks = enqueuer(ctx, "reschedule");
    const results = await locks.addJobs(
      Array.from({ length: jobs }, (_, index) => ({
        identifier: variant.task,
        payload: { k: `k${index % KEYS}`, seq: index + 1 },
      })),
    );
    const ranked = results
      .map((r, index) => ({ id: BigInt(r.job!.id), seq: index + 1 }))
      .sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    return new Map(ranked.map((r, index) => [r.seq, index + 1]));
  }
  // Round-robin over the keys: job i (1-based) has key k((i − 1) mod KEYS) and seq i. add_jobs does not
  // assign ids in array order (it joins the specs with the task and queue tables), hence the ranks. With
  // skipHeld, each job carries its key's flag, as `locks.addJob` gives it.
  const flags = variant.skipHeld
    ? Array.from({ length: KEYS }, (_, k) =>
        library.lockFlag(library.lockKey(variant.task, `k${k}`)),
      )
    : null;
  const { rows } = await ctx.pool.query<{ id: string; seq: number }>(
    `select j.id::text as id, (j.payload->>'seq')::int as seq from graphile_worker.add_jobs(
       array(select row($1::text,
                        json_build_object('k', 'k' || ((i - 1) % $3::int), 'seq', i),
                        case when $4::boolean then 'cx:k' || ((i - 1) % $3::int) end,
                        null, null, null, null,
                        case when $5::text[] is not null
                          then array[($5::text[])[(i - 1) % $3::int + 1]] end)::graphile_worker.job_spec
             from generate_series(1, $2::int) as i order by i)) as j`,
    [variant.task, jobs, KEYS, variant.queues, flags],
  );
  rows.sort((a, b) => Number(BigInt(a.id) - BigInt(b.id)));
  return new Map(rows.map((r, index) => [r.seq, index + 1]));
}

async function measure(
  ctx: BenchContext,
  workers: WorkerProcess[],
  variant: Variant,
  jobs: number,
  roundNumber: number,
  limitMs: number | null,
): Promise<RunFigures> {
  const skipHeld = variant.skipHeld ?? false;
  if (
    runnerSettings.pollInterval !== variant.pollInterval ||
    runnerSettings.skipHeld !== skipHeld
  ) {
    const settings = { pollInterval: variant.pollInterval, skipHeld };
    await Promise.all(workers.map((w) => w.request({ type: "poll", ...settings })));
    Object.assign(runnerSettings, settings);
  }
  await resetJobs(ctx.pool);
  // Waiters of earlier runs (their jobs are gone): not to be woken by this run's releases.
  await ctx.pool.query("delete from graphile_worker_locks.waiters");
  await Promise.all(workers.map((w) => w.request({ type: "reset" })));

  const t0 = clock();
  const rankOf = await insertContentionJobs(ctx, variant, jobs);
  const deadline = t0 + (limitMs ?? 120_000);
  let left = 0;
  for (;;) {
    if ((await countJobs(ctx.pool)) === 0) break;
    if (clock() > deadline) {
      if (limitMs === null) {
        throw new Error(`contention ${variant.id}: jobs still queued after 120 s`);
      }
      // Time limit: delete the jobs not running; those running finish (or fail, and are deleted next).
      for (;;) {
        const { rowCount } = await ctx.pool.query(
          "delete from graphile_worker._private_jobs where locked_at is null",
        );
        left += rowCount ?? 0;
        if ((await countJobs(ctx.pool)) === 0) break;
        await sleep(20);
      }
      break;
    }
    await sleep(10);
  }
  const drainedMs = clock() - t0;

  const records: WorkerRecords[] = [];
  for (const w of workers) records.push(await w.request<WorkerRecords>({ type: "collect" }));
  return analyse(variant, roundNumber, jobs, limitMs, left, t0, drainedMs, records, rankOf);
}

function analyse(
  variant: Variant,
  roundNumber: number,
  jobs: number,
  limitMs: number | null,
  left: number,
  t0: number,
  drainedMs: number,
  records: WorkerRecords[],
  rankOf: Map<number, number>,
) {
  const task = variant.task;
  const executions: ExecutionRecord[] = [];
  const processOf = new Map<ExecutionRecord, string>();
  for (const r of records) {
    for (const e of r.executions) {
      if (e.task !== task) continue;
      executions.push(e);
      processOf.set(e, r.name);
    }
  }
  const fetches = records.flatMap((r) => r.fetches).filter((f) => f.task === task);
  const releases = new Map(records.flatMap((r) => r.releases));
  const fetchOf = new Map<string, FetchRecord>(fetches.map((f) => [`${f.jobId}/${f.attempts}`, f]));
  const firstFetchOf = new Map<number, number>();
  for (const f of fetches)
    firstFetchOf.set(f.seq, Math.min(firstFetchOf.get(f.seq) ?? Infinity, f.at));
  const sum = (what: string, t = task) =>
    records.reduce((total, r) => total + (r.counters[t]?.[what] ?? 0), 0);

  const byKey = new Map<string, ExecutionRecord[]>();
  for (const e of executions) {
    const list = byKey.get(e.k) ?? [];
    list.push(e);
    byKey.set(e.k, list);
  }
  const allFetchedOnceAt =
    firstFetchOf.size === jobs ? Math.max(...firstFetchOf.values()) : Number.POSITIVE_INFINITY;
  let busiest: ExecutionRecord[] = [];
  for (const list of byKey.values()) if (list.length > busiest.length) busiest = list;

  const handoffs: number[] = [];
  const where = { sameProcess: [] as number[], otherProcess: [] as number[] };
  const when = { firstPass: [] as number[], afterFirstPass: [] as number[] };
  const unlock: number[] = [];
  const nextFetch: number[] = [];
  const fetchToStart: number[] = [];
  let maxPerKey = 0;
  let outOfOrder = 0;
  for (const list of byKey.values()) {
    list.sort((a, b) => a.start - b.start);
    maxPerKey = Math.max(maxPerKey, highestConcurrency(list));
    const ranks = list.map((e) => rankOf.get(e.seq)!);
    outOfOrder += ranks.length - longestIncreasing(ranks);
    for (let i = 1; i < list.length; i++) {
      const previous = list[i - 1]!;
      const next = list[i]!;
      const gap = next.start - previous.end;
      handoffs.push(gap);
      where[processOf.get(next) === processOf.get(previous) ? "sameProcess" : "otherProcess"].push(
        gap,
      );
      when[next.start <= allFetchedOnceAt ? "firstPass" : "afterFirstPass"].push(gap);
      const released = releases.get(previous.jobId);
      if (released !== undefined) unlock.push(released - previous.end);
      const fetch = fetchOf.get(`${next.jobId}/${next.attempts}`);
      if (fetch) {
        nextFetch.push(fetch.at - previous.end);
        fetchToStart.push(next.start - fetch.at);
      }
    }
  }

  const executed = executions.length;
  const idealMs = busiest.length * TASK_MS;
  const makespanMs = executed > 0 ? Math.max(...executions.map((e) => e.end)) - t0 : Number.NaN;
  const durations = executions.map((e) => e.end - e.start);
  const rescheduled = sum("rescheduled");
  return {
    variant: variant.id as VariantId,
    round: roundNumber,
    jobs,
    limitMs,
    left,
    executed,
    busiestKey: busiest.length,
    idealMs,
    busiestKeyWorkMs: round(
      busiest.reduce((total, e) => total + e.end - e.start, 0),
      1,
    ),
    meanExecutionMs: round(durations.reduce((a, b) => a + b, 0) / Math.max(1, executed), 2),
    makespanMs: round(makespanMs, 1),
    makespanOverIdeal: round(makespanMs / idealMs, 3),
    firstStartMs: round(Math.min(...executions.map((e) => e.start)) - t0, 1),
    drainedMs: round(drainedMs, 1),
    fetches: fetches.length,
    fetchesPerExecuted: round(fetches.length / Math.max(1, executed), 3),
    fetchesPerJob: round(fetches.length / jobs, 3),
    conflicts: sum("conflicts"),
    localConflicts: sum("localConflicts"),
    rescheduled,
    reschedulesPerExecuted: round(rescheduled / Math.max(1, executed), 3),
    dropped: sum("dropped"),
    errors: sum("errors"),
    handoffMs: quantiles(handoffs),
    breakdown: {
      unlockMs: quantiles(unlock),
      nextFetchMs: quantiles(nextFetch),
      fetchToStartMs: quantiles(fetchToStart),
    },
    handoffWhere: {
      sameProcess: quantiles(where.sameProcess),
      otherProcess: quantiles(where.otherProcess),
      firstPass: quantiles(when.firstPass),
      afterFirstPass: quantiles(when.afterFirstPass),
    },
    workerCpuMs: round(
      records.reduce((total, r) => total + r.cpuMs, 0),
      0,
    ),
    maxPerKey,
    outOfOrder,
  };
}

// ---------------------------------------------------------------------------------------------------------
// The section

export type VariantFigures = ReturnType<typeof summarise>;

function summarise(variant: VariantId, runs: RunFigures[]) {
  const mine = runs.filter((r) => r.variant === variant && r.round > 0);
  const m = (f: (r: RunFigures) => number, digits?: number) => {
    const value = median(mine.map(f));
    return digits === undefined ? value : round(value, digits);
  };
  return {
    variant,
    rounds: mine.length,
    executed: m((r) => r.executed),
    busiestKey: m((r) => r.busiestKey),
    idealMs: m((r) => r.idealMs),
    makespanMs: m((r) => r.makespanMs, 1),
    makespanSpread: round(spread(mine.map((r) => r.makespanMs)), 3),
    makespanOverIdeal: m((r) => r.makespanOverIdeal, 3),
    drainedMs: m((r) => r.drainedMs, 1),
    fetchesPerExecuted: m((r) => r.fetchesPerExecuted, 3),
    fetchesPerJob: m((r) => r.fetchesPerJob, 3),
    reschedulesPerExecuted: m((r) => r.reschedulesPerExecuted, 3),
    handoffP50Ms: m((r) => r.handoffMs.p50, 2),
    handoffP99Ms: m((r) => r.handoffMs.p99, 2),
    meanExecutionMs: m((r) => r.meanExecutionMs, 2),
    workerCpuMs: m((r) => r.workerCpuMs),
    maxPerKey: Math.max(...mine.map((r) => r.maxPerKey)),
    outOfOrder: m((r) => r.outOfOrder),
    left: m((r) => r.left),
  };
}

export const contention: Section = {
  id: "contention",
  title: "Contention: many jobs over few keys, across processes",
  async run(ctx): Promise<SectionResult> {
    const size = ctx.quick ? SIZES.quick : SIZES.full;
    const rounds = ctx.quick ? 1 : ROUNDS;
    ctx.log(`contention: starting ${PROCESSES} worker processes (concurrency ${CONCURRENCY} each)`);
    const workers = await forkWorkers(WORKER_SCRIPT, PROCESSES, {
      DATABASE_URL: ctx.url,
      CONCURRENCY: String(CONCURRENCY),
      POLL_INTERVAL: String(POLL_INTERVAL_MS),
    });
    Object.assign(runnerSettings, { pollInterval: POLL_INTERVAL_MS, skipHeld: false });
    const runs: RunFigures[] = [];
    let offsets: Awaited<ReturnType<typeof clockOffsets>> = [];
    try {
      offsets = await clockOffsets(workers);
      ctx.log(
        `contention: clock offsets ${offsets.map((o) => `${o.name} ${o.offsetMs} ms ±${o.uncertaintyMs}`).join(", ")}`,
      );
      const alternating = [
        "drop",
        "reschedule",
        "rescheduleLine",
        "rescheduleSkip",
        "queueName",
        "queueName100",
      ].filter((v) => wanted.includes(v as VariantId)) as VariantId[];
      const one = async (variant: VariantId, jobs: number, r: number, limitMs: number | null) => {
        const figures = await measure(ctx, workers, VARIANTS[variant], jobs, r, limitMs);
        ctx.log(
          `contention: ${r === 0 ? "warm-up" : `round ${r}`} ${variant.padEnd(10)} ` +
            `${fmtInt(figures.executed)} executed, makespan ${(figures.makespanMs / 1000).toFixed(2)} s ` +
            `(ideal ${(figures.idealMs / 1000).toFixed(2)} s), ${figures.fetches} fetches, ` +
            `hand-off p50 ${fmtFixed(figures.handoffMs.p50, 1)} ms p99 ${fmtFixed(figures.handoffMs.p99, 1)} ms, ` +
            `max per key ${figures.maxPerKey}`,
        );
        if (figures.maxPerKey > 1) {
          ctx.log(
            `contention: OVERLAP: ${variant} ran ${figures.maxPerKey} executions of a key at once`,
          );
        }
        runs.push(figures);
      };
      for (const variant of alternating) await one(variant, size.warmJobs, 0, null);
      for (let r = 1; r <= rounds; r++) {
        for (const variant of alternating) await one(variant, size.jobs, r, null);
      }
      if (wanted.includes("raise")) await one("raise", size.jobs, 1, size.raiseLimitMs);
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
      await enqueuers?.locks.release();
      enqueuers = null;
    }

    const summaries = wanted.map((v) => summarise(v, runs));
    return {
      tables: tables(summaries, runs, offsets, size, rounds),
      goals: goals(summaries, runs),
      figures: {
        processes: PROCESSES,
        concurrency: CONCURRENCY,
        keys: KEYS,
        taskMs: TASK_MS,
        pollIntervalMs: POLL_INTERVAL_MS,
        jobs: size.jobs,
        raiseLimitMs: size.raiseLimitMs,
        rounds,
        clockOffsets: offsets,
        summaries,
        runs,
      },
    };
  },
};

function tables(
  summaries: VariantFigures[],
  runs: RunFigures[],
  offsets: Array<{ name: string; offsetMs: number; uncertaintyMs: number }>,
  size: (typeof SIZES)["full"],
  rounds: number,
): Table[] {
  const s = (ms: number) => fmtFixed(ms / 1000, 2);
  const ms = (v: number) => fmtFixed(v, 1);
  const raise = runs.find((r) => r.variant === "raise");
  const label = (v: VariantFigures) =>
    v.variant === "raise"
      ? `raise (stopped at ${size.raiseLimitMs / 1000} s, 1 run)`
      : VARIANTS[v.variant].label;
  const summary: Table = {
    title:
      `Contention: ${fmtInt(size.jobs)} jobs over ${KEYS} keys, ${TASK_MS} ms tasks, ${PROCESSES} processes × ` +
      `concurrency ${CONCURRENCY} (median of ${rounds} runs; raise: 1 run)`,
    columns: [
      { header: "variant", align: "left" },
      { header: "executed", align: "right" },
      { header: "busiest key", align: "right" },
      { header: "makespan s", align: "right" },
      { header: "ideal s", align: "right" },
      { header: "makespan/ideal", align: "right" },
      { header: "fetches/executed", align: "right" },
      { header: "fetches/job", align: "right" },
      { header: "reschedules/executed", align: "right" },
      { header: "hand-off p50 ms", align: "right" },
      { header: "p99 ms", align: "right" },
      { header: "max per key", align: "right" },
      { header: "out of order", align: "right" },
      { header: "worker CPU s", align: "right" },
    ],
    rows: summaries.map((v) => [
      label(v),
      fmtInt(v.executed),
      fmtInt(v.busiestKey),
      `${s(v.makespanMs)}${v.rounds > 1 ? ` ±${fmtPercent(v.makespanSpread)}` : ""}`,
      s(v.idealMs),
      fmtFixed(v.makespanOverIdeal, 2),
      fmtFixed(v.fetchesPerExecuted, 2),
      fmtFixed(v.fetchesPerJob, 2),
      v.variant.startsWith("reschedule") ? fmtFixed(v.reschedulesPerExecuted, 2) : "",
      ms(v.handoffP50Ms),
      ms(v.handoffP99Ms),
      String(v.maxPerKey),
      fmtInt(v.outOfOrder),
      s(v.workerCpuMs),
    ]),
    notes: [
      `ideal: the busiest key's executions × ${TASK_MS} ms. reschedule and the anchors execute every job, so 200 × ${TASK_MS} ms;`,
      "drop executes few jobs by design (the rest are dropped), so its ideal is only the busiest key's executed work, not",
      `a target: what matters is that it empties the queue (in ${s(summaries.find((v) => v.variant === "drop")?.drainedMs ?? Number.NaN)} s) without running two of a key at once.`,
      raise
        ? `raise: graphile-worker retries a conflict after e^attempts s (2.7, 7.4, 20, 55 s); the run was stopped at ` +
          `${size.raiseLimitMs / 1000} s and the ${fmtInt(raise.left)} job(s) still queued deleted: its figures cover what ran by then.`
        : "",
      "makespan: from just before the jobs were inserted (one add_jobs statement) to the end of the last execution.",
      `fetches: graphile-worker job:start events (a worker locked a job row), whatever came of it: execution, drop, park, failure.`,
      "hand-off: (start of execution n+1) − (end of execution n) over consecutive executions of a key, all keys pooled.",
      "max per key: the most executions of one key at the same instant, worst run (1 = no overlap).",
      "out of order: the fewest executions that would have to move for each key's to run in job id order, summed over",
      "the keys; reschedule's goal allows one per key (a key's first jobs race for it before any of them has waited).",
      "worker CPU: CPU time (user + system) of the three worker processes over the run (this machine has 2 cores).",
      `mean execution: ${summaries
        .map((v) => `${v.variant} ${fmtFixed(v.meanExecutionMs, 2)} ms`)
        .join(", ")} (setTimeout(${TASK_MS}) overshoots).`,
      ...(process.env.BENCH_RESCHEDULE
        ? [
            `BENCH_RESCHEDULE: reschedule options ${process.env.BENCH_RESCHEDULE} instead of the defaults.`,
          ]
        : []),
      `Poll interval ${POLL_INTERVAL_MS} ms (graphile-worker's default) except where said. Clock offsets of the worker processes from the bench's: ` +
        offsets
          .map((o) => `${o.name} ${fmtFixed(o.offsetMs, 2)} ±${fmtFixed(o.uncertaintyMs, 2)} ms`)
          .join(", ") +
        ".",
    ].filter((n) => n.length > 0),
  };

  const measured = runs.filter((r) => r.round > 0);
  const pick = (variant: VariantId) => {
    const mine = measured.filter((r) => r.variant === variant);
    // The run with the median makespan.
    return [...mine].sort((a, b) => a.makespanMs - b.makespanMs)[(mine.length - 1) >> 1];
  };
  const q = (x: Quantiles) => `${ms(x.p50)} / ${ms(x.p99)}`;
  const nMean = (x: Quantiles) => (x.n > 0 ? `${fmtInt(x.n)}, ${ms(x.mean)}` : "0");
  const picked = VARIANT_IDS.flatMap((variant) => {
    const r = pick(variant);
    return r ? [r] : [];
  });
  const breakdown: Table = {
    title:
      "Contention: where a hand-off's time goes (the run with the median makespan; p50 / p99, ms)",
    columns: [
      { header: "variant", align: "left" },
      { header: "hand-offs", align: "right" },
      { header: "end → unlock answered", align: "right" },
      { header: "end → next fetched", align: "right" },
      { header: "fetched → started", align: "right" },
      { header: "end → next started", align: "right" },
      { header: "same process / other: n, mean", align: "right" },
      { header: "first pass / after: n, mean", align: "right" },
    ],
    rows: picked.map((r) => [
      r.variant,
      fmtInt(r.handoffMs.n),
      r.breakdown.unlockMs.n > 0 ? q(r.breakdown.unlockMs) : "–",
      q(r.breakdown.nextFetchMs),
      q(r.breakdown.fetchToStartMs),
      q(r.handoffMs),
      `${nMean(r.handoffWhere.sameProcess)} / ${nMean(r.handoffWhere.otherProcess)}`,
      `${nMean(r.handoffWhere.firstPass)} / ${nMean(r.handoffWhere.afterFirstPass)}`,
    ]),
    notes: [
      "end: the task body returned (execution n); unlock answered: its lock statement (unlock + wake of the key's oldest",
      "waiter + NOTIFY) came back; next fetched: a worker locked the row of execution n+1's job; started: it took the lock.",
      "same process / other: where execution n+1 ran against execution n; first pass: execution n+1 started before every",
      "job had been fetched once (while first fetches park the jobs of held keys); means in ms.",
    ],
  };

  return [summary, breakdown];
}

function goals(summaries: VariantFigures[], runs: RunFigures[]): Goal[] {
  const goal = (name: string, target: string, value: number, threshold: number): Goal => ({
    section: "contention",
    ...{ name, target, value, threshold },
    met: value <= threshold,
  });
  const { fetchesPerExecuted, makespanOverIdeal, handoffP50Ms, handoffP99Ms } = GOALS;
  const outOfOrder = GOALS.outOfOrderPerKey * KEYS;
  const rescheduleGoals = (r: VariantFigures): Goal[] => {
    const name = VARIANTS[r.variant].label;
    const worst = runs.filter((x) => x.variant === r.variant && x.round > 0);
    return [
      goal(
        `${name}: no hot loop`,
        `fetches per executed job ≤ ${fetchesPerExecuted}`,
        r.fetchesPerExecuted,
        fetchesPerExecuted,
      ),
      goal(
        `${name}: makespan`,
        `makespan/ideal ≤ ${fmtFixed(makespanOverIdeal, 2)}`,
        r.makespanOverIdeal,
        makespanOverIdeal,
      ),
      goal(`${name}: hand-off p50`, `≤ ${handoffP50Ms} ms`, r.handoffP50Ms, handoffP50Ms),
      goal(`${name}: hand-off p99`, `≤ ${handoffP99Ms} ms`, r.handoffP99Ms, handoffP99Ms),
      goal(
        `${name}: FIFO per key`,
        `executions out of enqueue order ≤ ${GOALS.outOfOrderPerKey} per key (${outOfOrder}), worst run`,
        Math.max(...worst.map((x) => x.outOfOrder)),
        outOfOrder,
      ),
    ];
  };
  const rescheduling = summaries.filter(
    (v) => VARIANTS[v.variant].task === STRATEGY_TASKS.reschedule,
  );
  return [
    ...rescheduling.flatMap(rescheduleGoals),
    goal(
      "no overlap per key (every run, every variant)",
      "max executions of one key at once ≤ 1",
      Math.max(...runs.map((x) => x.maxPerKey)),
      1,
    ),
  ];
}
