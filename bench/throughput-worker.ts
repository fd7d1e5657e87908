/**
 * A worker process of the throughput section's multi-process configurations (A3, B3 in
 * bench/throughput.ts), forked three times as `node --import tsx --expose-gc bench/throughput-worker.ts`.
 *
 * It keeps one Locks instance for its whole life, with the lock session opened at start (as a long-lived
 * worker process has it), and starts one graphile-worker runner per run, on request, with the run's
 * variant and options: `plain` (the no-op task) or `wrapped` (`locks.exclusive()` around it with
 * `onConflict: "drop"`, and `locks.attach()` for lock-ahead, as the one-process wrapped variant). The
 * process stays up across runs, so that process start-up (tsx, imports) is not measured; runner start-up
 * is, as in one process.
 *
 * Every connection is named (`application_name`, see `applicationName`), so that the bench can tell them
 * apart in pg_stat_activity: the lock session, the Locks instance's own pool (its migration check and
 * enqueues) and graphile-worker's pool.
 *
 * Requests (serveParent in lib.ts): `start` (starts the runner; answers once `run()` resolved), `stop`
 * (takes this process's CPU time and lock statements since `start` first, then stops the runner, collects
 * garbage if it can, and answers the run's report), `leave` (releases the lock session and exits). Events:
 * `ready` (the lock session is open), `progress` (jobs completed
 * so far in the run, at most every PROGRESS_INTERVAL_MS while jobs complete: the bench starts polling the
 * job table only once every job is reported, as it does in one process, instead of scanning the table
 * while the runners work) and `failed` (a job failed, or the runner stopped by itself: the run cannot
 * finish, the bench should not wait for it).
 */
import { EventEmitter } from "node:events";
import { performance } from "node:perf_hooks";
import { Logger, run, type Runner, type Task, type WorkerEvents } from "graphile-worker";
import type { Locks } from "../src/index.js";
import { isMain, serveParent } from "./lib.js";
import { library } from "./library.js";

/** What the bench's connections are named after: `gwl-bench-tp/<process>/<role>`. */
export const APPLICATION_PREFIX = "gwl-bench-tp";

/**
 * - `lock`: the library's lock session (one per Locks instance: the goal is one per process);
 * - `locks-pool`: the Locks instance's own pool (enqueues, introspection, its migration check);
 * - `worker`: graphile-worker's pool (fetching, completing, LISTEN).
 */
export type ConnectionRole = "lock" | "locks-pool" | "worker";
export const CONNECTION_ROLES: ConnectionRole[] = ["lock", "locks-pool", "worker"];

export function applicationName(processName: string, role: ConnectionRole): string {
  return `${APPLICATION_PREFIX}/${processName}/${role}`;
}

/** Parses a name made by `applicationName`; null for any other connection. */
export function parseApplicationName(
  name: string,
): { processName: string; role: ConnectionRole } | null {
  const [prefix, processName, role, ...rest] = name.split("/");
  if (prefix !== APPLICATION_PREFIX || !processName || rest.length > 0) return null;
  return CONNECTION_ROLES.includes(role as ConnectionRole)
    ? { processName, role: role as ConnectionRole }
    : null;
}

/**
 * `url` with its `application_name` set. node-postgres lets a connection string's parameters override
 * the client config, so a pool's name has to go into its URL (and the lock session needs a URL without
 * one, as `lockConnectionString`, for the library's `applicationName` option to apply).
 */
export function withApplicationName(url: string, name: string): string {
  const parsed = new URL(url);
  parsed.searchParams.set("application_name", name);
  return parsed.toString();
}

/** Makes the Locks instance of a benchmark process, its three kinds of connections told apart by name. */
export function makeNamedLocks(url: string, processName: string, logger: Logger): Locks {
  return library.makeLocks({
    connectionString: withApplicationName(url, applicationName(processName, "locks-pool")),
    lockConnectionString: url,
    applicationName: applicationName(processName, "lock"),
    logger,
  });
}

export type ProcessVariant = "plain" | "wrapped";

/** Completions are reported at most this often (a few IPC messages per run and process). */
const PROGRESS_INTERVAL_MS = 20;

/** graphile-worker's `preset.worker`, as the section's configurations give it. */
export type WorkerOptions = NonNullable<GraphileConfig.Preset["worker"]>;

/** A worker process's account of one run. */
export interface ProcessReport {
  name: string;
  /** `job:complete` events without an error. */
  completed: number;
  failed: number;
  /** From receiving `start` until its first `job:start`, ms (null if it ran none). */
  startupMs: number | null;
  /** From receiving `start` until its last `job:complete`, ms (null if it ran none). */
  lastCompleteMs: number | null;
  /** CPU time of this process (user + system) from receiving `start` to receiving `stop`, µs. */
  cpuUs: number;
  /** Statements sent on the lock session from `start` to `stop`. */
  lockStatements: number;
  conflicts: number;
  /** Locks this process still held once its runner had stopped (must be 0). */
  heldAfterRun: number;
  /** V8 heap used after the runner stopped, after a full garbage collection when `gc` is true. */
  heapUsedBytes: number;
  gc: boolean;
}

export type ParentMessage =
  | {
      type: "start";
      /** Numbers the run, so that a late `progress` message of an earlier one is not counted. */
      run: number;
      variant: ProcessVariant;
      taskIdentifier: string;
      concurrency: number;
      worker: WorkerOptions;
    }
  | { type: "stop" };

/** A `progress` event's data. */
export interface Progress {
  run: number;
  completed: number;
}

/** A no-op task. */
const noop: Task = async () => undefined;

