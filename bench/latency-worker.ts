/**
 * A worker process of the latency section (bench/latency.ts), forked as `node --import tsx
 * bench/latency-worker.ts`: one graphile-worker runner per run, whose task waits `taskMs` on a timer (as
 * an HTTP call would), plain, wrapped by `locks.exclusive()` (`onConflict: "drop"`, a distinct key per
 * job, `locks.attach()` on the runner) or wrapped naively the way que-locks does it (a connection of the
 * job's own from a pool of one per worker: `pg_try_advisory_lock`, the task, `pg_advisory_unlock`), or
 * preceded by one empty statement on a connection of the process's own (`roundTrip`: what a round trip
 * before each job costs, with no lock at all).
 *
 * It records, per job: from graphile-worker's `job:start` to the first line of the task's body (what the
 * wrapper adds before the task runs; for plain, graphile-worker's own few microseconds) and from
 * `job:start` to `job:success`; for the wrapped variant, the lock session's own timings (the session's
 * probe): from a lock request to its statement's sending (waiting), from sending to the answer (the round
 * trip) and from an unlock request to its answer (the release). Meanwhile a connection of its own runs
 * an empty statement every few milliseconds, and another one at a job's start (when it is free, as the
 * lock statement is sent): their round trips, measured in the same process at the same time, are the floor
 * a lock statement cannot go below.
 *
 * Requests (serveParent in lib.ts): `start` (starts the runner; answers once `run()` resolved), `stop`
 * (stops the runner and answers the run's report), `leave`.
 */
import { EventEmitter } from "node:events";
import { performance } from "node:perf_hooks";
import pg from "pg";
import { run, type Runner, type Task, type WorkerEvents } from "graphile-worker";
import { isMain, quietLogger, serveParent, sleep } from "./lib.js";
import { library, sessionModule } from "./library.js";
import type { WorkerPreset } from "./lib.js";

export const LATENCY_TASK = "io";

export type LatencyVariant = "plain" | "wrapped" | "queLocks" | "roundTrip";

export type StartRequest = {
  type: "start";
  variant: LatencyVariant;
  taskMs: number;
  concurrency: number;
  worker: WorkerPreset;
};

/** One process's account of one run; times in ms. */
export interface LatencyReport {
  completed: number;
  failed: number;
  conflicts: number;
  /** Epoch ms of the first `job:start` and of the last `job:success` (for the run's span). */
  firstStart: number | null;
  lastSuccess: number | null;
  /** Per job: `job:start` to the task body's first line. */
  beforeBody: number[];
  /** Per job: `job:start` to `job:success`. */
  startToSuccess: number[];
  /** Lock session probe (wrapped): per lock request, queued → sent and sent → answered; per unlock, queued → answered. */
  lockWait: number[];
  lockRoundTrip: number[];
  release: number[];
  /** Round trips of an empty statement during the run, every few ms. */
  floor: number[];
  /** Round trips of an empty statement sent at a job's start (when the floor's connection is free). */
  floorAtStart: number[];
  lockStatements: number;
}

type Request = StartRequest | { type: "stop" };

/** How often the floor's empty statement runs. */
const FLOOR_INTERVAL_MS = 5;

const epoch = (t: number): number => performance.timeOrigin + t;

