/**
 * A worker process of the throughput section (bench/throughput.ts), forked once per process of a
 * configuration as `node --import tsx --expose-gc bench/throughput-worker.ts`, and kept up across runs so
 * that process start-up is not measured (runner start-up is).
 *
 * It keeps one Locks instance for its whole life, with the lock session opened at start, and starts one
 * graphile-worker runner per run with the run's variant and options: `plain` (the no-op task), `wrapped`
 * (`locks.exclusive()` around it with `onConflict: "drop"`, and `locks.attach()` for lock-ahead), or the
 * naive wrappers: `naive` (`pg_try_advisory_lock` and `pg_advisory_unlock` per job on one connection) and
 * `naiveConn` (the same on a connection of the job's own, from a pool of one per worker). Every connection
 * of the library and of graphile-worker is named (`applicationName`) so that the bench can count them.
 *
 * Requests (serveParent in lib.ts): `start` (answers once `run()` resolved), `stop` (takes the CPU time and
 * lock statements since `start` first, then stops the runner, collects garbage, and answers the run's
 * report), `leave`. Events: `ready`, `progress` (jobs completed so far, at most every PROGRESS_INTERVAL_MS:
 * the bench polls the job table only once every job is reported) and `failed` (a job failed, or the runner
 * stopped by itself).
 */
import { EventEmitter } from "node:events";
import { performance } from "node:perf_hooks";
import pg from "pg";
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

export type ProcessVariant = "plain" | "wrapped" | "naive" | "naiveConn";

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
  variant: Variant;
  detach: () => void;
  startedAt: number;
  cpuBefore: NodeJS.CpuUsage;
  statementsBefore: number;
  conflictsBefore: number;
  counts: { completed: number; failed: number; firstStart: number; lastComplete: number };
  stopping: boolean;
}

/** A variant's task, with the statements it sent on its lock connection and the conflicts it met. */
interface Variant {
  task: Task;
  statements(): number;
  conflicts(): number;
}

/** One lock function call (`pg_try_advisory_lock` or `pg_advisory_unlock`) of a naive variant's job. */
type NaiveCall = (name: string, fn: string, key: string) => Promise<boolean>;
/** Gives a job, for its duration, the function that sends its lock calls. */
type WithCalls = (job: (call: NaiveCall) => Promise<void>) => Promise<void>;

/** The naive variants' connections, ended when the process leaves. */
const naiveConnections = new Set<() => Promise<void>>();

/** Per job: try_lock, the task, unlock, each a round trip of the connection `withCalls` gives it. */
function naiveVariant(taskIdentifier: string, withCalls: WithCalls): Variant {
  let statements = 0;
  let conflicts = 0;
  const task: Task = async (payload, helpers) => {
    const key = library.lockKey(taskIdentifier, payload).toString();
    await withCalls(async (call) => {
      statements++;
      if (!(await call("bench_naive_try_lock", "pg_try_advisory_lock", key))) {
        conflicts++;
        return;
      }
      try {
        await noop(payload, helpers);
      } finally {
        statements++;
        await call("bench_naive_unlock", "pg_advisory_unlock", key);
      }
    });
  };
  return { task, statements: () => statements, conflicts: () => conflicts };
}

async function lockCall(client: pg.ClientBase, name: string, fn: string, key: string) {
  const text = `select ${fn}($1::bigint) as ok`;
  const { rows } = await client.query<{ ok: boolean }>({ name, text, values: [key] });
  return rows[0]!.ok;
}

/**
 * Every job's calls on one shared connection, queued here one at a time (what node-postgres does itself,
 * but without its deprecation warning for queries issued while another runs).
 */
function naiveOnOne(url: string): WithCalls {
  const client = new pg.Client({ connectionString: url, application_name: "gwl-bench-naive" });
  client.on("error", () => undefined);
  const connected = client.connect();
  connected.catch(() => undefined);
  naiveConnections.add(() => client.end());
  let tail: Promise<unknown> = connected;
  const call: NaiveCall = (name, fn, key) => {
    const result = tail.then(() => lockCall(client, name, fn, key));
    tail = result.catch(() => undefined);
    return result;
  };
  return (job) => job(call);
}

/** Each job's calls on a connection of its own from a pool of one per worker of the busiest configuration. */
function naiveConnPer(url: string): WithCalls {
  const pool = new pg.Pool({
    connectionString: url,
    application_name: "gwl-bench-naive-conn",
    max: Number(process.env.NAIVE_POOL_SIZE ?? 24),
  });
  pool.on("error", () => undefined);
  naiveConnections.add(() => pool.end());
  return async (job) => {
    const client = await pool.connect();
    try {
      await job((name, fn, key) => lockCall(client, name, fn, key));
    } finally {
      client.release();
    }
  };
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
  // One definition per variant and task identifier, as an application has, not a new wrapper per run.
  const variants = new Map<string, Variant>();
  const variantFor = (variant: ProcessVariant, taskIdentifier: string): Variant => {
    const id = `${variant}/${taskIdentifier}`;
    let found = variants.get(id);
    if (!found) {
      found =
        variant === "plain"
          ? { task: noop, statements: () => 0, conflicts: () => 0 }
          : variant === "wrapped"
            ? {
                task: locks.exclusive(taskIdentifier, noop, { onConflict: "drop" }),
                statements: () => locks.status().statements,
                conflicts: () => conflicts,
              }
            : naiveVariant(
                taskIdentifier,
                variant === "naive" ? naiveOnOne(url) : naiveConnPer(url),
              );
      variants.set(id, found);
    }
    return found;
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
    const variant = variantFor(message.variant, message.taskIdentifier);
    const statementsBefore = variant.statements();
    const conflictsBefore = variant.conflicts();
    let runner: Runner;
    try {
      runner = await run({
        connectionString: withApplicationName(url, applicationName(name, "worker")),
        concurrency: message.concurrency,
        taskList: { [message.taskIdentifier]: variant.task },
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
      variant,
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
    const lockStatements = thisRun.variant.statements() - thisRun.statementsBefore;
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
      conflicts: thisRun.variant.conflicts() - thisRun.conflictsBefore,
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
    await Promise.all([...naiveConnections].map((end) => end().catch(() => undefined)));
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
