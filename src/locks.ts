/**
 * `makeLocks`: the factory that wires one `Locks` instance together. It owns the pool (the caller's or its
 * own), the schema check that runs before the first statement, the lock session (session/), the enqueuer
 * (enqueue/), the events, lock-ahead and idle workers of attached runners, and the rules of the tasks
 * defined on it; `release()` closes what it owns.
 */
import { hostname } from "node:os";
import pg from "pg";
import type { ClientConfig, Pool } from "pg";
import type { JobHelpers, Task } from "graphile-worker";
import { consoleLogFactory, Logger } from "graphile-worker";
import type { LocksContext, PoolClientLike } from "./context.js";
import { makeEnqueuer, type TaskRules } from "./enqueue/enqueue.js";
import {
  ErrorCodes,
  InvalidArgumentError,
  isPreparedStatementError,
  LocksError,
} from "./errors.js";
import { makeEmitter, type LocksEvents } from "./events.js";
import { canStart } from "./exclusive/can-start.js";
import { LockedAborts } from "./exclusive/aborts.js";
import { makeExclusiveTask, type ExclusiveTaskImpl } from "./exclusive/exclusive.js";
import { assertIdentifier } from "./key.js";
import { migrateChecked } from "./migrate.js";
import {
  resolveExclusiveOptions,
  resolvePartitionTimeout,
  validateLocksTimings,
  type AddJobSpec,
  type ExclusiveOptions,
  type LocksOptions,
  type ResolvedExclusiveOptions,
  type UniqueOptions,
  validateUniqueOptions,
} from "./options.js";
import { readHeldLocks } from "./held-locks.js";
import { rateBlockers, readPaused, readThrottled } from "./rates/status.js";
import { Wakes } from "./rates/wakes.js";
import { RATE_LEAD_MS, RATE_WAKE_AHEAD_MS, RATE_WAKE_DEFER_MS } from "./rates/gate.js";
import { IdleWorkers } from "./session/idle.js";
import { LockAhead } from "./session/lock-ahead.js";
import { LockSession } from "./session/session.js";
import { assertSchemaName, makeSql } from "./sql.js";
import type { ExclusiveTask, Locks, UniqueTask } from "./types.js";

