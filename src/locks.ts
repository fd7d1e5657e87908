/**
 * `makeLocks`: the factory that owns a pool for enqueueing and introspection, the lock session, the
 * events, and the registry of exclusive tasks defined on it.
 */
import { hostname } from "node:os";
import pg from "pg";
import type { ClientConfig, Pool } from "pg";
import type { JobHelpers } from "graphile-worker";
import { consoleLogFactory, Logger } from "graphile-worker";
import type { LocksContext } from "./context.js";
import { addJob, lockAvailable, type AddJobResult } from "./enqueue.js";
import { ErrorCodes, InvalidArgumentError, LocksError } from "./errors.js";
import { makeEmitter, type LocksEventEmitter, type LocksEvents } from "./events.js";
import { makeExclusiveTask, type ExclusiveTask } from "./exclusive.js";
import { assertJsonSafe, slotKeys } from "./key.js";
import { migrate } from "./migrate.js";
import {
  resolveExclusiveOptions,
  type AddJobSpec,
  type ExclusiveOptions,
  type LocksOptions,
  type ResolvedExclusiveOptions,
} from "./options.js";
import { LockSession } from "./session.js";
import { makeSql } from "./sql.js";

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

export interface Locks {
  /** Wraps a task so that at most `limit` jobs per key run at once, across every process. */
  exclusive<TPayload = unknown>(
    taskIdentifier: string,
    task: (payload: TPayload, helpers: JobHelpers) => unknown,
    options?: ExclusiveOptions<TPayload>,
  ): ExclusiveTask<TPayload>;
  /** Whether a job of this task with this payload could take its lock now. Advisory, side-effect free. */
  lockAvailable(taskIdentifier: string, payload: unknown): Promise<boolean>;
  /**
   * Adds a job, dropping it up front when its key is held. Uses the options of the exclusive task defined
   * on this instance under `taskIdentifier`, or the defaults (whole payload, limit 1) if there is none.
   */
  addJob(taskIdentifier: string, payload: unknown, spec?: AddJobSpec): Promise<AddJobResult>;
  /** Every advisory lock held in the database, with its holder. */
  heldLocks(): Promise<HeldLock[]>;
  /** Typed events; see `LocksEvents`. */
  readonly events: LocksEventEmitter;
  /** Installs or upgrades the library's schema (done automatically on first use). */
  migrate(): Promise<void>;
  /** The lock session's state and backend pid, and the keys this process holds. */
  status(): {
    state: string;
    pid: number | null;
    held: Array<{ lockKey: bigint; taskIdentifier: string; jobId: string | null; since: Date }>;
    statements: number;
  };
  /** Closes the lock session (releasing every lock it holds) and the pool it created. */
  release(): Promise<void>;
}

function parseConnectionString(connectionString: string): ClientConfig {
  return { connectionString };
}

