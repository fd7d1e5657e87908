/**
 * Section "contention": 2,000 jobs over 10 keys, 20 ms tasks, 3 worker processes (contention-worker.ts)
 * × concurrency 8, per conflict strategy and against graphile-worker's queueName anchors (method and
 * variants: bench/README.md). The jobs go in with one statement; the clock runs from just before it to the
 * end of the last execution. The processes record each execution, fetch, unlock and park on the machine's
 * monotonic clock; `analyse` turns them into makespan, fetches, hand-offs, overlap and FIFO
 * figures. A warm-up of each variant, then BENCH_ROUNDS rounds alternating them (medians), then one raise
 * run stopped at a time limit. BENCH_CONTENTION=<variant ids> runs only those variants.
 *
 * The line variants (`line*`, issue 32's configuration: 1,200 jobs over 8 keys) and the hot key (3,000 jobs
 * of 2 ms on one key, 2 processes) also break each hand-off down into stages (`stages`), from the lock
 * session's timing probe: the previous job's end, its unlock sent and answered, the next job's wake (its
 * fetch, the release's notification, or the key passed in memory), its hold granted, its body entered.
 *
 * Beside each of issue 32's goals stands its floor, measured in the same run by the worker processes
 * (contention-worker.ts, `Floors`): a hand-off cannot go under one lock-statement round trip (even a key
 * passed in memory waits for the answer of a lock statement sent after the pass: the check that closes the
 * overlap of test/session/handover-loss.test.ts), nor, between processes, under a notification's latency
 * plus that round trip; a job not yet fetched adds graphile-worker's fetch. A makespan cannot go under the
 * busiest key's executions end to end with one round trip between each two (`floors`), counted at the round
 * trip's mean: a makespan is a sum of hand-offs, and a sum goes with the mean, not the median. Each goal is then
 * met, missed, or below its floor (no design that keeps those checks can meet it on that machine then).
 */
import { highestConcurrency } from "../scripts/overlap.js";
import type { Locks } from "../src/index.js";
import { library } from "./library.js";
import { benchRounds, countJobs, fmtFixed, fmtInt, fmtPercent, goal, median } from "./lib.js";
import {
  machineClock as clock,
  quietLogger,
  resetJobs,
  round,
  sizedSection,
  sleep,
  spread,
  table,
} from "./lib.js";
import { withWorkers, type BenchContext, type Table, type WorkerProcess } from "./lib.js";
import { resetServerStats, serverStatsTables } from "./server-stats.js";
import { QUEUE_TASK, STRATEGY_TASKS, TASK_MS, strategyOptions } from "./contention-worker.js";
import type { ContentionPayload, Mark, Stages, WorkerRecords } from "./contention-worker.js";

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
const SIZES = {
  full: { jobs: 2000, warmJobs: 200, raiseLimitMs: 45_000 },
  quick: { jobs: 200, warmJobs: 50, raiseLimitMs: 6_000 },
};

interface Variant {
  label: string;
  task: string;
  /** graphile-worker's poll interval (the runners are restarted when it changes). */
  pollInterval?: number;
  /** The jobs carry their key's flag and the runners skip the keys their process holds (`forbiddenFlags`). */
  skipHeld?: boolean;
  /** Enqueued with `locks.addJobs`, which adds the jobs after each key's first waiting in line. */
  viaLocks?: boolean;
  /** Its own shape instead of the section's: jobs (full size), keys, task ms, worker processes. */
  shape?: Shape;
  /** The runners fetch in batches into graphile-worker's local queue (50), lock-ahead attached. */
  localQueue?: boolean;
}

interface Shape {
  jobs: number;
  keys: number;
  taskMs: number;
  processes: number;
}

/** Issue 32's configuration of a contended line, and its hot key. */
const LINE: Shape = { jobs: 1200, keys: 8, taskMs: TASK_MS, processes: PROCESSES };
const HOT: Shape = { jobs: 3000, keys: 1, taskMs: 2, processes: 2 };