/** How often rows of given-back jobs whose completion was lost are looked for, besides each connection. */
const CLEAN_GIVEN_BACK_INTERVAL_MS = 60_000;

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
    partitionTimeoutMs: resolvePartitionTimeout(options),
    registryIntervalMs: 500,
    reconnectDelayMs: {
      min: options.reconnectDelay?.min ?? 100,
      max: options.reconnectDelay?.max ?? 5000,
    },
    onLost(holds, error) {
      const returned = holds.filter((h) => h.releaseRequested);
      logger.error(
        `graphile-worker-locks: the lock session was lost (${error.message}); ${holds.length - returned.length} job(s) lost their lock and were signalled to abort`,
        { error },
      );
      // A job that returned before the loss was noticed, its unlock not yet answered, cannot be told: its
      // backend may have ended (freeing its key for other sessions) while it still ran.
      for (const h of returned) {
        logger.warn(
          `graphile-worker-locks: job ${h.info.jobId} (${h.info.taskIdentifier}) returned before the loss of its lock session was noticed (${error.message}): that its lock ${h.keyText} was held until it returned is not confirmed, and another job of its key may have started while it ran`,
          { error },
        );
      }
      emit("lock:lost", {
        holds: holds.map((h) => ({
          taskIdentifier: h.info.taskIdentifier,
          lockKey: h.key,
          jobId: h.info.jobId,
          returned: h.releaseRequested,
        })),
        error,
      });
    },
    onConnected() {
      emit("session:connected", { pid: session.connection.pid });
      cleanGivenBack();
    },
    onWarning(message, error) {
      logger.warn(`graphile-worker-locks: ${message}${error ? `: ${String(error)}` : ""}`, {
        error,
      });
    },
  });

  /** Deletes rows of given-back jobs whose completion was lost (clean_given_back); on each (re)connection. */
  const cleanGivenBack = () => {
    // (an instance that never needed the schema does not look for it)
    if (released || !migrated) return;
    migrated
      .then(() => pool.query<{ job_id: string }>(sql.cleanGivenBack))
      .then(
        ({ rows }) => {
          if (rows.length === 0) return;
          const jobIds = rows.map((r) => r.job_id);
          logger.info(
            `graphile-worker-locks: deleted ${jobIds.length} row(s) of parked or deferred jobs whose completion was lost (their copies carry on): ${jobIds.join(", ")}`,
          );
          emit("givenBack:cleaned", { jobIds });
        },
        (error: unknown) =>
          logger.warn(
            `graphile-worker-locks: cleaning the rows of given-back jobs failed: ${String(error)}`,
            {
              error,
            },
          ),
      );
  };

  /** Removes throttled keys' start logs that no longer count, and ended pauses (sweep_start_rates). */
  const sweepStartRates = () => {
    if (released || !migrated) return;
    migrated
      .then(() => pool.query(sql.sweepStartRates))
      .catch((error: unknown) =>
        logger.warn(
          `graphile-worker-locks: sweeping start logs and pauses failed: ${String(error)}`,
          {
            error,
          },
        ),
      );
  };

  // (and every minute: a job can also fail after it was given back, its process alive)
  const cleanTimer = setInterval(() => {
    cleanGivenBack();
    sweepStartRates();
  }, CLEAN_GIVEN_BACK_INTERVAL_MS);
  cleanTimer.unref();

  const assertOpen = () => {
    if (released) throw new LocksError(ErrorCodes.RELEASED, "This Locks instance was released");
  };

  const definitions = new Map<string, TaskRules>();
  const enqueuer = makeEnqueuer({
    pool,
    sql,
    rules: definitions,
    defaultExclusive: resolveExclusiveOptions<never>(undefined, options.defaults),
    ready: () => (isMigrated ? undefined : ensureMigrated()),
    emit,
    warn: (message, error) =>
      logger.warn(`graphile-worker-locks: ${message}: ${String(error)}`, { error }),
  });

  const exclusiveTasks = new Map<string, ExclusiveTaskImpl<never>>();
  const lockAhead = new LockAhead(
    session,
    (job) => {
      // (a task without an execution lock takes none ahead either, nor one with a rate: its jobs take their
      // lock only once the rate lets them start, exclusive.ts)
      const task = exclusiveTasks.get(job.task_identifier);
      return task?.options.lock && task.options.rate === null ? task.lockPlan(job) : null;
    },
    (job) => exclusiveTasks.get(job.task_identifier)?.waitsInLine === true,
  );

  const wakes = new Wakes(idleWorkers, async (reserved, count) => {
    if (released) return [];
    let later: Array<{ copy: string; delayMs: number }> = [];
    if (reserved.length > 0) {
      const { rows } = await pool.query<{ copy_id: string; at: Date; now: Date }>(
        sql.rates.wakeReserved,
        [reserved, `${RATE_WAKE_DEFER_MS} milliseconds`, `${RATE_LEAD_MS} milliseconds`],
      );
      later = rows.map((r) => ({
        copy: r.copy_id,
        delayMs: r.at.getTime() - r.now.getTime() - RATE_WAKE_AHEAD_MS,
      }));
    }
    if (count > 0) await pool.query(sql.rates.announce, [count]);
    return later;
  });

  // graphile-worker's pool may go through a pooler that does not carry prepared statements where this
  // instance's own pool does not (`noPreparedStatements` given to graphile-worker alone): a job's statement
  // refused as such runs again unprepared (it did not run), and so do all after it.
  let poolUnprepared = false;
  const ctx: LocksContext = {
    aborts: new LockedAborts(),
    wakeIn: (delayMs, reservedCopy) => wakes.in(delayMs, reservedCopy),
    session,
    sql,
    async poolQuery<R extends Record<string, unknown>>(
      client: PoolClientLike,
      name: string,
      text: string,
      values: unknown[],
    ) {
      const statement = poolUnprepared ? { text, values } : sql.statement(name, text, values);
      try {
        return await client.query<R>(statement);
      } catch (error) {
        if (statement.name === undefined || !isPreparedStatementError(error)) throw error;
        if (!poolUnprepared) {
          poolUnprepared = true;
          logger.warn(
            `graphile-worker-locks: graphile-worker's connection does not carry prepared statements (${String(error)}); the statements jobs send on it go unprepared from now on. Pass \`preparedStatements: false\` to makeLocks when graphile-worker runs with \`noPreparedStatements: true\``,
          );
        }
        return client.query<R>({ text, values });
      }
    },
    lockSessionWaitMs: options.lockSessionWait ?? 5000,
    outage: { waitingForSession: 0, givingBack: 0 },
    emit,
    lockedAhead: (jobId) => lockAhead.take(jobId),
    fetchedInBatch: (jobId) => lockAhead.wasBatched(jobId),
    listening: (event) => events.listenerCount(event) > 0,
    async lockAvailable(keys) {
      assertOpen();
      return enqueuer.lockAvailable(keys);
    },
    async limitsHeld(limits) {
      assertOpen();
      return enqueuer.limitsHeld(limits);
    },
    async addJob(taskIdentifier, payload, spec) {
      assertOpen();
      return enqueuer.addJob(taskIdentifier, payload, spec);
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
      const resolved = resolveExclusiveOptions(taskOptions, options.defaults, taskIdentifier);
      define(
        taskIdentifier,
        resolved as ResolvedExclusiveOptions<never>,
        { ...options.defaults, ...taskOptions } as UniqueOptions<never>,
      );
      const exclusive = makeExclusiveTask(ctx, taskIdentifier, task, resolved);
      // (a task without a lock has nothing to take ahead)
      if (resolved.lock)
        exclusiveTasks.set(taskIdentifier, exclusive as unknown as ExclusiveTaskImpl<never>);
      else exclusiveTasks.delete(taskIdentifier);
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
          ? (resolveExclusiveOptions(
              rest,
              options.defaults,
              taskIdentifier,
            ) as ResolvedExclusiveOptions<never>)
          : null,
        { ...options.defaults, ...rest } as UniqueOptions<never>,
      );
    },
    async lockAvailable(taskIdentifier, payload) {
      const limits = enqueuer.limitKeysOf(taskIdentifier, payload);
      if (limits.length === 1) return ctx.lockAvailable(limits[0]!.slots);
      return (await canStart(limits, ctx.limitsHeld)).ok;
    },
    addJob(taskIdentifier, payload, spec) {
      return ctx.addJob(taskIdentifier, payload, spec);
    },
    async addJobs(items, addOptions) {
      assertOpen();
      return enqueuer.addJobs(items, addOptions);
    },
    async sweep() {
      assertOpen();
      return enqueuer.sweep();
    },
    async heldLocks() {
      assertOpen();
      await ensureMigrated();
      return readHeldLocks(pool, sql);
    },
    async canStart(taskIdentifier, payload) {
      assertOpen();
      assertIdentifier(taskIdentifier);
      const rules = definitions.get(taskIdentifier)?.exclusive;
      // Its limits (none for a task without an execution lock), then its rate and pauses.
      const limits =
        rules?.lock === false
          ? []
          : (await canStart(enqueuer.limitKeysOf(taskIdentifier, payload), ctx.limitsHeld))
              .blockers;
      if (!rules) return { ok: limits.length === 0, blockers: limits };
      await ensureMigrated();
      const rated = await rateBlockers(pool, sql.rates, taskIdentifier, rules, payload);
      const blockers = [...limits, ...rated];
      return { ok: blockers.length === 0, blockers };
    },
    async rateStatus() {
      assertOpen();
      await ensureMigrated();
      const throttled = await readThrottled(pool, sql.rates, null);
      return {
        throttled: throttled.map(({ now: _now, ...key }) => key),
        paused: await readPaused(pool, sql.rates, null),
      };
    },
    migrate: ensureMigrated,
    forbiddenFlags: () => session.heldFlags(),
    async connect() {
      assertOpen();
      // (here, so that a schema that cannot be installed rejects with its own error)
      await ensureMigrated();
      await session.connection.warmUp();
    },
    attach(runner) {
      assertOpen();
      const detachLockAhead = lockAhead.attach(runner.events);
      const detachIdle = idleWorkers.attach(runner.events);
      let attached = true;
      const detach = () => {
        if (!attached) return;
        attached = false;
        runner.events.off("stop", detach);
        detachIdle();
        detachLockAhead();
      };
      runner.events.once("stop", detach);
      return detach;
    },
    status() {
      return {
        state: session.connection.state,
        pid: session.connection.pid,
        held: session.heldKeys().map((h) => ({
          lockKey: h.key,
          taskIdentifier: h.info.taskIdentifier,
          jobId: h.info.jobId,
          since: h.since,
        })),
        statements: session.connection.statements,
        handoffs: { ...session.handoffs },
        outage: { ...ctx.outage },
      };
    },
    async release() {
      if (released) return;
      released = true;
      clearInterval(cleanTimer);
      wakes.clear();
      await session.close();
      if (ownPool) await pool.end();
    },
  };
}
