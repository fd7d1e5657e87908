/**
 * A worker process of the throughput section (throughput.ts), forked with --expose-gc and kept across
 * runs, so that process start-up is not measured (runner start-up is). It keeps one Locks instance, its
 * lock session opened at start, and starts one graphile-worker runner per run with the run's variant:
 * `plain` (a no-op task), `wrapped` (`locks.exclusive()` around it, `onConflict: "drop"`, with
 * `locks.attach()`), `naive` (`pg_try_advisory_lock` and `pg_advisory_unlock` per job on one connection)
 * or `naiveConn` (the same on a connection of the job's own, from a pool of one per worker). Every
 * connection of the library and of graphile-worker is named `gwl-bench-tp/<process>/<role>`, for the
 * bench to count.
 *
 * Requests: `start` (answers once `run()` resolved) and `stop` (takes the CPU time and lock statements
 * since `start`, then stops the runner, collects garbage and answers a ProcessReport). Events: `progress`
 * (jobs completed in the run so far, at most every 20 ms: the bench polls the job table only once every
 * job is reported) and `failed` (a job failed, or the runner stopped by itself).
 */
import { EventEmitter } from "node:events";
import pg from "pg";
import type { Runner, Task, WorkerEvents } from "graphile-worker";
import { quietLogger, sendEvent, startRunner, workerMain, type RunStart } from "./lib.js";
import { library } from "./library.js";

export const APPLICATION_PREFIX = "gwl-bench-tp";
/**
 * `lock`: the lock session (one per Locks instance: the goal is one per process); `locks-pool`: the
 * instance's own pool (enqueues, introspection, its migration check); `worker`: graphile-worker's pool.
 */
export const CONNECTION_ROLES = ["lock", "locks-pool", "worker"] as const;
export type ConnectionRole = (typeof CONNECTION_ROLES)[number];

export type ProcessVariant = "plain" | "wrapped" | "naive" | "naiveConn";

/** `run` numbers the run, so that a late `progress` event of an earlier one is not counted. */
export type StartRequest = RunStart<ProcessVariant, { run: number; taskIdentifier: string }>;

/** A `progress` event's data. */
export type Progress = { run: number; completed: number };

/** A worker process's account of one run. */
export interface ProcessReport {
  name: string;
  completed: number;
  /** CPU time (user + system) from receiving `start` to receiving `stop`, µs. */
  cpuUs: number;
  /** Statements sent on the variant's lock connection(s). */
  lockStatements: number;
  conflicts: number;
  /** Locks still held once the runner had stopped (must be 0). */
  heldAfterRun: number;
  /** V8 heap used after the runner stopped and a full garbage collection. */
  heapUsedBytes: number;
}

const noop: Task = async () => undefined;

/** A variant's task, with counters of the statements it sent to lock and of the conflicts it met. */
interface Variant {
  task: Task;
  statements(): number;
  conflicts(): number;
}

/** One lock function call of a naive job: `fn` is pg_try_advisory_lock or pg_advisory_unlock. */
type Call = (name: string, fn: string, key: string) => Promise<boolean>;
/** Lends a job, for its duration, the function that sends its lock calls. */
type WithCall = (job: (call: Call) => Promise<void>) => Promise<void>;

const lockCall =
  (client: pg.ClientBase): Call =>
  async (name, fn, key) => {
    const text = `select ${fn}($1::bigint) as ok`;
    return (await client.query<{ ok: boolean }>({ name, text, values: [key] })).rows[0]!.ok;
  };

