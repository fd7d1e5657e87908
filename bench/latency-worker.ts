/**
 * A worker process of the latency section (latency.ts), forked once and kept: one graphile-worker runner
 * per run, whose task waits `taskMs` on a timer (as an HTTP call would): `plain`; `wrapped` by
 * `locks.exclusive()` (`onConflict: "drop"`, a distinct key per job, `locks.attach()` on the runner);
 * `queLocks`, wrapped the way que-locks does it (a connection of the job's own from a pool of one per
 * worker: `pg_try_advisory_lock`, the task, `pg_advisory_unlock`); or `roundTrip`, preceded by one empty
 * statement on a connection of the process's own (what a round trip before each job costs, no lock).
 *
 * It records, per job: from graphile-worker's `job:start` to the first line of the task's body (what a
 * wrapper adds before the task runs) and to `job:success`; for `wrapped`, the lock session's own timings
 * (its probe): a lock request until its statement is sent (waiting) and until its answer (the round trip),
 * an unlock request until its answer (the release). Meanwhile a connection of its own runs an empty
 * statement every 5 ms, and another one at a job's start when it is free (as the lock statement is sent):
 * their round trips, in the same process at the same time, are the floor a lock statement cannot go below.
 *
 * Requests: `start` (starts the runner; answers once `run()` resolved) and `stop` (stops it and answers
 * the run's LatencyReport).
 */
import { EventEmitter } from "node:events";
import { performance } from "node:perf_hooks";
import pg from "pg";
import type { Runner, Task, WorkerEvents } from "graphile-worker";
import { machineClock, quietLogger, sleep, startRunner, workerMain } from "./lib.js";
import type { RunStart } from "./lib.js";
import { library, timingProbe } from "./library.js";

export const LATENCY_TASK = "io";
export type LatencyVariant = "plain" | "wrapped" | "queLocks" | "roundTrip";
export type StartRequest = RunStart<LatencyVariant, { taskMs: number }>;

/** One process's account of one run; times in ms. */
export type LatencyReport = ReturnType<typeof newReport>;
const newReport = () => ({
  completed: 0,
  failed: 0,
  conflicts: 0,
  /** The first `job:start` and the last `job:success` on the machine's clock (the run's span). */
  firstStart: null as number | null,
  lastSuccess: null as number | null,
  beforeBody: [] as number[],
  startToSuccess: [] as number[],
  lockWait: [] as number[],
  lockRoundTrip: [] as number[],
  release: [] as number[],
  floor: [] as number[],
  floorAtStart: [] as number[],
  /** A worker's `job:success` to its next `job:start`: graphile-worker's completion and next fetch. */
  nextStart: [] as number[],
  lockStatements: 0,
});

