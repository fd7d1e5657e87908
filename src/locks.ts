/**
 * `makeLocks`: the factory that owns a pool for enqueueing and introspection, the lock session, the
 * events, and the registry of exclusive tasks defined on it.
 */
import { hostname } from "node:os";
import pg from "pg";
import type { Client, ClientConfig, Pool, PoolClient } from "pg";
import type { Job, JobHelpers, Task, WorkerEvents } from "graphile-worker";
import { consoleLogFactory, Logger } from "graphile-worker";
import type { LocksContext } from "./context.js";
import {
  addJob,
  addJobs,
  lockAvailable,
  type AddJobResult,
  type EnqueuePlan,
  type Queryable,
} from "./enqueue.js";
import { ErrorCodes, InvalidArgumentError, LocksError, UniqueConflictError } from "./errors.js";
import { makeEmitter, type LocksEventEmitter, type LocksEvents } from "./events.js";
import { makeExclusiveTask, type ExclusiveTask } from "./exclusive.js";
import { assertIdentifier, assertJsonSafe, callKeyFunction, lockFlag, slotKeys } from "./key.js";
import { migrateChecked } from "./migrate.js";
import {
  resolveExclusiveOptions,
  validateLocksTimings,
  type AddJobSpec,
  type DefineOptions,
  type ExclusiveOptions,
  type LocksOptions,
  type ResolvedExclusiveOptions,
} from "./options.js";
import { IdleWorkers } from "./idle.js";
import { Prefetcher } from "./prefetch.js";
import type { HandoffCounts } from "./handoff.js";
import { LockSession } from "./session.js";
import { assertSchemaName, makeSql } from "./sql.js";
import type { DeclaredTask, TaskPayload, UndeclaredTask } from "./types.js";
import { resolveUnique, validateUniqueOptions, type UniqueOptions } from "./unique.js";

/** A row of the held-locks view. */
export interface HeldLock {
  lockKey: bigint;
  /** Set for locks taken by this library, once the holder registry caught up (within about half a second). */
  taskIdentifier: string | null;
  jobId: string | null;
  pid: number;
  applicationName: string;
  /** When the lock was taken (null until the registry caught up, or for locks not taken by this library). */
  since: Date | null;
  sessionStartedAt: Date;
}

/** A unique-only task: a graphile-worker task (run as is) whose enqueues are deduplicated. */
export interface UniqueTask<TPayload = unknown> extends Task {
  readonly taskIdentifier: string;
  /** Adds a job of this task under its unique rules (overridable per call). */
  addJob(payload: TPayload, spec?: AddJobSpec): Promise<AddJobResult>;
}

/** An item of `locks.addJobs`. */
export interface AddJobsItem extends AddJobSpec {
  identifier: string;
  payload: unknown;
}