/** Per job: try-lock, the no-op, unlock, each a round trip on what `withCall` lends it. */
function naiveVariant(taskIdentifier: string, withCall: WithCall): Variant {
  let statements = 0;
  let conflicts = 0;
  const task: Task = async (payload, helpers) => {
    const key = library.lockKey(taskIdentifier, payload).toString();
    await withCall(async (call) => {
      statements++;
      if (!(await call("bench_naive_try_lock", "pg_try_advisory_lock", key)))
        return void conflicts++;
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

workerMain<StartRequest | { type: "stop" }>(import.meta.url, async (url, name) => {
  /** `url` with its application_name: node-postgres lets a URL's parameters override a pool's config. */
  const named = (role: ConnectionRole) => {
    const parsed = new URL(url);
    parsed.searchParams.set("application_name", `${APPLICATION_PREFIX}/${name}/${role}`);
    return parsed.toString();
  };
  const locks = library.makeLocks({
    connectionString: named("locks-pool"),
    // Without a name in it, for `applicationName` to apply.
    lockConnectionString: url,
    applicationName: `${APPLICATION_PREFIX}/${name}/lock`,
    logger: quietLogger,
  });
  let conflicts = 0;
  locks.events.on("lock:conflict", () => void conflicts++);
  const closers: Array<() => Promise<void>> = [];

  /** Every job's calls on one shared connection, queued here one at a time (as node-postgres would, without its warning). */
  const naiveOnOne = (): WithCall => {
    const client = new pg.Client({ connectionString: url, application_name: "gwl-bench-naive" });
    client.on("error", () => undefined);
    closers.push(() => client.end());
    let tail: Promise<unknown> = client.connect();
    const call: Call = (...args) => {
      const result = tail.then(() => lockCall(client)(...args));
      tail = result.catch(() => undefined);
      return result;
    };
    return (job) => job(call);
  };
  /** Each job's calls on a connection of its own, from a pool of one per worker of the busiest configuration. */
  const naivePerJob = (): WithCall => {
    const max = Number(process.env.NAIVE_POOL_SIZE ?? 24);
    const pool = new pg.Pool({
      connectionString: url,
      application_name: "gwl-bench-naive-conn",
      max,
    });
    pool.on("error", () => undefined);
    closers.push(() => pool.end());
    return async (job) => {
      const client = await pool.connect();
      await job(lockCall(client)).finally(() => client.release());
    };
  };

  // One definition per variant and task, as an application has, not a new wrapper per run.
  const variants = new Map<string, Variant>();
  const variantFor = (variant: ProcessVariant, taskIdentifier: string): Variant => {
    const id = `${variant}/${taskIdentifier}`;
    if (!variants.has(id)) {
      const exclusive = () => locks.exclusive(taskIdentifier, noop, { onConflict: "drop" });
      variants.set(
        id,
        variant === "plain"
          ? { task: noop, statements: () => 0, conflicts: () => 0 }
          : variant === "wrapped"
            ? {
                task: exclusive(),
                statements: () => locks.status().statements,
                conflicts: () => conflicts,
              }
            : naiveVariant(taskIdentifier, variant === "naive" ? naiveOnOne() : naivePerJob()),
      );
    }
    return variants.get(id)!;
  };

  type Counts = { statements: number; conflicts: number; completed: number };
  type CurrentRun = {
    runner: Runner;
    variant: Variant;
    detach(): void;
    cpu: NodeJS.CpuUsage;
    counts: Counts;
  };
  let current: (CurrentRun & { stopping: boolean }) | undefined;
  const gc = (globalThis as { gc?: () => void }).gc;
  await locks.connect();

  return {
    handlers: {
      async start(request) {
        if (current) throw new Error("a runner is already running");
        const cpu = process.cpuUsage();
        const events = new EventEmitter() as WorkerEvents;
        const variant = variantFor(request.variant, request.taskIdentifier);
        const detach = request.variant === "wrapped" ? locks.attach({ events }) : () => undefined;
        const counts = {
          statements: variant.statements(),
          conflicts: variant.conflicts(),
          completed: 0,
        };
        let progressScheduled = false;
        let failures = 0;
        events.on("job:complete", ({ error }) => {
          if (!progressScheduled) {
            progressScheduled = true;
            setTimeout(() => {
              progressScheduled = false;
              sendEvent("progress", {
                run: request.run,
                completed: counts.completed,
              } satisfies Progress);
            }, 20);
          }
          if (!error) counts.completed++;
          else if (failures++ === 0) sendEvent("failed", `a job failed: ${String(error)}`);
        });
        const runner = await startRunner({
          connectionString: named("worker"),
          concurrency: request.concurrency,
          taskList: { [request.taskIdentifier]: variant.task },
          // Irrelevant: every job is in the table before the runner starts.
          pollInterval: 1000,
          events,
          preset: { worker: { ...request.worker } },
        }).catch((error: unknown) => {
          detach();
          throw error;
        });
        const thisRun = { runner, variant, detach, cpu, counts, stopping: false };
        current = thisRun;
        runner.promise.then(
          () => thisRun.stopping || sendEvent("failed", "the runner stopped by itself"),
          (error: unknown) =>
            thisRun.stopping || sendEvent("failed", `the runner failed: ${String(error)}`),
        );
      },
      async stop(): Promise<ProcessReport> {
        const thisRun = current;
        if (!thisRun) throw new Error("no runner is running");
        // Taken first: stopping the runner is not part of the run.
        const cpu = process.cpuUsage(thisRun.cpu);
        const lockStatements = thisRun.variant.statements() - thisRun.counts.statements;
        thisRun.stopping = true;
        await thisRun.runner.stop().finally(() => {
          thisRun.detach();
          current = undefined;
        });
        gc?.();
        return {
          name,
          completed: thisRun.counts.completed,
          cpuUs: cpu.user + cpu.system,
          lockStatements,
          conflicts: thisRun.variant.conflicts() - thisRun.counts.conflicts,
          heldAfterRun: locks.status().held.length,
          heapUsedBytes: process.memoryUsage().heapUsed,
        };
      },
    },
    async leave() {
      if (current) {
        current.stopping = true;
        await current.runner.stop().catch(() => undefined);
      }
      await locks.release().catch(() => undefined);
      await Promise.all(closers.map((end) => end().catch(() => undefined)));
    },
  };
});
