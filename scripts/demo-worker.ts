/**
 * The demo's task definitions, and a worker process of `npm run demo`.
 *
 * scripts/demo.ts imports the definitions (to enqueue with the same keys and options the workers use) and
 * forks this file three times as `node --import tsx scripts/demo-worker.ts`. As a process, it runs a
 * graphile-worker runner with the demo's exclusive tasks and writes, while each job holds its lock, an
 * execution record (start and end from the database's clock_timestamp()), and a row for every conflict.
 *
 * Configured by environment variables (DATABASE_URL, DEMO_WORKER, DEMO_CONCURRENCY); controlled over IPC:
 * it sends `ready` once its runner is started, and on `stop` it stops the runner (letting running jobs
 * finish), flushes its records, releases its locks, sends `stopped` and exits. It also stops on SIGINT,
 * SIGTERM, and when the demo process goes away (IPC disconnect).
 */
import { pathToFileURL } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { Logger, run, type Job, type JobHelpers } from "graphile-worker";
import pg from "pg";
import {
  ErrorCodes,
  makeLocks,
  type ExclusiveOptions,
  type ExclusiveTask,
  type Locks,
} from "../src/index.js";

/** Where the demo keeps its records (created by scripts/demo.ts). */
export const DEMO_SCHEMA = "gwl_demo";

/**
 * Every demo job's payload. The key of every task is the account alone; `run` only lets a demo run tell
 * its own jobs and records apart from those of another run on the same database.
 */
export interface DemoPayload {
  account: string;
  run: string;
}

interface DemoTaskSpec {
  options: ExclusiveOptions<DemoPayload>;
  /** One line for the demo's output. */
  description: string;
  /** How long an execution takes, in ms (uniformly random in this range). */
  durationMs: readonly [number, number];
}

const byAccount = (payload: DemoPayload) => payload.account;

/** The demo's exclusive tasks: one per conflict strategy, plus a semaphore (limit 2). */
export const DEMO_TASKS = {
  // Deduplication: a sync that finds another sync of the same account running is redundant.
  sync_account: {
    options: { onConflict: "drop", key: byAccount },
    description: "a duplicate sync is redundant: dropped",
    durationMs: [30, 80],
  },
  // Serialisation: every charge must happen, one at a time per account. A charge that finds the key held
  // is parked and woken the moment the key frees; its safety-net delay (20-200 ms here, 5 s to 60 s by
  // default) only matters if no release wakes it. (The enqueue-time drop is off for reschedule tasks: a
  // charge must not be lost.)
  charge_card: {
    options: {
      onConflict: "reschedule",
      key: byAccount,
      reschedule: { minDelay: 20, maxDelay: 200, jitter: 0.5 },
    },
    description: "all charges run, one at a time; a waiting one starts as soon as the key frees",
    durationMs: [40, 120],
  },
  // Retry: the job fails with a LockConflictError and graphile-worker retries it with its own
  // exponential backoff (e^attempts seconds: 2.7 s, 7.4 s, 20 s, ...).
  send_report: {
    options: { onConflict: "raise", key: byAccount },
    description: "throws a LockConflictError; graphile-worker retries the job",
    durationMs: [100, 150],
  },
  // A semaphore: at most two per account at once; a third is dropped.
  build_export: {
    options: { onConflict: "drop", key: byAccount, limit: 2 },
    description: "at most two per account at once; a third is dropped",
    durationMs: [60, 150],
  },
} as const satisfies Record<string, DemoTaskSpec>;

export type DemoTaskName = keyof typeof DEMO_TASKS;
export const DEMO_TASK_NAMES = Object.keys(DEMO_TASKS) as DemoTaskName[];

export type DemoTaskList = Record<DemoTaskName, ExclusiveTask<DemoPayload>>;

/** Defines the demo's tasks on `locks`; `body` is what an execution does while it holds its lock. */
export function defineDemoTasks(
  locks: Locks,
  body: (task: DemoTaskName, payload: DemoPayload, helpers: JobHelpers) => Promise<void>,
): DemoTaskList {
  const entries = DEMO_TASK_NAMES.map((name) => {
    const options: ExclusiveOptions<DemoPayload> = DEMO_TASKS[name].options;
    const task = locks.exclusive<DemoPayload>(
      name,
      (payload, helpers) => body(name, payload, helpers),
      options,
    );
    return [name, task] as const;
  });
  return Object.fromEntries(entries) as DemoTaskList;
}