workerMain<StartRequest | { type: "stop" }>(import.meta.url, async (url) => {
  const locks = library.makeLocks({ connectionString: url, logger: quietLogger });
  await locks.connect();
  const quePool = new pg.Pool({ connectionString: url, max: 24 });
  quePool.on("error", () => undefined);
  const connect = async () => {
    const client = new pg.Client({ connectionString: url });
    await client.connect();
    return client;
  };
  const [floorClient, startFloorClient, roundTripClient] = [
    await connect(),
    await connect(),
    await connect(),
  ];

  let roundTripChain = Promise.resolve();
  let report = newReport();
  let runner: Runner | undefined;
  let floorRunning = false;
  let floorLoop = Promise.resolve();
  let startFloorBusy = false;
  const jobStart = new Map<string, number>();
  /** When each worker's last job succeeded. */
  const workerSuccess = new Map<string, number>();
  let taskMs = 0;

  const body: Task = async (_payload, helpers) => {
    const started = jobStart.get(helpers.job.id);
    if (started !== undefined) report.beforeBody.push(performance.now() - started);
    await sleep(taskMs);
  };
  locks.events.on("lock:conflict", () => void report.conflicts++);
  const queLocks: Task = async (payload, helpers) => {
    const key = library.lockKey(LATENCY_TASK, payload).toString();
    const client = await quePool.connect();
    try {
      const text = "select pg_try_advisory_lock($1::bigint) as ok";
      const { rows } = await client.query<{ ok: boolean }>({
        name: "lat_try",
        text,
        values: [key],
      });
      if (!rows[0]!.ok) return void report.conflicts++;
      try {
        await body(payload, helpers);
      } finally {
        await client.query({
          name: "lat_unlock",
          text: "select pg_advisory_unlock($1::bigint)",
          values: [key],
        });
      }
    } finally {
      client.release();
    }
  };
  const tasks: Record<LatencyVariant, Task> = {
    plain: body,
    wrapped: locks.exclusive(LATENCY_TASK, body, { onConflict: "drop" }),
    queLocks,
    roundTrip: async (payload, helpers) => {
      // One connection answers one statement at a time: a job starting while another's is in flight waits
      // for it, in this chain (node-postgres's own queue for that is deprecated).
      const turn = roundTripChain.then(() => roundTripClient.query(""));
      roundTripChain = turn.then(
        () => undefined,
        () => undefined,
      );
      await turn;
      await body(payload, helpers);
    },
  };
  const probe = {
    lock(queuedAt: number, sentAt: number, answeredAt: number) {
      report.lockWait.push(sentAt - queuedAt);
      report.lockRoundTrip.push(answeredAt - sentAt);
    },
    unlock: (queuedAt: number, _sentAt: number, answeredAt: number) =>
      void report.release.push(answeredAt - queuedAt),
  };

  return {
    handlers: {
      async start(request) {
        report = newReport();
        jobStart.clear();
        workerSuccess.clear();
        taskMs = request.taskMs;
        timingProbe?.setTimingProbe(request.variant === "wrapped" ? probe : null);
        report.lockStatements = -locks.status().statements;
        const events = new EventEmitter() as WorkerEvents;
        events.on("job:start", ({ job, worker }) => {
          const t = performance.now();
          jobStart.set(job.id, t);
          const succeeded = workerSuccess.get(worker.workerId);
          if (succeeded !== undefined) report.nextStart.push(t - succeeded);
          report.firstStart ??= machineClock();
          if (startFloorBusy) return;
          startFloorBusy = true;
          void startFloorClient.query("").then(() => {
            report.floorAtStart.push(performance.now() - t);
            startFloorBusy = false;
          });
        });
        events.on("job:success", ({ job, worker }) => {
          const t = performance.now();
          workerSuccess.set(worker.workerId, t);
          const started = jobStart.get(job.id);
          if (started !== undefined) report.startToSuccess.push(t - started);
          jobStart.delete(job.id);
          report.completed++;
          report.lastSuccess = machineClock();
        });
        events.on("job:error", () => void report.failed++);
        runner = await startRunner({
          connectionString: url,
          concurrency: request.concurrency,
          taskList: { [LATENCY_TASK]: tasks[request.variant] },
          pollInterval: 1000,
          events,
          preset: { worker: { ...request.worker } },
        });
        if (request.variant === "wrapped") locks.attach(runner);
        floorRunning = true;
        floorLoop = (async () => {
          while (floorRunning) {
            const t = performance.now();
            await floorClient.query("");
            report.floor.push(performance.now() - t);
            await sleep(5);
          }
        })();
        return true;
      },
      async stop() {
        floorRunning = false;
        await floorLoop;
        await runner?.stop();
        runner = undefined;
        report.lockStatements += locks.status().statements;
        timingProbe?.setTimingProbe(null);
        return report;
      },
    },
    async leave() {
      floorRunning = false;
      await floorLoop.catch(() => undefined);
      await runner?.stop().catch(() => undefined);
      await locks.release();
      for (const c of [quePool, floorClient, startFloorClient, roundTripClient])
        await c.end().catch(() => undefined);
    },
  };
});