/** `to − from` in ms, or null when `to` never happened (NaN does not survive IPC). */
const since = (from: number, to: number): number | null =>
  Number.isFinite(to) ? Math.round((to - from) * 10) / 10 : null;

/** `global.gc` when this process runs with --expose-gc. */
const gc = (globalThis as { gc?: () => void }).gc;

/** One runner's run, from `start` to `stop`. */
interface CurrentRun {
  runner: Runner;
  detach: () => void;
  startedAt: number;
  cpuBefore: NodeJS.CpuUsage;
  statementsBefore: number;
  conflictsBefore: number;
  counts: { completed: number; failed: number; firstStart: number; lastComplete: number };
  stopping: boolean;
}

async function main(): Promise<void> {
  const url = process.env.DATABASE_URL;
  if (!url) throw new Error("throughput-worker: DATABASE_URL is not set");
  const name = process.env.WORKER_NAME ?? String(process.pid);
  const quiet = new Logger(() => () => undefined);

  const locks = makeNamedLocks(url, name, quiet);
  let conflicts = 0;
  locks.events.on("lock:conflict", () => {
    conflicts++;
  });
  // One wrapped definition per task identifier, as an application has, not a new wrapper per run.
  const wrapped = new Map<string, Task>();
  const taskFor = (variant: ProcessVariant, taskIdentifier: string): Task => {
    if (variant === "plain") return noop;
    let task = wrapped.get(taskIdentifier);
    if (!task) {
      task = locks.exclusive(taskIdentifier, noop, { onConflict: "drop" });
      wrapped.set(taskIdentifier, task);
    }
    return task;
  };

  let current: CurrentRun | undefined;

  const start = async (message: Extract<ParentMessage, { type: "start" }>): Promise<void> => {
    if (current) throw new Error("a runner is already running");
    const startedAt = performance.now();
    const cpuBefore = process.cpuUsage();
    const events = new EventEmitter() as WorkerEvents;
    const counts = { completed: 0, failed: 0, firstStart: Number.NaN, lastComplete: Number.NaN };
    events.once("job:start", () => {
      counts.firstStart = performance.now();
    });
    let progressScheduled = false;
    const reportProgress = () => {
      progressScheduled = false;
      send("progress", { run: message.run, completed: counts.completed } satisfies Progress);
    };
    events.on("job:complete", ({ error }) => {
      counts.lastComplete = performance.now();
      if (!progressScheduled) {
        progressScheduled = true;
        setTimeout(reportProgress, PROGRESS_INTERVAL_MS);
      }
      if (!error) {
        counts.completed++;
        return;
      }
      if (counts.failed++ === 0) send("failed", `a job failed: ${String(error)}`);
    });
    const detach = message.variant === "wrapped" ? locks.attach({ events }) : () => undefined;
    const statementsBefore = locks.status().statements;
    const conflictsBefore = conflicts;
    let runner: Runner;
    try {
      runner = await run({
        connectionString: withApplicationName(url, applicationName(name, "worker")),
        concurrency: message.concurrency,
        taskList: { [message.taskIdentifier]: taskFor(message.variant, message.taskIdentifier) },
        noHandleSignals: true,
        // Irrelevant: every job is in the table before the runner starts.
        pollInterval: 1000,
        logger: quiet,
        events,
        preset: { worker: { ...message.worker } },
      });
    } catch (error) {
      detach();
      throw error;
    }
    const thisRun: CurrentRun = {
      runner,
      detach,
      startedAt,
      cpuBefore,
      statementsBefore,
      conflictsBefore,
      counts,
      stopping: false,
    };
    current = thisRun;
    void runner.promise.then(
      () => {
        if (!thisRun.stopping) send("failed", "the runner stopped by itself");
      },
      (error: unknown) => {
        if (!thisRun.stopping) send("failed", `the runner failed: ${String(error)}`);
      },
    );
  };

  const stop = async (): Promise<ProcessReport> => {
    const thisRun = current;
    if (!thisRun) throw new Error("no runner is running");
    // Taken first: stopping the runner is not part of the run.
    const cpu = process.cpuUsage(thisRun.cpuBefore);
    const lockStatements = locks.status().statements - thisRun.statementsBefore;
    thisRun.stopping = true;
    try {
      await thisRun.runner.stop();
    } finally {
      thisRun.detach();
      current = undefined;
    }
    gc?.();
    const status = locks.status();
    const { counts } = thisRun;
    return {
      name,
      completed: counts.completed,
      failed: counts.failed,
      startupMs: since(thisRun.startedAt, counts.firstStart),
      lastCompleteMs: since(thisRun.startedAt, counts.lastComplete),
      cpuUs: cpu.user + cpu.system,
      lockStatements,
      conflicts: conflicts - thisRun.conflictsBefore,
      heldAfterRun: status.held.length,
      heapUsedBytes: process.memoryUsage().heapUsed,
      gc: gc !== undefined,
    };
  };

  /** Stops whatever runs and closes the lock session; never throws (we are leaving). */
  const shutDown = async (): Promise<void> => {
    if (current) {
      current.stopping = true;
      await current.runner.stop().catch(() => undefined);
      current = undefined;
    }
    await locks.release().catch(() => undefined);
  };

  const send = serveParent<ParentMessage>({ start, stop }, shutDown);
  await locks.connect();
  send("ready");
}

if (isMain(import.meta.url)) {
  main().catch((error: unknown) => {
    console.error(`[throughput-worker ${process.env.WORKER_NAME ?? process.pid}] failed:`, error);
    process.exit(1);
  });
}