export function makeLocks(options: LocksOptions): Locks {
  if (!options || (!options.connectionString && !options.pgPool)) {
    throw new InvalidArgumentError("`makeLocks` needs `connectionString` or `pgPool`");
  }
  const schema = options.schema ?? "graphile_worker_locks";
  const workerSchema = options.workerSchema ?? "graphile_worker";
  const logger = options.logger ?? new Logger(consoleLogFactory);
  const ownPool = !options.pgPool;
  const pool: Pool = options.pgPool ?? new pg.Pool({ connectionString: options.connectionString, max: 10 });
  if (ownPool) pool.on("error", (error) => logger.warn(`graphile-worker-locks pool error: ${error.message}`));
  const sql = makeSql(schema, workerSchema);
  const events = makeEmitter();
  const definitions = new Map<string, ResolvedExclusiveOptions<never>>();
  let released = false;

  let migrated: Promise<void> | undefined;
  const ensureMigrated = (): Promise<void> => {
    migrated ??= migrate({ pgPool: pool, schema, workerSchema }).catch((error: unknown) => {
      migrated = undefined;
      throw error;
    });
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
    const base: ClientConfig = options.lockConnectionString
      ? parseConnectionString(options.lockConnectionString)
      : options.connectionString
        ? parseConnectionString(options.connectionString)
        : { ...(pool as unknown as { options: ClientConfig }).options };
    return {
      ...base,
      application_name: options.applicationName ?? `graphile-worker-locks/${hostname()}/${process.pid}`.slice(0, 63),
    };
  };

  const session = new LockSession({
    sql,
    client: lockClientConfig(),
    prepare: ensureMigrated,
    heartbeatIntervalMs: options.heartbeatInterval ?? 5000,
    registryIntervalMs: 500,
    reconnectDelayMs: { min: options.reconnectDelay?.min ?? 100, max: options.reconnectDelay?.max ?? 5000 },
    onLost(holds, error) {
      logger.error(
        `graphile-worker-locks: the lock session was lost (${error.message}); ${holds.length} running job(s) lost their lock and were signalled to abort`,
        { error },
      );
      emit("lock:lost", {
        holds: holds.map((h) => ({ taskIdentifier: h.info.taskIdentifier, lockKey: h.key, jobId: h.info.jobId })),
        error,
      });
    },
    onConnected() {
      emit("session:connected", { pid: session.pid });
    },
    onWarning(message, error) {
      logger.warn(`graphile-worker-locks: ${message}${error ? `: ${String(error)}` : ""}`, { error });
    },
  });

  const assertOpen = () => {
    if (released) throw new LocksError(ErrorCodes.RELEASED, "This Locks instance was released");
  };

  const ctx: LocksContext = {
    session,
    sql,
    emit,
    async lockAvailable(_taskIdentifier, keys) {
      assertOpen();
      await ensureMigrated();
      return lockAvailable(pool, sql, keys);
    },
    async addJob(taskIdentifier, payload, spec, check) {
      assertOpen();
      const preemptive = spec?.preemptive ?? check.preemptive;
      const db = spec?.pgClient ?? pool;
      const result = await addJob(db, sql, taskIdentifier, payload, spec, preemptive ? check.keys : null);
      if (result.outcome === "dropped") {
        const { pgClient: _client, ...rest } = spec ?? {};
        emit("enqueue:dropped", { taskIdentifier, lockKey: check.keys[0]!, payload, spec: spec ? rest : undefined });
      }
      return result;
    },
  };

  const fallback = resolveExclusiveOptions(undefined, options.defaults);
  const definitionOf = (taskIdentifier: string) => definitions.get(taskIdentifier) ?? fallback;
  const keysOf = (taskIdentifier: string, payload: unknown) => {
    const def = definitionOf(taskIdentifier);
    return slotKeys(taskIdentifier, def.key(payload as never), def.limit, def.keyPath);
  };

  return {
    events,
    exclusive(taskIdentifier, task, taskOptions) {
      assertOpen();
      if (typeof taskIdentifier !== "string" || taskIdentifier.length === 0) {
        throw new InvalidArgumentError(`\`taskIdentifier\` must be a non-empty string, got ${String(taskIdentifier)}`);
      }
      if (typeof task !== "function") {
        throw new InvalidArgumentError(`\`task\` for '${taskIdentifier}' must be a function, got ${typeof task}`);
      }
      const resolved = resolveExclusiveOptions(taskOptions, options.defaults);
      definitions.set(taskIdentifier, resolved as ResolvedExclusiveOptions<never>);
      return makeExclusiveTask(ctx, taskIdentifier, task, resolved);
    },
    async lockAvailable(taskIdentifier, payload) {
      return ctx.lockAvailable(taskIdentifier, keysOf(taskIdentifier, payload));
    },
    async addJob(taskIdentifier, payload, spec) {
      assertJsonSafe(payload);
      const keys = keysOf(taskIdentifier, payload);
      return ctx.addJob(taskIdentifier, payload, spec, { keys, preemptive: definitionOf(taskIdentifier).preemptive });
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
      };
    },
    async release() {
      if (released) return;
      released = true;
      await session.close();
      if (ownPool) await pool.end();
    },
  };
}