export interface Locks {
  /**
   * Wraps a task so that at most `limit` jobs per key run at once, across every process. A task declared in
   * `GraphileWorker.Tasks` takes its payload type from there.
   */
  exclusive<TIdentifier extends DeclaredTask>(
    taskIdentifier: TIdentifier,
    task: (payload: GraphileWorker.Tasks[TIdentifier], helpers: JobHelpers) => unknown,
    options?: ExclusiveOptions<GraphileWorker.Tasks[TIdentifier]>,
  ): ExclusiveTask<GraphileWorker.Tasks[TIdentifier]>;
  exclusive<TPayload = unknown, TIdentifier extends string = string>(
    taskIdentifier: UndeclaredTask<TIdentifier>,
    task: (payload: TPayload, helpers: JobHelpers) => unknown,
    options?: ExclusiveOptions<TPayload>,
  ): ExclusiveTask<TPayload>;
  /** Defines a task whose enqueues are deduplicated, without an execution lock. Returns the task unchanged in behaviour. */
  unique<TPayload = unknown>(
    taskIdentifier: string,
    task: (payload: TPayload, helpers: JobHelpers) => unknown,
    options: UniqueOptions<TPayload>,
  ): UniqueTask<TPayload>;
  /** Registers a task's rules without its function, for processes that only enqueue. */
  define<TPayload = unknown>(taskIdentifier: string, options: DefineOptions<TPayload>): void;
  /** Whether a job of this task with this payload could take its lock now. Advisory, side-effect free. */
  lockAvailable<TIdentifier extends string>(
    taskIdentifier: TIdentifier,
    payload: TaskPayload<TIdentifier>,
  ): Promise<boolean>;
  /**
   * Adds a job under the rules of the task defined on this instance under `taskIdentifier` (and the
   * spec's overrides): the preemptive check for exclusive tasks, and uniqueness.
   */
  addJob<TIdentifier extends string>(
    taskIdentifier: TIdentifier,
    payload: TaskPayload<TIdentifier>,
    spec?: AddJobSpec,
  ): Promise<AddJobResult>;
  /**
   * Adds many jobs in one statement, deduplicated within the batch and against existing jobs, with an
   * outcome per item in input order. No preemptive check. With `onDuplicate: "raise"` on any item, a
   * duplicate aborts the whole batch.
   */
  addJobs(
    items: readonly AddJobsItem[],
    options?: { pgClient?: PoolClient | Client },
  ): Promise<AddJobResult[]>;
  /** Removes expired `uniqueFor` windows now (it also happens on its own); resolves how many. */
  sweep(): Promise<number>;
  /** Every advisory lock held in the database, with its holder. */
  heldLocks(): Promise<HeldLock[]>;
  /** Typed events; see `LocksEvents`. */
  readonly events: LocksEventEmitter;
  /** Installs or upgrades the library's schema (done automatically on first use). */
  migrate(): Promise<void>;
  /**
   * Opens the lock session now (it otherwise opens when the first exclusive job runs), so that the first
   * job does not wait for it. Rejects if it cannot connect.
   */
  connect(): Promise<void>;
  /** The lock session's state and backend pid, and the keys this process holds. */
  status(): {
    state: string;
    pid: number | null;
    held: Array<{ lockKey: bigint; taskIdentifier: string; jobId: string | null; since: Date }>;
    statements: number;
    /**
     * Hand-offs of `reschedule` keys so far: early wakes of the next job in line, keys passed to the next job
     * in this process without an unlock, and keys taken after waiting for another process's release.
     */
    handoffs: HandoffCounts;
  };
  /**
   * Follows a runner of this process:
   * - Lock-ahead, for a runner with graphile-worker's local queue (`localQueue.size`): the locks of each
   *   fetched batch are taken in one statement as the batch arrives, so jobs start without waiting for
   *   theirs.
   * - Early wakes here, for a runner without one: the next `reschedule` job in line for a key this process
   *   holds is fetched by an idle worker of this runner, so that the key passes to it in memory.
   *
   * Returns a function that detaches (also done when the runner stops).
   */
  attach(runner: { events: WorkerEvents }): () => void;
  /**
   * For graphile-worker's `forbiddenFlags` run option: the flags of the keys this process holds for
   * `reschedule` jobs, so that its workers do not fetch more jobs of a held key only to park them. Jobs
   * enqueued through this library carry their key's flag (`reschedule` tasks with `limit: 1`). graphile-
   * worker calls it before every fetch; it reads memory only. (A non-null `forbiddenFlags` turns off
   * graphile-worker's local queue batching.)
   */
  forbiddenFlags(): string[];
  /** Closes the lock session (releasing every lock it holds) and the pool it created. */
  release(): Promise<void>;
}

/** What is known about a task identifier on this instance. */
interface Definition {
  exclusive: ResolvedExclusiveOptions<never> | null;
  unique: UniqueOptions<never>;
}

const SWEEP_INTERVAL_MS = 60_000;

const DEADLOCK_DETECTED = "40P01";
const DEADLOCK_RETRIES = 5;

/**
 * A bulk enqueue, tried again when PostgreSQL broke a deadlock by aborting it. The batch takes its keys in
 * key order (enqueue_jobs in sql/000001.sql), which rules out the deadlocks of two batches inserting keys in opposite orders;
 * what remains is rare (a batch's second pass over keys that an older job freed meanwhile). On the pool the
 * statement is its own transaction, so an aborted one wrote nothing and is safe to repeat; on the caller's
 * client it may be part of the caller's transaction, which the abort ended, so the error is theirs.
 */
async function addJobsRetryingDeadlocks(
  db: Queryable,
  sql: ReturnType<typeof makeSql>,
  plans: readonly EnqueuePlan[],
  ownTransaction: boolean,
): Promise<AddJobResult[]> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await addJobs(db, sql, plans);
    } catch (error) {
      const code = (error as { code?: string }).code;
      if (!ownTransaction || code !== DEADLOCK_DETECTED || attempt > DEADLOCK_RETRIES) throw error;
    }
  }
}

