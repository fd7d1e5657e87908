/**
 * A worker process of the contention section (contention.ts), forked three times and kept. It runs one
 * graphile-worker runner (concurrency CONCURRENCY) whose task list holds the section's four tasks, so that
 * the same processes serve every run: `cx_drop`, `cx_reschedule` and `cx_raise`, the 20 ms task wrapped
 * by `locks.exclusive()` with that conflict strategy (key: `payload.k`), and `cx_queue`, the same task
 * without the library, for the anchors whose jobs graphile-worker's named queues serialise. The runner is
 * given to `locks.attach`: early wakes go to this process's idle workers.
 *
 * It records, on the machine's monotonic clock (`machineClock`, common to every process): each execution's
 * start and end
 * (inside the task, while the job holds its lock or its queue), each fetch (`job:start`: a worker locked
 * the job's row), each release (`lock:released`: the unlock statement, which also woke the key's next
 * waiter, was answered), the parks per task (`job:rescheduled`), this process's CPU time, and, through the
 * lock session's timing probe (when the build has one), the stages of each job's hand-off (`Stages`).
 *
 * The floors of a hand-off (`Floors`), measured in this process while a run goes, between `reset` and
 * `collect`, on two connections of their own (FloorProbe): the round trip of a trivial prepared statement
 * (what a lock statement cannot go under), the latency of a notification from its sender's statement to a
 * listener (what a release's notice cannot go under), and graphile-worker's own fetch (a worker's
 * `worker:getJob:start` to its `job:start`).
 *
 * Requests: `reset` (forgets the records), `collect` (answers them), `poll` (restarts the runner
 * with another poll interval, with or without `forbiddenFlags: locks.forbiddenFlags`, with or without a local
 * queue; `stopped`: stops it instead, for a run with fewer processes).
 */
import { EventEmitter } from "node:events";
import type { Job, JobHelpers, Runner, Worker, WorkerEvents } from "graphile-worker";
import pg from "pg";
import type { ExclusiveOptions } from "../src/index.js";
import { machineClock as clock, quietLogger, sleep, startRunner, workerMain } from "./lib.js";
import { library, timingProbe } from "./library.js";

export const TASK_MS = 20;
export const STRATEGY_TASKS = { drop: "cx_drop", reschedule: "cx_reschedule", raise: "cx_raise" };
export const QUEUE_TASK = "cx_queue";
export type Strategy = keyof typeof STRATEGY_TASKS;

/** Every job's payload: its key, its position in the enqueue order (1-based), its task's ms if not TASK_MS. */
export type ContentionPayload = { k: string; seq: number; ms?: number };

/**
 * The lock session's marks of one job's hand-off (timing-probe.ts's `HandoffStage`), on the machine's clock:
 * its own hold's unlock sent and answered, and, as the next job of a line, when it began to wait for a key
 * held here, when it was passed its key in memory, when it heard of another session's release, and when it
 * was given its hold.
 */
export type Stages = Partial<
  Record<"unlockSent" | "unlockAnswered" | "waiting" | "handedOver" | "noticed" | "granted", number>
>;

/** How every process defines the task of `strategy` (and the bench, which enqueues with `locks.addJobs`). */
export const strategyOptions = (strategy: Strategy): ExclusiveOptions<ContentionPayload> => ({
  onConflict: strategy,
  key: (p) => p.k,
});

/** A job's execution (`at` its start, `end` its end) or fetch (`at`). */
export type Mark = ContentionPayload & {
  jobId: string;
  task: string;
  attempts: number;
  at: number;
  end?: number;
};

export interface WorkerRecords {
  name: string;
  executions: Mark[];
  fetches: Mark[];
  /** Job id → when its unlock statement was answered. */
  releases: Array<[string, number]>;
  /** Parks per task. */
  rescheduled: Record<string, number>;
  /** CPU time (user + system) since the last `reset`, ms. */
  cpuMs: number;
  /** Job id → its hand-off stages (empty with a build without the probe's stages). */
  stages: Array<[string, Stages]>;
  /** The floors sampled during the run. */
  floors: Floors;
  /** The lock session's hand-off counts over the run (`status().handoffs`; empty with a build without them). */
  handoffs: Record<string, number>;
}

export type ContentionRequest =
  | { type: "reset" }
  | { type: "collect" }
  | {
      type: "poll";
      pollInterval: number;
      skipHeld: boolean;
      localQueue: boolean;
      stopped: boolean;
    };

/** Samples (ms) of what a hand-off cannot go under, taken while a run goes (see the module comment). */
export interface Floors {
  /** Round trips of a trivial prepared statement on a connection of its own. */
  rtt: number[];
  /** A notification's latency, from before its sender's statement to its listener. */
  notify: number[];
  /** graphile-worker fetches that brought a job: `worker:getJob:start` to `job:start`. */
  fetch: number[];
}

/** How often the floor probe samples a round trip and a notification. */
const FLOOR_PROBE_MS = 25;

/**
 * Samples the round trip and the notification latency every FLOOR_PROBE_MS while started, on two connections
 * of its own (a sender, and a listener on `gwl_bench_floor`), on the machine's clock.
 */
class FloorProbe {
  private sender: pg.Client | null = null;
  private listener: pg.Client | null = null;
  private running = false;
  private loop: Promise<void> = Promise.resolve();

  constructor(
    private readonly url: string,
    private readonly floors: () => Floors,
  ) {}

