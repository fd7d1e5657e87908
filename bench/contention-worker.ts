/**
 * A worker process of the contention section (bench/contention.ts), forked three times as
 * `node --import tsx bench/contention-worker.ts`.
 *
 * It runs one graphile-worker runner (concurrency CONCURRENCY, poll interval POLL_INTERVAL) whose task list
 * holds the four tasks of the section, so that the same processes serve every run:
 * - `cx_drop`, `cx_reschedule`, `cx_raise`: the 20 ms task wrapped by `locks.exclusive()` with that conflict
 *   strategy (key: `payload.k`; the library's default reschedule backoff, unless BENCH_RESCHEDULE gives one
 *   as JSON, for experiments);
 * - `cx_queue`: the same task without the library, for the anchor run whose jobs are serialised by
 *   graphile-worker's own named queues (one `queueName` per key).
 *
 * Everything is recorded in memory, with the clock `performance.timeOrigin + performance.now()` (ms since
 * the epoch, sub-millisecond; every process is on the same machine, and the parent checks the offsets):
 * each execution's start and end (taken inside the task, i.e. while the job holds its lock or its queue),
 * each fetch (graphile-worker's `job:start`, emitted when a worker has locked a job row), each release
 * (`lock:released`, once PostgreSQL answered the unlock statement, which also woke the key's next waiter),
 * each park (`job:rescheduled`), and counters of conflicts, drops, failures and empty fetches.
 *
 * Requests (serveParent in lib.ts): `clock` (answers this process's clock), `reset` (forgets what was
 * recorded), `collect` (answers the records), `poll` (restarts the runner with another poll interval, and
 * with or without `forbiddenFlags: locks.forbiddenFlags`), `leave` (stops the runner, releases the lock
 * session and exits). Sends `ready` once its runner runs and its lock session is open.
 */
import { EventEmitter } from "node:events";
import { performance } from "node:perf_hooks";
import { Logger, run, type Job, type JobHelpers, type WorkerEvents } from "graphile-worker";
import type { ExclusiveOptions, RescheduleOptions } from "../src/index.js";
import { isMain, serveParent } from "./lib.js";
import { library } from "./library.js";

export const TASK_MS = 20;
export const STRATEGY_TASKS = {
  drop: "cx_drop",
  reschedule: "cx_reschedule",
  raise: "cx_raise",
} as const;
export const QUEUE_TASK = "cx_queue";
export const ALL_TASKS = [...Object.values(STRATEGY_TASKS), QUEUE_TASK];

/** Every job's payload: its key, and its position in the enqueue order (1-based, = job id order). */
export interface ContentionPayload {
  k: string;
  seq: number;
}

/**
 * How every process defines the task of `strategy` (the workers to run it, the bench to enqueue it with
 * `locks.addJobs`, which reads the definition). For experiments only: BENCH_RESCHEDULE='{"minDelay":10000}'
 * overrides the library's default backoff.
 */
export function strategyOptions(
  strategy: keyof typeof STRATEGY_TASKS,
): ExclusiveOptions<ContentionPayload> {
  return {
    onConflict: strategy,
    key: (p) => p.k,
    ...(strategy === "reschedule" && process.env.BENCH_RESCHEDULE
      ? { reschedule: JSON.parse(process.env.BENCH_RESCHEDULE) as RescheduleOptions }
      : {}),
  };
}

/** The common clock: milliseconds since the epoch, with sub-millisecond resolution. */
export const clock = (): number => performance.timeOrigin + performance.now();

export interface ExecutionRecord {
  jobId: string;
  task: string;
  k: string;
  seq: number;
  attempts: number;
  start: number;
  end: number;
}

export interface FetchRecord {
  jobId: string;
  task: string;
  k: string;
  seq: number;
  attempts: number;
  /** When graphile-worker's worker had the job (its row locked). */
  at: number;
}

export interface WorkerRecords {
  name: string;
  executions: ExecutionRecord[];
  fetches: FetchRecord[];
  /** Job id → when its unlock statement was answered. */
  releases: Array<[string, number]>;
  counters: Record<string, Record<string, number>>;
  /** CPU time of this process (user + system) since the last `reset`, in ms. */
  cpuMs: number;
}

type ParentMessage =
  | { type: "clock" }
  | { type: "reset" }
  | { type: "collect" }
  | { type: "poll"; pollInterval: number; skipHeld: boolean };

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