export function makeLocks(options: LocksOptions): Locks {
  if (!options || (!options.connectionString && !options.pgPool)) {
    throw new InvalidArgumentError("`makeLocks` needs `connectionString` or `pgPool`");
  }
  validateLocksTimings(options);
  const schema = options.schema ?? "graphile_worker_locks";
  const workerSchema = options.workerSchema ?? "graphile_worker";
  assertSchemaName("schema", schema);
  assertSchemaName("workerSchema", workerSchema);
  const logger = options.logger ?? new Logger(consoleLogFactory);
  const ownPool = !options.pgPool;
  const pool: Pool =
    options.pgPool ?? new pg.Pool({ connectionString: options.connectionString, max: 10 });
  if (ownPool)
    pool.on("error", (error) => logger.warn(`graphile-worker-locks pool error: ${error.message}`));
  const sql = makeSql(schema, workerSchema, options.preparedStatements ?? true);
  const events = makeEmitter();
  let released = false;

  // Every entry point installs the schema (and checks graphile-worker's) before its first statement, once
  // per instance: after that, `isMigrated` keeps the check off the hot path.
  let migrated: Promise<void> | undefined;
  let isMigrated = false;
  const ensureMigrated = (): Promise<void> => {
    migrated ??= migrateChecked({
      pgPool: pool,
      schema,
      workerSchema,
      allowUntestedWorkerSchema: options.allowUntestedWorkerSchema ?? false,
    }).then(
      (check) => {
        isMigrated = true;
        if (!check.tested) {
          logger.warn(
            `graphile-worker-locks: graphile-worker's schema '${workerSchema}' is at migration ${check.level}, which this library was not tested with; going ahead because \`allowUntestedWorkerSchema\` is set`,
          );
        }
      },
      (error: unknown) => {
        migrated = undefined;
        throw error;
      },
    );
    return migrated;
  };

  const emit = <K extends keyof LocksEvents>(event: K, payload: LocksEvents[K]): void => {
    if (events.listenerCount(event) === 0) return;
    try {
      events.emit(event, payload);
    } catch (error) {
      logger.error(`A listener of '${event}' threw: ${String(error)}`, { error });
    }
  };

  const lockClientConfig = (): ClientConfig => {
    // Without a connection string, the lock session connects as the given pool does.
    const connectionString = options.lockConnectionString ?? options.connectionString;
    const base: ClientConfig = connectionString
      ? { connectionString }
      : { ...(pool as unknown as { options: ClientConfig }).options };
    return {
      ...base,
      application_name:
        options.applicationName ??
        `graphile-worker-locks/${hostname()}/${process.pid}`.slice(0, 63),
    };
  };

  const idleWorkers = new IdleWorkers();
  const session = new LockSession({
    sql,
    idleWorkers,
    client: lockClientConfig(),
    prepare: ensureMigrated,
    heartbeatIntervalMs: options.heartbeatInterval ?? 5000,
    heartbeatTimeoutMs: options.heartbeatTimeout ?? 20_000,
    registryIntervalMs: 500,
    unlockDelayMs: 2,
    reconnectDelayMs: {
      min: options.reconnectDelay?.min ?? 100,
      max: options.reconnectDelay?.max ?? 5000,
    },
    onLost(holds, error) {
      logger.error(
        `graphile-worker-locks: the lock session was lost (${error.message}); ${holds.length} running job(s) lost their lock and were signalled to abort`,
        { error },
      );
      emit("lock:lost", {
        holds: holds.map((h) => ({
          taskIdentifier: h.info.taskIdentifier,
          lockKey: h.key,
          jobId: h.info.jobId,
        })),
        error,
      });
    },
    onConnected() {
      emit("session:connected", { pid: session.pid });
      cleanParked();
    },
    onWarning(message, error) {
      logger.warn(`graphile-worker-locks: ${message}${error ? `: ${String(error)}` : ""}`, {
        error,
      });
    },
  });

  /** Deletes rows of given-back jobs whose completion was lost (clean_parked); on each (re)connection. */
  const cleanParked = () => {
    // (an instance that never needed the schema does not look for it)
    if (released || !migrated) return;
    migrated
      .then(() => pool.query<{ job_id: string }>(sql.cleanParked))
      .then(
        ({ rows }) => {
          if (rows.length === 0) return;
          const jobIds = rows.map((r) => r.job_id);
          logger.info(
            `graphile-worker-locks: deleted ${jobIds.length} row(s) of parked or deferred jobs whose completion was lost (their copies carry on): ${jobIds.join(", ")}`,
          );
          emit("parked:cleaned", { jobIds });
        },
        (error: unknown) =>
          logger.warn(
            `graphile-worker-locks: cleaning parked jobs' rows failed: ${String(error)}`,
            {
              error,
            },
          ),
      );
  };

  // (and every minute: a job can also fail after it was given back, its process alive)
  const cleanTimer = setInterval(cleanParked, SWEEP_INTERVAL_MS);
  cleanTimer.unref();

  const assertOpen = () => {
    if (released) throw new LocksError(ErrorCodes.RELEASED, "This Locks instance was released");
  };

  const definitions = new Map<string, Definition>();
  const defaultExclusive = resolveExclusiveOptions<never>(undefined, options.defaults);
  /** What a task's `key` makes of a payload, checked (a custom one through callKeyFunction). */
  const keyValue = (
    rules: ResolvedExclusiveOptions<never>,
    taskIdentifier: string,
    payload: unknown,
  ): unknown => {
    if (rules.keyPath === "payload") {
      assertJsonSafe(payload);
      return payload;
    }
    return callKeyFunction(rules.key, "key", taskIdentifier, payload);
  };
  const keysOf = (taskIdentifier: string, payload: unknown) => {
    assertIdentifier(taskIdentifier);
    const rules = definitions.get(taskIdentifier)?.exclusive ?? defaultExclusive;
    return slotKeys(taskIdentifier, keyValue(rules, taskIdentifier, payload), rules.limit, null);
  };

  let lastSweep = Date.now();
  const maybeSweep = (db: Queryable) => {
    if (Date.now() - lastSweep < SWEEP_INTERVAL_MS) return;
    lastSweep = Date.now();
    db.query({ text: sql.sweepUniqueWindows }).catch((error: unknown) =>
      logger.warn(`graphile-worker-locks: sweeping unique windows failed: ${String(error)}`, {
        error,
      }),
    );
  };

  /** Resolves an enqueue, validating everything before anything is written. */
  const plan = (
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
    preemptiveCheck?: boolean,
  ): EnqueuePlan => {
    assertIdentifier(taskIdentifier);
    assertJsonSafe(payload);
    const definition = definitions.get(taskIdentifier);
    const exclusive = definition?.exclusive ?? null;
    const preemptive =
      preemptiveCheck ?? spec?.preemptive ?? (exclusive ? exclusive.preemptive : false);
    // An exclusive task's key is evaluated at every enqueue, whether a check uses it or not, so that a key
    // function that fails does so before anything is written (and not only once a worker runs the job).
    const rules = exclusive ?? (preemptive ? defaultExclusive : null);
    const keyOfPayload = rules
      ? { value: rules.keyPath === "payload" ? payload : keyValue(rules, taskIdentifier, payload) }
      : null;
    const flagged = exclusive?.onConflict === "reschedule" && exclusive.limit === 1;
    const keys =
      rules && (preemptive || flagged)
        ? slotKeys(taskIdentifier, keyOfPayload!.value, rules.limit, null)
        : null;
    const lockKeys = preemptive ? keys : null;
    const unique = resolveUnique(
      taskIdentifier,
      payload,
      definition?.unique,
      spec,
      exclusive ? keyOfPayload! : undefined,
    );
    // A job that waits its turn carries its key as a flag, for runners that skip held keys at fetch.
    let line: EnqueuePlan["line"] = null;
    if (flagged) {
      const key = keys![0]!;
      // (with no safety net to speak of, a job added parked would be fetched at once: no line then)
      const safetyNetMs = exclusive.reschedule.maxDelay;
      if (!unique && !spec?.runAt && safetyNetMs >= 1000) line = { key, safetyNetMs };
      spec = { ...spec, flags: [...(spec?.flags ?? []), lockFlag(key)] };
    }
    return { taskIdentifier, payload, spec, lockKeys, unique, line };
  };

  const report = (result: AddJobResult, p: EnqueuePlan) => {
    const { taskIdentifier, payload, spec } = p;
    switch (result.outcome) {
      case "dropped": {
        const { pgClient: _client, ...rest } = spec ?? {};
        emit("enqueue:dropped", {
          taskIdentifier,
          lockKey: p.lockKeys![0]!,
          payload,
          spec: spec ? rest : undefined,
        });
        break;
      }
      case "duplicate":
        emit("enqueue:duplicate", {
          taskIdentifier,
          uniqueKey: p.unique!.key,
          payload,
          job: result.job,
        });
        break;
      case "replaced":
        emit("enqueue:replaced", {
          taskIdentifier,
          uniqueKey: p.unique!.key,
          payload,
          job: result.job!,
        });
        break;
      case "added":
        break;
    }
  };

  const exclusiveTasks = new Map<string, ExclusiveTask<never>>();
  const prefetcher = new Prefetcher(
    session,
    (job) => exclusiveTasks.get(job.task_identifier)?.lockPlan(job) ?? null,
  );

  const ctx: LocksContext = {
    session,
    sql,
    lockSessionWaitMs: options.lockSessionWait ?? 5000,
    emit,
    prefetched: (jobId) => prefetcher.take(jobId),
    listening: (event) => events.listenerCount(event) > 0,
    async lockAvailable(keys) {
      assertOpen();
      if (!isMigrated) await ensureMigrated();
      return lockAvailable(pool, sql, keys);
    },
    async addJob(taskIdentifier, payload, spec) {
      assertOpen();
      const p = plan(taskIdentifier, payload, spec);
      // (every enqueue statement calls this library's functions, unique or not)
      if (!isMigrated) await ensureMigrated();
      const db: Queryable = spec?.pgClient ?? pool;
      const result = await addJob(db, sql, p);
      report(result, p);
      if (p.unique?.windowSeconds) maybeSweep(pool);
      if (result.outcome === "duplicate" && p.unique?.onDuplicate === "raise") {
        throw new UniqueConflictError(
          taskIdentifier,
          p.unique.key,
          result.job?.id ?? null,
          result.job,
        );
      }
      return result;
    },
  };

  const define = (
    taskIdentifier: string,
    exclusive: ResolvedExclusiveOptions<never> | null,
    unique: UniqueOptions<never>,
  ) => {
    validateUniqueOptions(unique, `'${taskIdentifier}'`);
    definitions.set(taskIdentifier, { exclusive, unique });
  };
  const assertTask = (taskIdentifier: string, task: unknown) => {
    assertOpen();
    assertIdentifier(taskIdentifier);
    if (typeof task !== "function") {
      throw new InvalidArgumentError(
        `\`task\` for '${taskIdentifier}' must be a function, got ${typeof task}`,
      );
    }
  };

  return {
    events,
    exclusive(
      taskIdentifier: string,
      task: (payload: never, helpers: JobHelpers) => unknown,
      taskOptions?: ExclusiveOptions<never>,
      // eslint-disable-next-line @typescript-eslint/no-explicit-any -- one implementation of both overloads
    ): ExclusiveTask<any> {
      assertTask(taskIdentifier, task);
      const resolved = resolveExclusiveOptions(taskOptions, options.defaults);
      define(
        taskIdentifier,
        resolved as ResolvedExclusiveOptions<never>,
        { ...options.defaults, ...taskOptions } as UniqueOptions<never>,
      );
      const exclusive = makeExclusiveTask(ctx, taskIdentifier, task, resolved);
      exclusiveTasks.set(taskIdentifier, exclusive as unknown as ExclusiveTask<never>);
      // eslint-disable-next-line @typescript-eslint/no-explicit-any -- see the signature
      return exclusive as unknown as ExclusiveTask<any>;
    },
    unique(taskIdentifier, task, uniqueOptions) {
      assertTask(taskIdentifier, task);
      exclusiveTasks.delete(taskIdentifier);
      define(taskIdentifier, null, uniqueOptions as UniqueOptions<never>);
      const wrapped: Task = (payload, helpers) =>
        task(payload as never, helpers) as ReturnType<Task>;
      return Object.assign(wrapped, {
        taskIdentifier,
        addJob: (payload: unknown, spec?: AddJobSpec) => ctx.addJob(taskIdentifier, payload, spec),
      }) as UniqueTask<never>;
    },
    define(taskIdentifier, defineOptions) {
      exclusiveTasks.delete(taskIdentifier);
      assertTask(taskIdentifier, () => undefined);
      const { exclusive, ...rest } = defineOptions;
      define(
        taskIdentifier,
        exclusive
          ? (resolveExclusiveOptions(rest, options.defaults) as ResolvedExclusiveOptions<never>)
          : null,
        { ...options.defaults, ...rest } as UniqueOptions<never>,
      );
    },
    async lockAvailable(taskIdentifier, payload) {
      return ctx.lockAvailable(keysOf(taskIdentifier, payload));
    },
    addJob(taskIdentifier, payload, spec) {
      return ctx.addJob(taskIdentifier, payload, spec);
    },
    async addJobs(items, addOptions) {
      assertOpen();
      if (!Array.isArray(items))
        throw new InvalidArgumentError(`\`addJobs\` takes an array, got ${typeof items}`);
      const plans = items.map((item, index) => {
        if (!item || typeof item !== "object") {
          throw new InvalidArgumentError(
            `addJobs: item ${index} must be an object, got ${String(item)}`,
          );
        }
        // The item is its own spec (its `identifier` and `payload` are not read as options); a bulk
        // enqueue has no preemptive check. What is wrong with an item names its index; the cause is the
        // original error (a key function's own, when it threw).
        try {
          return plan(item.identifier, item.payload, item, false);
        } catch (error) {
          if (!(error instanceof InvalidArgumentError)) throw error;
          throw new InvalidArgumentError(`addJobs: item ${index}: ${error.message}`, {
            cause: error.cause ?? error,
          });
        }
      });
      if (!isMigrated) await ensureMigrated();
      const db: Queryable = addOptions?.pgClient ?? pool;
      let results: AddJobResult[];
      try {
        results = await addJobsRetryingDeadlocks(db, sql, plans, !addOptions?.pgClient);
      } catch (error) {
        const e = error as { code?: string; detail?: string; hint?: string };
        if (e.code !== "GWLUQ") throw error;
        const p = plans[Number(e.hint) - 1]!;
        const existingJobId = e.detail || null;
        const existing =
          existingJobId && !addOptions?.pgClient
            ? ((await pool.query<Job>(sql.jobById, [existingJobId])).rows[0] ?? null)
            : null;
        throw new UniqueConflictError(p.taskIdentifier, p.unique!.key, existingJobId, existing, {
          cause: error,
        });
      }
      results.forEach((result, index) => report(result, plans[index]!));
      if (plans.some((p) => p.unique?.windowSeconds)) maybeSweep(pool);
      return results;
    },
    async sweep() {
      assertOpen();
      await ensureMigrated();
      lastSweep = Date.now();
      const { rows } = await pool.query<{ removed: number }>(sql.sweepUniqueWindows);
      return rows[0]!.removed;
    },
    async heldLocks() {
      assertOpen();
      await ensureMigrated();
      const { rows } = await pool.query<{
        lock_key: string;
        task_identifier: string | null;
        job_id: string | null;
        pid: number;
        application_name: string;
        since: Date | null;
        session_started_at: Date;
      }>(sql.heldLocks);
      return rows.map((r) => ({
        lockKey: BigInt(r.lock_key),
        taskIdentifier: r.task_identifier,
        jobId: r.job_id,
        pid: r.pid,
        applicationName: r.application_name,
        since: r.since,
        sessionStartedAt: r.session_started_at,
      }));
    },
    migrate: ensureMigrated,
    forbiddenFlags: () => session.heldFlags(),
    async connect() {
      assertOpen();
      // (here, so that a schema that cannot be installed rejects with its own error)
      await ensureMigrated();
      await session.warmUp();
    },
    attach(runner) {
      assertOpen();
      const detachPrefetcher = prefetcher.attach(runner.events);
      const detachIdle = idleWorkers.attach(runner.events);
      let attached = true;
      const detach = () => {
        if (!attached) return;
        attached = false;
        runner.events.off("stop", detach);
        detachIdle();
        detachPrefetcher();
      };
      runner.events.once("stop", detach);
      return detach;
    },
    status() {
      return {
        state: session.currentState,
        pid: session.pid,
        held: session.heldKeys().map((h) => ({
          lockKey: h.key,
          taskIdentifier: h.info.taskIdentifier,
          jobId: h.info.jobId,
          since: h.since,
        })),
        statements: session.statements,
        handoffs: { ...session.handoffs },
      };
    },
    async release() {
      if (released) return;
      released = true;
      clearInterval(cleanTimer);
      await session.close();
      if (ownPool) await pool.end();
    },
  };
}