async function main(): Promise<void> {
  const url = process.env.DATABASE_URL!;
  const locks = library.makeLocks({ connectionString: url, logger: quietLogger });
  await locks.connect();
  const quePool = new pg.Pool({ connectionString: url, max: 24 });
  quePool.on("error", () => undefined);
  const floorClient = new pg.Client({ connectionString: url });
  await floorClient.connect();
  const roundTripClient = new pg.Client({ connectionString: url });
  await roundTripClient.connect();
  const startFloorClient = new pg.Client({ connectionString: url });
  await startFloorClient.connect();
  let startFloorBusy = false;

  let report: LatencyReport;
  let runner: Runner | undefined;
  let floorRunning = false;
  let floorLoop: Promise<void> = Promise.resolve();
  const jobStart = new Map<string, number>();
  let taskMs = 0;

  const newReport = (): LatencyReport => ({
    completed: 0,
    failed: 0,
    conflicts: 0,
    firstStart: null,
    lastSuccess: null,
    beforeBody: [],
    startToSuccess: [],
    lockWait: [],
    lockRoundTrip: [],
    release: [],
    floor: [],
    floorAtStart: [],
    lockStatements: 0,
  });
  report = newReport();

  const body: Task = async (_payload, helpers) => {
    const started = jobStart.get(helpers.job.id);
    if (started !== undefined) report.beforeBody.push(performance.now() - started);
    await sleep(taskMs);
  };
  const wrapped = locks.exclusive(LATENCY_TASK, body, { onConflict: "drop" });
  locks.events.on("lock:conflict", () => report.conflicts++);
  const queLocks: Task = async (payload, helpers) => {
    const key = library.lockKey(LATENCY_TASK, payload).toString();
    const client = await quePool.connect();
    try {
      const { rows } = await client.query<{ ok: boolean }>({
        name: "lat_try",
        text: "select pg_try_advisory_lock($1::bigint) as ok",
        values: [key],
      });
      if (!rows[0]!.ok) {
        report.conflicts++;
        return;
      }
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

  const roundTrip: Task = async (payload, helpers) => {
    await roundTripClient.query("");
    await body(payload, helpers);
  };

  const probe = {
    lock(queuedAt: number, sentAt: number, answeredAt: number) {
      report.lockWait.push(sentAt - queuedAt);
      report.lockRoundTrip.push(answeredAt - sentAt);
    },
    unlock(queuedAt: number, _sentAt: number, answeredAt: number) {
      report.release.push(answeredAt - queuedAt);
    },
  };

  serveParent<Request>(
    {
      async start(request: StartRequest) {
        report = newReport();
        jobStart.clear();
        taskMs = request.taskMs;
        sessionModule.setSessionProbe(request.variant === "wrapped" ? probe : null);
        const statementsBefore = locks.status().statements;
        const events = new EventEmitter() as WorkerEvents;
        events.on("job:start", ({ job }) => {
          const t = performance.now();
          jobStart.set(job.id, t);
          report.firstStart ??= epoch(t);
          if (!startFloorBusy) {
            startFloorBusy = true;
            void startFloorClient.query("").then(() => {
              report.floorAtStart.push(performance.now() - t);
              startFloorBusy = false;
            });
          }
        });
        events.on("job:success", ({ job }) => {
          const t = performance.now();
          const started = jobStart.get(job.id);
          if (started !== undefined) report.startToSuccess.push(t - started);
          jobStart.delete(job.id);
          report.completed++;
          report.lastSuccess = epoch(t);
        });
        events.on("job:error", () => report.failed++);
        const task = { plain: body, wrapped, queLocks, roundTrip }[request.variant];
        runner = await run({
          connectionString: url,
          concurrency: request.concurrency,
          taskList: { [LATENCY_TASK]: task },
          noHandleSignals: true,
          pollInterval: 1000,
          logger: quietLogger,
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
            await sleep(FLOOR_INTERVAL_MS);
          }
        })();
        report.lockStatements = -statementsBefore;
        return true;
      },
      async stop() {
        floorRunning = false;
        await floorLoop;
        await runner?.stop();
        runner = undefined;
        report.lockStatements += locks.status().statements;
        sessionModule.setSessionProbe(null);
        return report;
      },
    },
    async () => {
      floorRunning = false;
      await floorLoop.catch(() => undefined);
      await runner?.stop().catch(() => undefined);
      await locks.release();
      await quePool.end().catch(() => undefined);
      await floorClient.end().catch(() => undefined);
      await startFloorClient.end().catch(() => undefined);
      await roundTripClient.end().catch(() => undefined);
    },
  )("ready");
}

if (isMain(import.meta.url)) await main();