const VARIANTS = {
  drop: { label: "drop", task: STRATEGY_TASKS.drop },
  reschedule: { label: "reschedule", task: STRATEGY_TASKS.reschedule },
  rescheduleLine: {
    label: "reschedule, enqueued with locks.addJobs",
    task: STRATEGY_TASKS.reschedule,
    viaLocks: true,
  },
  rescheduleSkip: {
    label: "reschedule, forbiddenFlags: locks.forbiddenFlags",
    task: STRATEGY_TASKS.reschedule,
    skipHeld: true,
  },
  raise: { label: "raise", task: STRATEGY_TASKS.raise },
  queueName: { label: "graphile-worker queueName (anchor)", task: QUEUE_TASK },
  queueName100: {
    label: `graphile-worker queueName, poll ${FAST_POLL_INTERVAL_MS} ms (anchor)`,
    task: QUEUE_TASK,
    pollInterval: FAST_POLL_INTERVAL_MS,
  },
  line: {
    label: "line 1,200/8: reschedule, enqueued with locks.addJobs",
    task: STRATEGY_TASKS.reschedule,
    viaLocks: true,
    shape: LINE,
  },
  lineAddJobs: {
    label: "line 1,200/8: reschedule, enqueued with add_jobs",
    task: STRATEGY_TASKS.reschedule,
    shape: LINE,
  },
  lineQueue: {
    label: `line 1,200/8: graphile-worker queueName, poll ${FAST_POLL_INTERVAL_MS} ms (anchor)`,
    task: QUEUE_TASK,
    pollInterval: FAST_POLL_INTERVAL_MS,
    shape: LINE,
  },
  hotKey: {
    label: "hot key 3,000 × 2 ms, 2 processes: reschedule, locks.addJobs",
    task: STRATEGY_TASKS.reschedule,
    viaLocks: true,
    shape: HOT,
  },
  hotKeyLocal: {
    label: "hot key 3,000 × 2 ms, 2 processes, localQueue 50: reschedule, add_jobs",
    task: STRATEGY_TASKS.reschedule,
    localQueue: true,
    shape: HOT,
  },
} satisfies Record<string, Variant>;
type VariantId = keyof typeof VARIANTS;
const VARIANT_IDS = Object.keys(VARIANTS) as VariantId[];
const wanted = VARIANT_IDS.filter((v) =>
  (process.env.BENCH_CONTENTION?.split(",") ?? VARIANT_IDS).includes(v),
);

/** The goals of the section's own reschedule variants: name, target, its figure, the most it may be. */
const GOALS = [
  ["no hot loop", "fetches per executed job ≤ 2", "fetchesPerExecuted", 2],
  ["makespan", "makespan/ideal ≤ 1.10", "makespanOverIdeal", 1.1],
  ["hand-off p50", "≤ 5 ms", "handoffP50Ms", 5],
  ["hand-off p99", "≤ 50 ms", "handoffP99Ms", 50],
  // One per key: a key's first jobs race for it before any of them has waited.
  [
    "FIFO per key",
    `executions out of enqueue order ≤ 1 per key (${KEYS}), worst run`,
    "worstOutOfOrder",
    KEYS,
  ],
] as const;

// ---------------------------------------------------------------------------------------------------------
// One run

/**
 * Inserts the jobs in one statement, round-robin over the keys (job i has key k((i − 1) mod keys) and
 * seq i); resolves each job's rank in the enqueue order (job id order) by its seq (a parked copy has a new
 * id but the same payload). add_jobs does not assign ids in array order (it joins the specs with the task
 * and queue tables), hence the ranks.
 */
async function insertContentionJobs(
  ctx: BenchContext,
  locks: Locks,
  v: Variant,
  jobs: number,
  keys: number,
) {
  let rows: Array<{ id: string; seq: number }>;
  const ms = v.shape?.taskMs;
  if (v.viaLocks) {
    const specs = Array.from({ length: jobs }, (_, i) => ({
      identifier: v.task,
      payload: { k: `k${i % keys}`, seq: i + 1, ...(ms ? { ms } : {}) } satisfies ContentionPayload,
    }));
    rows = (await locks.addJobs(specs)).map((r, i) => ({ id: r.job!.id, seq: i + 1 }));
  } else {
    // With skipHeld, each job carries its key's flag, as `locks.addJob` gives it.
    const flags = v.skipHeld
      ? Array.from({ length: keys }, (_, k) => library.lockFlag(library.lockKey(v.task, `k${k}`)))
      : null;
    ({ rows } = await ctx.pool.query<{ id: string; seq: number }>(
      `select j.id::text as id, (j.payload->>'seq')::int as seq from graphile_worker.add_jobs(
         array(select row($1::text,
                          json_strip_nulls(json_build_object(
                            'k', 'k' || ((i - 1) % $3::int), 'seq', i, 'ms', $6::int)),
                          case when $4::boolean then 'cx:k' || ((i - 1) % $3::int) end,
                          null, null, null, null,
                          case when $5::text[] is not null
                            then array[($5::text[])[(i - 1) % $3::int + 1]] end)::graphile_worker.job_spec
               from generate_series(1, $2::int) as i order by i)) as j`,
      [v.task, jobs, keys, v.task === QUEUE_TASK, flags, ms ?? null],
    ));
  }
  rows.sort((a, b) => Number(BigInt(a.id) - BigInt(b.id)));
  return new Map(rows.map((r, index) => [r.seq, index + 1]));
}