  async start(): Promise<void> {
    await this.stop();
    this.sender = new pg.Client({ connectionString: this.url });
    this.listener = new pg.Client({ connectionString: this.url });
    await Promise.all([this.sender.connect(), this.listener.connect()]);
    this.listener.on("notification", ({ payload }) => {
      if (this.running && payload) this.floors().notify.push(clock() - Number(payload));
    });
    await this.listener.query("listen gwl_bench_floor");
    this.running = true;
    const sender = this.sender;
    this.loop = (async () => {
      while (this.running) {
        const t0 = clock();
        await sender.query({ name: "gwl_bench_floor_rtt", text: "select 1" });
        this.floors().rtt.push(clock() - t0);
        await sender.query({
          name: "gwl_bench_floor_notify",
          text: "select pg_notify('gwl_bench_floor', $1)",
          values: [String(clock())],
        });
        await sleep(FLOOR_PROBE_MS);
      }
    })();
  }

  async stop(): Promise<void> {
    this.running = false;
    await this.loop.catch(() => undefined);
    await Promise.all([this.sender?.end(), this.listener?.end()].map((p) => p?.catch(() => {})));
    this.sender = this.listener = null;
  }
}

workerMain<ContentionRequest>(import.meta.url, async (url, name) => {
  const blank = () => ({
    executions: [] as Mark[],
    fetches: [] as Mark[],
    releases: new Map<string, number>(),
    rescheduled: {} as Record<string, number>,
    stages: new Map<string, Stages>(),
    floors: { rtt: [], notify: [], fetch: [] } as Floors,
    cpu: process.cpuUsage(),
    handoffs: {} as Record<string, number>,
  });
  let records = blank();
  const mark = (job: Job, at: number): Mark => {
    const { k, seq } = job.payload as ContentionPayload;
    return { jobId: job.id, task: job.task_identifier, k, seq, attempts: job.attempts, at };
  };
  const body = async (payload: ContentionPayload, { job }: JobHelpers): Promise<void> => {
    const at = clock();
    await sleep(payload.ms ?? TASK_MS);
    records.executions.push({ ...mark(job, at), end: clock() });
  };

  const locks = library.makeLocks({
    connectionString: url,
    logger: quietLogger,
    applicationName: `gwl-bench-contention/${name}`,
  });
  // The probe reads performance.now(); the records are on the machine's clock.
  const offset = clock() - performance.now();
  timingProbe?.setTimingProbe({
    lock: () => undefined,
    unlock: () => undefined,
    stage: (stage, jobId, at) => {
      let marks = records.stages.get(jobId);
      if (!marks) records.stages.set(jobId, (marks = {}));
      marks[stage] = at + offset;
    },
  });
  locks.events.on("lock:released", ({ job }) => void records.releases.set(job.id, clock()));
  locks.events.on("job:rescheduled", ({ taskIdentifier: t }) => {
    records.rescheduled[t] = (records.rescheduled[t] ?? 0) + 1;
  });
  const taskList = {
    ...Object.fromEntries(
      Object.entries(STRATEGY_TASKS).map(([strategy, task]) => [
        task,
        locks.exclusive<ContentionPayload>(task, body, strategyOptions(strategy as Strategy)),
      ]),
    ),
    [QUEUE_TASK]: body,
  };
  const events = new EventEmitter() as WorkerEvents;
  events.on("job:start", ({ job }) => void records.fetches.push(mark(job, clock())));
  // graphile-worker's own fetches that brought a job (a worker fed by a local queue shows none).
  const fetching = new Map<Worker, number>();
  events.on("worker:getJob:start", ({ worker }) => void fetching.set(worker, clock()));
  events.on("worker:getJob:empty", ({ worker }) => void fetching.delete(worker));
  events.on("job:start", ({ worker }) => {
    const at = fetching.get(worker);
    if (at === undefined) return;
    fetching.delete(worker);
    records.floors.fetch.push(clock() - at);
  });
  const probe = new FloorProbe(url, () => records.floors);
  const handoffCounts = (): Record<string, number> => ({
    ...(locks.status() as unknown as { handoffs?: Record<string, number> }).handoffs,
  });

  await locks.connect();
  // `attach` detaches itself when the runner stops: each runner started on these events is attached anew.
  const start = (pollInterval: number, skipHeld: boolean, localQueue: boolean) => {
    locks.attach({ events });
    return startRunner({
      connectionString: url,
      concurrency: Number(process.env.CONCURRENCY),
      taskList: taskList as never,
      pollInterval,
      events,
      ...(skipHeld ? { forbiddenFlags: locks.forbiddenFlags } : {}),
      ...(localQueue
        ? { preset: { worker: { localQueue: { size: 50 }, completeJobBatchDelay: 0 } } }
        : {}),
    });
  };
  let runner: Runner | null = await start(Number(process.env.POLL_INTERVAL), false, false);

  return {
    handlers: {
      reset: async () => {
        records = blank();
        records.handoffs = handoffCounts();
        await probe.start();
      },
      collect: async (): Promise<WorkerRecords> => {
        await probe.stop();
        const cpu = process.cpuUsage(records.cpu);
        const { executions, fetches, releases, rescheduled, stages, floors } = records;
        const cpuMs = (cpu.user + cpu.system) / 1000;
        const before = records.handoffs;
        const handoffs = Object.fromEntries(
          Object.entries(handoffCounts()).map(([k, n]) => [k, n - (before[k] ?? 0)]),
        );
        return {
          ...{ name, executions, fetches, releases: [...releases], rescheduled, cpuMs },
          stages: [...stages],
          floors,
          handoffs,
        };
      },
      poll: async ({ pollInterval, skipHeld, localQueue, stopped }) => {
        await runner?.stop();
        runner = stopped ? null : await start(pollInterval, skipHeld, localQueue);
      },
    },
    async leave() {
      await probe.stop();
      await runner?.stop();
      await locks.release();
    },
  };
});