/**
 * Whether an error comes from a lost connection to PostgreSQL, or from a server that is shutting down
 * (57P01 "terminating connection due to administrator command", 57P03 "the database system is shutting
 * down"), directly or through this library (its lock session is then unavailable).
 */
export function isConnectionLoss(error: unknown, message = String(error)): boolean {
  const code = (error as { code?: unknown } | undefined)?.code;
  const codes: unknown[] = [
    "57P01",
    "57P03",
    "ECONNREFUSED",
    "ECONNRESET",
    ErrorCodes.LOCK_SESSION_UNAVAILABLE,
    ErrorCodes.LOCK_LOST,
  ];
  return (
    codes.includes(code) ||
    /administrator command|shutting down|Connection terminated|ECONNREFUSED|ECONNRESET|not queryable/.test(
      message,
    )
  );
}

/**
 * graphile-worker's logger (also given to the library), showing warnings and errors only, and not the
 * failures of `raise` jobs (a LockConflictError per conflict is the demo working as intended; the summary
 * counts them). Of the errors of a lost connection, only the first is shown (after Ctrl-C, PostgreSQL gets
 * the signal too, and every pooled connection and running job would otherwise say so), and none once
 * `closing()`.
 */
export function quietLogger(
  prefix: string,
  closing: () => boolean = () => false,
): Logger & { readonly connectionLost: boolean } {
  let connectionLost = false;
  const logger = new Logger(() => (level, message, meta) => {
    if (level !== "error" && level !== "warning") return;
    const error = (meta as { error?: { code?: unknown } } | undefined)?.error;
    if (error?.code === ErrorCodes.LOCK_CONFLICT) return;
    if (isConnectionLoss(error, message)) {
      // While closing on purpose, a connection closing under a late query is no news.
      if (connectionLost || closing()) return;
      connectionLost = true;
      message = `lost the connection to PostgreSQL: ${message} (further such errors are not shown)`;
    }
    console.error(`${prefix} ${level}: ${message}`);
  });
  return Object.defineProperty(logger, "connectionLost", {
    get: () => connectionLost,
  }) as Logger & {
    readonly connectionLost: boolean;
  };
}

/** A pool whose errors (a server-side disconnection of an idle or a busy client) are logged, never thrown. */
export function makePool(config: pg.PoolConfig, logger: Logger, label: string): pg.Pool {
  const pool = new pg.Pool(config);
  pool.on("error", (error) => logger.warn(`${label}: ${error.message}`, { error }));
  pool.on("connect", (client) =>
    client.on("error", (error) => logger.warn(`${label}: ${error.message}`, { error })),
  );
  return pool;
}