/**
 * How often a run counts the jobs left, to see its end. The makespan is read from the executions, not from
 * this count, so a coarse one costs no precision; a count every 10 ms loaded the server the run measures
 * (figures: bench/README.md, section "The contended line: a hand-off stage by stage").
 */
const END_POLL_MS = 100;

/** Inserts, waits for an empty table (or, with `limitMs`, deletes what has not run by then), collects. */
async function measure(
  ctx: BenchContext,
  locks: Locks,
  workers: WorkerProcess[],
  id: VariantId,
  jobs: number,
  limitMs: number | null,
) {
  await resetJobs(ctx.pool);
  // Waiters of earlier runs (their jobs are gone): not to be woken by this run's releases.
  await ctx.pool.query("delete from graphile_worker_locks.waiters");
  await Promise.all(workers.map((w) => w.request({ type: "reset" })));
  const v: Variant = VARIANTS[id];
  const t0 = clock();
  const rankOf = await insertContentionJobs(ctx, locks, v, jobs, v.shape?.keys ?? KEYS);
  let left = 0;
  while ((await countJobs(ctx.pool)) > 0) {
    if (clock() > t0 + (limitMs ?? 120_000)) {
      if (limitMs === null) throw new Error(`contention ${id}: jobs still queued after 120 s`);
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
    await sleep(END_POLL_MS);
  }
  const records: WorkerRecords[] = [];
  for (const w of workers) records.push(await w.request<WorkerRecords>({ type: "collect" }));
  // (a stopped runner's process probes too: its samples count, it shares the machine)
  return { ...analyse(v.task, jobs, v.shape?.taskMs ?? TASK_MS, t0, records, rankOf), left };
}

/** n, p50, p99 (interpolated) and mean, in ms. */
function quantiles(values: number[]) {
  const sorted = [...values].sort((a, b) => a - b);
  const at = (p: number) => {
    const index = (sorted.length - 1) * p;
    const lo = Math.floor(index);
    return sorted[lo]! + (sorted[Math.ceil(index)]! - sorted[lo]!) * (index - lo);
  };
  const n = values.length;
  if (n === 0) return { n, p50: Number.NaN, p99: Number.NaN, mean: 0 };
  const mean = values.reduce((a, b) => a + b, 0) / n;
  return { n, p50: round(at(0.5), 2), p99: round(at(0.99), 2), mean: round(mean, 2) };
}
type Quantiles = ReturnType<typeof quantiles>;

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

/** A hand-off's stages, each counted from the previous job's end (ms); those not reached are left out. */
const STAGES = ["unlockSent", "unlockAnswered", "woken", "granted", "entered"] as const;
type Stage = (typeof STAGES)[number];

/** The stages of one kind of hand-off, each a list of times from the previous end. */
class StageLists {
  readonly lists = Object.fromEntries(STAGES.map((s) => [s, [] as number[]])) as Record<
    Stage,
    number[]
  >;
  add(end: number, at: Partial<Record<Stage, number | undefined>>): void {
    for (const s of STAGES) if (at[s] !== undefined) this.lists[s].push(at[s] - end);
  }
  quantiles(): Record<Stage, Quantiles> {
    return Object.fromEntries(STAGES.map((s) => [s, quantiles(this.lists[s])])) as Record<
      Stage,
      Quantiles
    >;
  }
}

function analyse(
  task: string,
  jobs: number,
  taskMs: number,
  t0: number,
  records: WorkerRecords[],
  rankOf: Map<number, number>,
) {
  const processOf = new Map<Mark, string>();
  const executions = records.flatMap((r) =>
    r.executions.filter((e) => e.task === task).map((e) => (processOf.set(e, r.name), e)),
  );
  const fetches = records.flatMap((r) => r.fetches).filter((f) => f.task === task);
  const releases = new Map(records.flatMap((r) => r.releases));
  const stagesOf = new Map<string, Stages>(records.flatMap((r) => r.stages ?? []));
  const fetchOf = new Map(fetches.map((f) => [`${f.jobId}/${f.attempts}`, f]));
  const firstFetchOf = new Map<number, number>();
  for (const f of fetches)
    firstFetchOf.set(f.seq, Math.min(firstFetchOf.get(f.seq) ?? Infinity, f.at));
  // Hand-offs after this instant come after every job had been fetched once.
  const allFetchedOnceAt =
    firstFetchOf.size === jobs ? Math.max(...firstFetchOf.values()) : Infinity;
  const byKey = new Map<string, Mark[]>();
  for (const e of executions) byKey.set(e.k, [...(byKey.get(e.k) ?? []), e]);
  const busiest = Math.max(0, ...[...byKey.values()].map((list) => list.length));

  const gaps = {
    handoff: [] as number[],
    sameProcess: [] as number[],
    otherProcess: [] as number[],
    firstPass: [] as number[],
    afterFirstPass: [] as number[],
  };
  const parts = { unlock: [] as number[], nextFetch: [] as number[], fetchToStart: [] as number[] };
  const stages = {
    handedOver: new StageLists(),
    sameProcess: new StageLists(),
    otherProcess: new StageLists(),
  };
  let maxPerKey = 0;
  let outOfOrder = 0;
  for (const list of byKey.values()) {
    list.sort((a, b) => a.at - b.at);
    const spans = list.map((e) => ({ start: e.at, end: e.end! }));
    maxPerKey = Math.max(maxPerKey, highestConcurrency(spans));
    const ranks = list.map((e) => rankOf.get(e.seq)!);
    outOfOrder += ranks.length - longestIncreasing(ranks);
    for (let i = 1; i < list.length; i++) {
      const [previous, next] = [list[i - 1]!, list[i]!];
      const gap = next.at - previous.end!;
      gaps.handoff.push(gap);
      const same = processOf.get(next) === processOf.get(previous);
      gaps[same ? "sameProcess" : "otherProcess"].push(gap);
      gaps[next.at <= allFetchedOnceAt ? "firstPass" : "afterFirstPass"].push(gap);
      const released = releases.get(previous.jobId);
      if (released !== undefined) parts.unlock.push(released - previous.end!);
      const fetch = fetchOf.get(`${next.jobId}/${next.attempts}`);
      if (fetch) {
        parts.nextFetch.push(fetch.at - previous.end!);
        parts.fetchToStart.push(next.at - fetch.at);
      }
      const mine = stagesOf.get(previous.jobId) ?? {};
      const its = stagesOf.get(next.jobId) ?? {};
      if (its.granted !== undefined) {
        const kind =
          its.handedOver !== undefined ? "handedOver" : same ? "sameProcess" : "otherProcess";
        // Woken: the last of its fetch, the release's notification, the key passed in memory.
        const woken = Math.max(
          fetch?.at ?? -Infinity,
          its.noticed ?? -Infinity,
          its.handedOver ?? -Infinity,
        );
        stages[kind].add(previous.end!, {
          unlockSent: mine.unlockSent,
          unlockAnswered: mine.unlockAnswered,
          woken: Number.isFinite(woken) ? woken : undefined,
          granted: its.granted,
          entered: next.at,
        });
      }
    }
  }
  const executed = executions.length;
  const perExecuted = (n: number) => round(n / Math.max(1, executed), 3);
  // The floors: the busiest key's executions end to end (what its jobs ran for, timer overshoot included),
  // with one lock-statement round trip between each two, at its mean (the hand-offs add up); with the
  // median round trip too, the floor as this section gave it before.
  const floors = {
    rtt: quantiles(records.flatMap((r) => r.floors?.rtt ?? [])),
    notify: quantiles(records.flatMap((r) => r.floors?.notify ?? [])),
    fetch: quantiles(records.flatMap((r) => r.floors?.fetch ?? [])),
  };
  const busiestList = [...byKey.values()].find((list) => list.length === busiest) ?? [];
  const busyMs = busiestList.reduce((sum, e) => sum + (e.end! - e.at), 0);
  const makespanFloorMs = busyMs + Math.max(0, busiest - 1) * floors.rtt.mean;
  const makespanFloorP50Ms = busyMs + Math.max(0, busiest - 1) * floors.rtt.p50;
  const idealMs = busiest * taskMs;
  const makespanMs = executed > 0 ? Math.max(...executions.map((e) => e.end!)) - t0 : Number.NaN;
  const q = <K extends string>(values: Record<K, number[]>) =>
    Object.fromEntries(
      Object.entries<number[]>(values).map(([k, v]) => [k, quantiles(v)]),
    ) as Record<K, Quantiles>;
  return {
    executed,
    busiestKey: busiest,
    idealMs,
    makespanMs: round(makespanMs, 1),
    makespanOverIdeal: round(makespanMs / idealMs, 3),
    fetches: fetches.length,
    fetchesPerExecuted: perExecuted(fetches.length),
    fetchesPerJob: round(fetches.length / jobs, 3),
    reschedulesPerExecuted: perExecuted(
      records.reduce((n, r) => n + (r.rescheduled[task] ?? 0), 0),
    ),
    // (the sessions' counts cover every task of the run; one task runs at a time)
    sessionHandoffs: records.reduce<Record<string, number>>((sum, r) => {
      for (const [k, n] of Object.entries(r.handoffs ?? {})) sum[k] = (sum[k] ?? 0) + n;
      return sum;
    }, {}),
    handoffs: q(gaps),
    parts: q(parts),
    stages: {
      handedOver: stages.handedOver.quantiles(),
      sameProcess: stages.sameProcess.quantiles(),
      otherProcess: stages.otherProcess.quantiles(),
    },
    workerCpuMs: round(
      records.reduce((sum, r) => sum + r.cpuMs, 0),
      0,
    ),
    maxPerKey,
    outOfOrder,
    floors,
    busyMs: round(busyMs, 1),
    makespanFloorMs: round(makespanFloorMs, 1),
    makespanFloorP50Ms: round(makespanFloorP50Ms, 1),
  };
}

type RunFigures = Awaited<ReturnType<typeof measure>> & { variant: VariantId; round: number };

/** A variant's measured runs: the median of each figure, the worst run's overlap and order. */
function summarise(variant: VariantId, runs: RunFigures[]) {
  const mine = runs.filter((r) => r.variant === variant && r.round > 0);
  const m = (f: (r: RunFigures) => number, digits = 3) => round(median(mine.map(f)), digits);
  return {
    variant,
    rounds: mine.length,
    executed: m((r) => r.executed),
    busiestKey: m((r) => r.busiestKey),
    idealMs: m((r) => r.idealMs),
    makespanMs: m((r) => r.makespanMs, 1),
    makespanSpread: round(spread(mine.map((r) => r.makespanMs)), 3),
    makespanOverIdeal: m((r) => r.makespanOverIdeal),
    fetchesPerExecuted: m((r) => r.fetchesPerExecuted),
    fetchesPerJob: m((r) => r.fetchesPerJob),
    reschedulesPerExecuted: m((r) => r.reschedulesPerExecuted),
    handoffP50Ms: m((r) => r.handoffs.handoff.p50, 2),
    handoffP99Ms: m((r) => r.handoffs.handoff.p99, 2),
    workerCpuMs: m((r) => r.workerCpuMs),
    maxPerKey: Math.max(...mine.map((r) => r.maxPerKey)),
    stageP50Ms: Object.fromEntries(
      (["handedOver", "sameProcess", "otherProcess"] as const).map((kind) => [
        kind,
        {
          n: m((r) => r.stages[kind].entered.n, 0),
          ...Object.fromEntries(STAGES.map((s) => [s, m((r) => r.stages[kind][s].p50, 2)])),
        },
      ]),
    ) as Record<
      "handedOver" | "sameProcess" | "otherProcess",
      { n: number } & Record<Stage, number>
    >,
    outOfOrder: m((r) => r.outOfOrder),
    worstOutOfOrder: Math.max(...mine.map((r) => r.outOfOrder)),
    rttP50Ms: m((r) => r.floors.rtt.p50, 2),
    rttP99Ms: m((r) => r.floors.rtt.p99, 2),
    rttMeanMs: m((r) => r.floors.rtt.mean, 2),
    notifyP50Ms: m((r) => r.floors.notify.p50, 2),
    fetchP50Ms: m((r) => r.floors.fetch.p50, 2),
    makespanFloorOverIdeal: m((r) => r.makespanFloorMs / r.idealMs),
    makespanFloorP50OverIdeal: m((r) => r.makespanFloorP50Ms / r.idealMs),
    makespanFloorMs: m((r) => r.makespanFloorMs, 1),
  };
}
type VariantFigures = ReturnType<typeof summarise>;

/** One of issue 32's goals beside its floor: what no hand-off that keeps its checks can go under. */
interface FloorGoal {
  name: string;
  target: string;
  value: number;
  most: number;
  /** The floor of the figure, measured in the same runs (NaN: none applies). */
  floor: number;
}

/** A goal's verdict: met, missed though its floor allows it, or set below its floor. */
function verdict(g: FloorGoal): string {
  if (g.value <= g.most) return "met";
  return g.floor > g.most ? "below floor" : "missed";
}

/** Issue 32's goals for the line variants and the hot keys, those of them measured, with their floors. */
function lineGoals(summaries: VariantFigures[]): FloorGoal[] {
  const of = (id: VariantId) => summaries.find((v) => v.variant === id);
  const [line, addJobs, queue, hot, hotLocal] = [
    of("line"),
    of("lineAddJobs"),
    of("lineQueue"),
    of("hotKey"),
    of("hotKeyLocal"),
  ];
  const goals: FloorGoal[] = [];
  const add = (name: string, target: string, value: number, most: number, floor = Number.NaN) =>
    goals.push({ name, target, value, most, floor });
  if (line) {
    const f = line.makespanFloorOverIdeal;
    add("line, locks.addJobs: makespan", "makespan/ideal ≤ 1.15", line.makespanOverIdeal, 1.15, f);
    add("line, locks.addJobs: hand-off p50", "≤ 2 ms", line.handoffP50Ms, 2, line.rttP50Ms);
    add("line, locks.addJobs: hand-off p99", "≤ 20 ms", line.handoffP99Ms, 20, line.rttP99Ms);
    add(
      "line, locks.addJobs: FIFO per key",
      "out of order = 0, worst run",
      line.worstOutOfOrder,
      0,
    );
    add("line, locks.addJobs: fetches", "fetches per job ≤ 1", line.fetchesPerJob, 1, 1);
  }
  if (addJobs) {
    const f = addJobs.makespanFloorOverIdeal;
    add("line, add_jobs: makespan", "makespan/ideal ≤ 1.35", addJobs.makespanOverIdeal, 1.35, f);
  }
  if (line && queue)
    add(
      "line, locks.addJobs: against the queueName anchor",
      "makespan ≤ 0.75 × the anchor's",
      line.makespanMs / queue.makespanMs,
      0.75,
      line.makespanFloorMs / queue.makespanMs,
    );
  for (const [v, name] of [
    [hot, "hot key"],
    [hotLocal, "hot key, localQueue"],
  ] as const) {
    if (!v) continue;
    const f = v.makespanFloorOverIdeal;
    add(`${name}: makespan`, "makespan/ideal ≤ 1.3", v.makespanOverIdeal, 1.3, f);
    add(`${name}: every job once`, "executions − jobs = 0", Math.abs(v.executed - HOT.jobs), 0);
    if (v === hot) add(`${name}: in order`, "out of order = 0, worst run", v.worstOutOfOrder, 0);
    else add(`${name}: fetches`, "fetches per job ≤ 1.1", v.fetchesPerJob, 1.1, 1);
  }
  return goals;
}

// ---------------------------------------------------------------------------------------------------------
// The section

export const contention = sizedSection(
  {
    id: "contention",
    title: "Contention: many jobs over few keys, across processes",
    sizes: SIZES,
    rounds: benchRounds(3),
  },
  async (ctx, size, rounds) => {
    ctx.log(`contention: starting ${PROCESSES} worker processes (concurrency ${CONCURRENCY} each)`);
    // The bench's own Locks instance, for the variants enqueued through it, the task defined as the
    // workers define it (the definition is what addJobs reads).
    const locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
    locks.exclusive(
      STRATEGY_TASKS.reschedule,
      async () => undefined,
      strategyOptions("reschedule"),
    );
    const env = {
      DATABASE_URL: ctx.url,
      CONCURRENCY: String(CONCURRENCY),
      POLL_INTERVAL: String(POLL_INTERVAL_MS),
    };
    const runs: RunFigures[] = [];
    const statsTables: Table[] = [];
    await withWorkers(WORKER_SCRIPT, PROCESSES, env, async (workers) => {
      let settings = {
        pollInterval: POLL_INTERVAL_MS,
        skipHeld: false,
        localQueue: false,
        processes: PROCESSES,
      };
      const one = async (id: VariantId, jobs: number, r: number, limitMs: number | null) => {
        const v: Variant = VARIANTS[id];
        const next = {
          pollInterval: v.pollInterval ?? POLL_INTERVAL_MS,
          skipHeld: !!v.skipHeld,
          localQueue: !!v.localQueue,
          processes: v.shape?.processes ?? PROCESSES,
        };
        if (
          next.pollInterval !== settings.pollInterval ||
          next.skipHeld !== settings.skipHeld ||
          next.localQueue !== settings.localQueue ||
          next.processes !== settings.processes
        ) {
          // (processes beyond the variant's count stop their runner)
          await Promise.all(
            workers.map((w, i) =>
              w.request({
                type: "poll",
                pollInterval: next.pollInterval,
                skipHeld: next.skipHeld,
                localQueue: next.localQueue,
                stopped: i >= next.processes,
              }),
            ),
          );
          settings = next;
        }
        if (v.shape) jobs = Math.round((v.shape.jobs * jobs) / size.jobs);
        // (with BENCH_SERVER_STATS, the server's time by statement in each variant's last round)
        const last = r === rounds;
        if (last) await resetServerStats(ctx.pool);
        const f = {
          ...(await measure(ctx, locks, workers, id, jobs, limitMs)),
          variant: id,
          round: r,
        };
        if (last) statsTables.push(...(await serverStatsTables(ctx.pool, id, jobs)));
        ctx.log(
          `contention: ${r === 0 ? "warm-up" : `round ${r}`} ${id.padEnd(10)} ${fmtInt(f.executed)} executed, ` +
            `makespan ${(f.makespanMs / 1000).toFixed(2)} s (ideal ${(f.idealMs / 1000).toFixed(2)} s), ` +
            `${f.fetches} fetches, hand-off p50 ${fmtFixed(f.handoffs.handoff.p50, 1)} ms ` +
            `p99 ${fmtFixed(f.handoffs.handoff.p99, 1)} ms, max per key ${f.maxPerKey}` +
            (f.maxPerKey > 1 ? `; OVERLAP: ${f.maxPerKey} executions of a key at once` : ""),
        );
        ctx.log(
          `contention: ${id} hand-offs by the sessions: ` +
            Object.entries(f.sessionHandoffs)
              .map(([k, n]) => `${k} ${n}`)
              .join(", "),
        );
        runs.push(f);
      };
      const alternating = wanted.filter((v) => v !== "raise");
      for (let r = 0; r <= rounds; r++) {
        for (const v of alternating) await one(v, r === 0 ? size.warmJobs : size.jobs, r, null);
      }
      if (wanted.includes("raise")) await one("raise", size.jobs, 1, size.raiseLimitMs);
    }).finally(() => locks.release());

    const summaries = wanted.map((v) => summarise(v, runs));
    const rescheduling = summaries.filter(
      (v) =>
        VARIANTS[v.variant].task === STRATEGY_TASKS.reschedule && !("shape" in VARIANTS[v.variant]),
    );
    const overlap = Math.max(...runs.map((x) => x.maxPerKey));
    const floorGoals = lineGoals(summaries);
    for (const g of floorGoals)
      ctx.log(
        `contention goal: ${g.name}: ${g.target}; measured ${fmtFixed(g.value, 2)}, floor ` +
          `${Number.isNaN(g.floor) ? "–" : fmtFixed(g.floor, 2)}: ${verdict(g)}`,
      );
    return {
      tables: [
        ...tables(summaries, runs, size, rounds),
        ...floorTables(summaries, floorGoals),
        ...statsTables,
      ],
      goals: [
        ...rescheduling.flatMap((v) =>
          GOALS.map(([name, target, figure, most]) =>
            goal(`${VARIANTS[v.variant].label}: ${name}`, target, v[figure], v[figure] <= most),
          ),
        ),
        ...floorGoals.map((g) =>
          goal(
            g.name,
            `${g.target} (floor ${Number.isNaN(g.floor) ? "–" : fmtFixed(g.floor, 2)}: ${verdict(g)})`,
            g.value,
            g.value <= g.most,
          ),
        ),
        goal(
          "no overlap per key (every run, every variant)",
          "max executions of one key at once ≤ 1",
          overlap,
          overlap <= 1,
        ),
      ],
      figures: {
        ...{ processes: PROCESSES, concurrency: CONCURRENCY, keys: KEYS, taskMs: TASK_MS },
        ...{ ...size, rounds, summaries, runs },
      },
    };
  },
);

function tables(
  summaries: VariantFigures[],
  runs: RunFigures[],
  size: typeof SIZES.full,
  rounds: number,
) {
  const s = (ms: number) => fmtFixed(ms / 1000, 2);
  const ms = (v: number) => fmtFixed(v, 1);
  const raise = runs.find((r) => r.variant === "raise");
  const summary = table(
    `Contention: ${fmtInt(size.jobs)} jobs over ${KEYS} keys, ${TASK_MS} ms tasks, ${PROCESSES} processes × ` +
      `concurrency ${CONCURRENCY} (median of ${rounds} runs; raise: 1 run; line and hot key rows: their own shape)`,
    "variant | executed | busiest key | makespan s | ideal s | makespan/ideal | fetches/executed | fetches/job | reschedules/executed | hand-off p50 ms | p99 ms | max per key | out of order | worker CPU s",
    summaries.map((v) => [
      v.variant === "raise"
        ? `raise (stopped at ${size.raiseLimitMs / 1000} s, 1 run)`
        : VARIANTS[v.variant].label,
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
    [
      `ideal: the busiest key's executions × ${TASK_MS} ms (hot key: 2 ms; drop's: of the jobs it executed). fetches: job:start events;`,
      "hand-off: next execution's start − previous end, per key; max per key: executions of a key at once, worst run;",
      "out of order: executions to move for each key's to run in job id order; worker CPU: the 3 processes' CPU time.",
      raise
        ? `raise: stopped at ${size.raiseLimitMs / 1000} s and its ${fmtInt(raise.left)} job(s) still queued deleted (graphile-worker retries a conflict after e^attempts s).`
        : "",
    ],
  );

  // Per variant, the measured run with the median makespan.
  const picked = VARIANT_IDS.flatMap((variant) => {
    const mine = runs
      .filter((r) => r.variant === variant && r.round > 0)
      .sort((a, b) => a.makespanMs - b.makespanMs);
    return mine.length > 0 ? [mine[(mine.length - 1) >> 1]!] : [];
  });
  const q = (x: Quantiles) => `${ms(x.p50)} / ${ms(x.p99)}`;
  const nMean = (x: Quantiles) => (x.n > 0 ? `${fmtInt(x.n)}, ${ms(x.mean)}` : "0");
  const breakdown = table(
    "Contention: where a hand-off's time goes (the run with the median makespan; p50 / p99, ms)",
    "variant | hand-offs | end → unlock answered | end → next fetched | fetched → started | end → next started | same process / other: n, mean | first pass / after: n, mean",
    picked.map(({ variant, handoffs: h, parts: p }) => [
      variant,
      fmtInt(h.handoff.n),
      p.unlock.n > 0 ? q(p.unlock) : "–",
      q(p.nextFetch),
      q(p.fetchToStart),
      q(h.handoff),
      `${nMean(h.sameProcess)} / ${nMean(h.otherProcess)}`,
      `${nMean(h.firstPass)} / ${nMean(h.afterFirstPass)}`,
    ]),
    [
      "end: the task body returned; unlock answered: its unlock (with the wake of the key's next waiter) came back;",
      "next fetched: a worker locked the next job's row; started: it took the lock. first pass: before every job's first fetch.",
    ],
  );
  const stageRows = picked.flatMap(({ variant, stages: byKind }) =>
    (["handedOver", "sameProcess", "otherProcess"] as const).flatMap((kind) => {
      const st = byKind[kind];
      if (st.entered.n === 0) return [];
      return [
        [variant, kind, fmtInt(st.entered.n), ...STAGES.map((s) => (st[s].n > 0 ? q(st[s]) : "–"))],
      ];
    }),
  );
  const stagesTable = table(
    "Contention: a hand-off stage by stage, from the previous job's end (the run with the median makespan; p50 / p99, ms)",
    "variant | kind | hand-offs | unlock sent | unlock answered | next woken | next granted | next entered",
    stageRows,
    [
      "kind: handedOver, the key passed in memory within a process; sameProcess / otherProcess: through an unlock.",
      "woken: the last of the next job's fetch, its hearing of the release, and the key passed to it;",
      "granted: its hold given (lock statement or hand-over check answered); entered: its body began. Lock session's timing probe.",
    ],
  );
  return stageRows.length > 0 ? [summary, breakdown, stagesTable] : [summary, breakdown];
}

/** Issue 32's goals beside their floors, and the floors' parts, per line and hot-key variant. */
function floorTables(summaries: VariantFigures[], goals: FloorGoal[]) {
  const ms = (v: number) => (Number.isNaN(v) ? "–" : fmtFixed(v, 2));
  const goalsTable = table(
    "Contention: issue 32's goals beside their floors (medians of the measured runs)",
    "<goal | <target | measured | floor | <verdict",
    goals.map((g) => [g.name, g.target, fmtFixed(g.value, 2), ms(g.floor), verdict(g)]),
    [
      "floor: what the figure cannot go under with the hand-off's checks kept, measured in the same runs:",
      "hand-off p50 / p99: one lock-statement round trip (p50 / p99); makespan: the busiest key's executions",
      "end to end plus one round trip per hand-off, at its mean; fetches: one per job. below floor: the target",
      "is under it.",
    ],
  );
  const parts = table(
    "Contention: the floors' parts, sampled by each worker process during the run (medians of the runs, ms)",
    "variant | round trip p50 | p99 | mean | notification p50 | graphile-worker fetch p50 | hand-off floor in memory | between processes | through a fetch | makespan floor / ideal | with the p50 round trip",
    summaries
      .filter((v) => "shape" in VARIANTS[v.variant])
      .map((v) => [
        v.variant,
        ms(v.rttP50Ms),
        ms(v.rttP99Ms),
        ms(v.rttMeanMs),
        ms(v.notifyP50Ms),
        ms(v.fetchP50Ms),
        ms(v.rttP50Ms),
        ms(v.notifyP50Ms + v.rttP50Ms),
        ms(v.rttP50Ms + v.fetchP50Ms + v.rttP50Ms),
        fmtFixed(v.makespanFloorOverIdeal, 3),
        fmtFixed(v.makespanFloorP50OverIdeal, 3),
      ]),
    [
      "round trip: a trivial prepared statement on a connection of its own; notification: from before its",
      "sender's statement to the listener; fetch: a worker's getJob:start to job:start (none with a local queue).",
      "in memory: the hand-over check's round trip; between processes: the release's notice, then the lock;",
      "through a fetch: the unlock (which wakes the job), its fetch, its lock. makespan floor: the busiest key's",
      "executions end to end plus one round trip per hand-off at the round trip's mean (hand-offs add up);",
      "with the p50 round trip: the same at the median, which understates a sum when the round trip has a tail.",
    ],
  );
  return [goalsTable, parts];
}