async function main(): Promise<void> {
  const url = process.env.DATABASE_URL;
  if (!url) throw new Error("contention-worker: DATABASE_URL is not set");
  const name = process.env.WORKER_NAME ?? String(process.pid);
  const concurrency = Number(process.env.CONCURRENCY ?? 8);
  let pollInterval = Number(process.env.POLL_INTERVAL ?? 2000);
  /** Whether the runner skips jobs of the keys this process holds (`forbiddenFlags: locks.forbiddenFlags`). */
  let skipHeld = false;
  const quiet = new Logger(() => () => undefined);

  let executions: ExecutionRecord[] = [];
  let fetches: FetchRecord[] = [];
  let releases = new Map<string, number>();
  let counters: Record<string, Record<string, number>> = {};
  let cpuAtReset = process.cpuUsage();
  const count = (task: string, what: string) => {
    const c = (counters[task] ??= {});
    c[what] = (c[what] ?? 0) + 1;
  };

  const body =
    (task: string) =>
    async (payload: ContentionPayload, helpers: JobHelpers): Promise<void> => {
      const start = clock();
      await sleep(TASK_MS);
      executions.push({
        jobId: helpers.job.id,
        task,
        k: payload.k,
        seq: payload.seq,
        attempts: helpers.job.attempts,
        start,
        end: clock(),
      });
    };

  const locks = library.makeLocks({
    connectionString: url,
    logger: quiet,
    applicationName: `gwl-bench-contention/${name}`,
  });
  locks.events.on("lock:released", ({ job }) => {
    releases.set(job.id, clock());
  });
  locks.events.on("lock:conflict", ({ taskIdentifier, local }) => {
    count(taskIdentifier, "conflicts");
    if (local) count(taskIdentifier, "localConflicts");
  });
  locks.events.on("job:dropped", ({ taskIdentifier }) => count(taskIdentifier, "dropped"));
  locks.events.on("job:rescheduled", ({ taskIdentifier }) => count(taskIdentifier, "rescheduled"));

  const taskList = {
    ...Object.fromEntries(
      (Object.keys(STRATEGY_TASKS) as Array<keyof typeof STRATEGY_TASKS>).map((strategy) => {
        const task = STRATEGY_TASKS[strategy];
        return [
          task,
          locks.exclusive<ContentionPayload>(task, body(task), strategyOptions(strategy)),
        ];
      }),
    ),
    [QUEUE_TASK]: body(QUEUE_TASK),
  };

  const events = new EventEmitter() as WorkerEvents;
  events.on("job:start", ({ job }: { job: Job }) => {
    const payload = job.payload as ContentionPayload;
    count(job.task_identifier, "starts");
    fetches.push({
      jobId: job.id,
      task: job.task_identifier,
      k: payload.k,
      seq: payload.seq,
      attempts: job.attempts,
      at: clock(),
    });
  });
  events.on("job:error", ({ job }: { job: Job }) => count(job.task_identifier, "errors"));

  await locks.connect();
  // The runner's events, given to the library: early wakes go to this process's idle workers. `attach`
  // detaches itself when the runner stops, so each runner started on these events is attached anew.
  const start = () => {
    locks.attach({ events });
    return run({
      connectionString: url,
      concurrency,
      taskList: taskList as never,
      noHandleSignals: true,
      pollInterval,
      logger: quiet,
      events,
      ...(skipHeld ? { forbiddenFlags: locks.forbiddenFlags } : {}),
    });
  };
  let runner = await start();

  const send = serveParent<ParentMessage>(
    {
      clock: () => clock(),
      reset: () => {
        executions = [];
        fetches = [];
        releases = new Map();
        counters = {};
        cpuAtReset = process.cpuUsage();
      },
      collect: (): WorkerRecords => {
        const cpu = process.cpuUsage(cpuAtReset);
        return {
          name,
          executions,
          fetches,
          releases: [...releases],
          counters,
          cpuMs: (cpu.user + cpu.system) / 1000,
        };
      },
      poll: async (message) => {
        await runner.stop();
        pollInterval = message.pollInterval;
        skipHeld = message.skipHeld;
        runner = await start();
      },
    },
    async () => {
      await runner.stop();
      await locks.release();
    },
  );
  send("ready");
}

if (isMain(import.meta.url)) {
  main().catch((error: unknown) => {
    console.error(`[contention-worker ${process.env.WORKER_NAME ?? process.pid}] failed:`, error);
    process.exit(1);
  });
}