async function main(): Promise<void> {
  const url = process.env.DATABASE_URL;
  if (!url) throw new Error("demo-worker: DATABASE_URL is not set");
  const name = process.env.DEMO_WORKER ?? String(process.pid);
  const concurrency = Number(process.env.DEMO_CONCURRENCY ?? 4);
  let stopping: Promise<void> | undefined;
  const logger = quietLogger(`[worker ${name}]`, () => stopping !== undefined);

  // Records go through their own small pool: never through the lock session, and not through
  // graphile-worker's pool, whose connections its runner needs for fetching and completing jobs.
  const records = makePool(
    { connectionString: url, max: concurrency + 2, application_name: `gwl-demo-records/${name}` },
    logger,
    "records pool",
  );
  // graphile-worker's own pool would do, but its shutdown takes the error handlers off that pool before its
  // idle clients are closed: if PostgreSQL goes away meanwhile (Ctrl-C), an unhandled 'error' crashes us.
  const workerPool = makePool(
    { connectionString: url, max: 10, application_name: `gwl-demo-worker/${name}` },
    logger,
    "graphile-worker pool",
  );

  // Conflict rows are written from (synchronous) event listeners; these are flushed before exiting.
  const pending = new Set<Promise<unknown>>();
  const recordConflict = (
    job: Job,
    outcome: string,
    newJobId: string | null,
    local: boolean | null,
  ) => {
    const payload = job.payload as DemoPayload;
    const write = records
      .query(
        `insert into ${DEMO_SCHEMA}.conflicts (run, job_id, task, key, worker, outcome, new_job_id, local)
         values ($1, $2, $3, $4, $5, $6, $7, $8)`,
        [payload.run, job.id, job.task_identifier, payload.account, name, outcome, newJobId, local],
      )
      .catch((error: Error) =>
        logger.error(`could not record a conflict of job ${job.id}: ${error.message}`),
      );
    pending.add(write);
    void write.finally(() => pending.delete(write));
  };

  const locks = makeLocks({
    connectionString: url,
    applicationName: `graphile-worker-locks/demo-worker-${name}`,
    logger,
  });
  // `local`: the key was held by this very process, so no round trip to PostgreSQL was needed to know.
  const localConflicts = new Map<string, boolean>();
  locks.events.on("lock:conflict", ({ job, strategy, local }) => {
    if (strategy === "raise") recordConflict(job, "raised", null, local);
    else localConflicts.set(job.id, local);
  });
  const takeLocal = (job: Job) => {
    const local = localConflicts.get(job.id) ?? null;
    localConflicts.delete(job.id);
    return local;
  };
  locks.events.on("job:dropped", ({ job }) => recordConflict(job, "dropped", null, takeLocal(job)));
  locks.events.on("job:rescheduled", ({ job, newJobId }) =>
    recordConflict(job, "rescheduled", newJobId, takeLocal(job)),
  );
  locks.events.on("lock:lost", ({ holds, error }) =>
    logger.error(`lost ${holds.length} lock(s): ${error.message}`),
  );

  const taskList = defineDemoTasks(locks, async (task, payload, helpers) => {
    // The wrapper took the lock before calling us and releases it after we return: the record's start
    // and end are both written while the lock is held.
    const { rows } = await records.query<{ id: string }>(
      `insert into ${DEMO_SCHEMA}.executions (run, job_id, task, key, lock_key, worker)
       values ($1, $2, $3, $4, $5, $6) returning id`,
      [
        payload.run,
        helpers.job.id,
        task,
        payload.account,
        taskList[task].lockKey(payload).toString(),
        name,
      ],
    );
    const [min, max] = DEMO_TASKS[task].durationMs;
    await sleep(min + Math.random() * (max - min));
    await records.query(
      `update ${DEMO_SCHEMA}.executions set ended_at = clock_timestamp() where id = $1`,
      [rows[0]!.id],
    );
  });

  const runner = await run({
    pgPool: workerPool,
    concurrency,
    taskList,
    noHandleSignals: true,
    // Rescheduled jobs run 20-200 ms later, and graphile-worker only finds jobs scheduled in the future by
    // polling (new jobs due now come with a NOTIFY): poll often so that they do not wait for the default 2 s.
    pollInterval: 100,
    logger,
  });

  const stop = (): Promise<void> =>
    (stopping ??= (async () => {
      // If PostgreSQL went away (the demo was interrupted), the graceful path may hang: give it 10 s.
      setTimeout(() => {
        console.error(`[worker ${name}] could not stop gracefully within 10 s; exiting`);
        process.exit(1);
      }, 10_000).unref();
      try {
        await runner.stop();
        while (pending.size > 0) await Promise.allSettled([...pending]);
      } finally {
        await locks.release();
        await Promise.all([records.end(), workerPool.end()]);
      }
    })());

  process.on("message", (message: { type?: string }) => {
    if (message?.type !== "stop") return;
    stop().then(
      () => process.send?.({ type: "stopped" }, () => process.exit(0)),
      (error: unknown) => {
        console.error(`[worker ${name}] stop failed:`, error);
        process.exit(1);
      },
    );
  });
  // The demo process went away, or Ctrl-C reached the whole process group: stop on our own.
  const stopAndExit = () => {
    stop().then(
      () => process.exit(0),
      () => process.exit(1),
    );
  };
  process.on("disconnect", stopAndExit);
  // Without PostgreSQL, graphile-worker leaves some rejections unhandled, and console.trace()s the failure
  // of its workers' loops: the first connection error said it all already; exit.
  const exitOnConnectionLoss = (reason: unknown): boolean => {
    if (!isConnectionLoss(reason)) return false;
    if (!logger.connectionLost)
      console.error(`[worker ${name}] lost the connection to PostgreSQL; exiting`);
    process.exit(1);
  };
  process.on("unhandledRejection", (reason) => {
    if (exitOnConnectionLoss(reason)) return;
    console.error(`[worker ${name}] unhandled rejection:`, reason);
    process.exit(1);
  });
  const trace = console.trace.bind(console);
  console.trace = (...args: unknown[]) => {
    if (!exitOnConnectionLoss(args[0])) trace(...args);
  };
  process.on("SIGINT", stopAndExit);
  process.on("SIGTERM", stopAndExit);

  process.send?.({ type: "ready", pid: process.pid });
}

// Run as a process only when started as a script, not when scripts/demo.ts imports the definitions.
if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  main().catch((error: unknown) => {
    console.error(`[worker ${process.env.DEMO_WORKER ?? process.pid}] failed:`, error);
    process.exit(1);
  });
}
