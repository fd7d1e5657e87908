/**
 * Errors thrown by graphile-worker-locks. Every error carries a stable, readable `code`; subclasses exist
 * only where callers are expected to branch on them.
 */
import type { Job } from "graphile-worker";

/** Codes carried by {@link LocksError} and its subclasses. */
export const ErrorCodes = {
  /** Another holder has the key; thrown by the `raise` conflict strategy. */
  LOCK_CONFLICT: "GWL_LOCK_CONFLICT",
  /** The lock session is down (reconnecting or closed); the job is retried rather than run unlocked. */
  LOCK_SESSION_UNAVAILABLE: "GWL_LOCK_SESSION_UNAVAILABLE",
  /** The lock session died while the job held its key. */
  LOCK_LOST: "GWL_LOCK_LOST",
  /**
   * PostgreSQL could not take the lock for want of resources (SQLSTATE class 53), most often because its
   * shared lock table is full (53200, "out of shared memory"). The session is intact: the job goes back to
   * the queue without its attempt counted; see {@link lockTableFull}.
   */
  LOCK_TABLE_FULL: "GWL_LOCK_TABLE_FULL",
  /**
   * A newer job of the same key superseded this one (`supersede`): the reason of its abort signal; see
   * {@link SupersededError}.
   */
  SUPERSEDED: "GWL_SUPERSEDED",
  /** A unique job already exists; thrown by the `raise` unique conflict strategy. */
  UNIQUE_CONFLICT: "GWL_UNIQUE_CONFLICT",
  /** Bad options or a value that cannot be turned into a key. */
  INVALID_ARGUMENT: "GWL_INVALID_ARGUMENT",
  /** graphile-worker's schema is not installed in the database. */
  SCHEMA_MISSING: "GWL_SCHEMA_MISSING",
  /**
   * graphile-worker's schema is at a migration level this library was not tested with; see
   * {@link UntestedWorkerSchemaError}.
   */
  WORKER_SCHEMA_UNTESTED: "GWL_WORKER_SCHEMA_UNTESTED",
  /** The `Locks` instance was released. */
  RELEASED: "GWL_RELEASED",
  /**
   * The lock session goes through a pooler that does not give it a backend of its own: its statements reach
   * more than one PostgreSQL backend (transaction mode), its backend carries another session's mark, or its
   * backend is reset under it. Session advisory locks do not hold there: the session refuses to take any lock.
   */
  LOCK_SESSION_POOLED: "GWL_LOCK_SESSION_POOLED",
  /** A named prepared statement failed behind a pooler that does not carry prepared statements. */
  PREPARED_STATEMENTS_UNSUPPORTED: "GWL_PREPARED_STATEMENTS_UNSUPPORTED",
  /** Thrown by a task to give its job back to the queue for a while; see {@link SnoozeError}. */
  SNOOZE: "GWL_SNOOZE",
  /** Thrown by a task to pause its key; see {@link PauseError}. */
  PAUSE: "GWL_PAUSE",
  /** A task threw a `PauseError` but its task has neither a `rate` nor `pausable: true`. */
  NOT_PAUSABLE: "GWL_NOT_PAUSABLE",
} as const;

export type ErrorCode = (typeof ErrorCodes)[keyof typeof ErrorCodes];

/** Base class of every error this library throws (except argument `TypeError`s, see {@link InvalidArgumentError}). */
export class LocksError extends Error {
  readonly code: ErrorCode;
  constructor(code: ErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
  }
}

/** Thrown by an exclusive task using `onConflict: "raise"` when its key is held elsewhere. */
export class LockConflictError extends LocksError {
  readonly taskIdentifier: string;
  readonly lockKey: bigint;
  constructor(taskIdentifier: string, lockKey: bigint, options?: { cause?: unknown }) {
    super(
      ErrorCodes.LOCK_CONFLICT,
      `Lock ${lockKey} for task '${taskIdentifier}' is held by another job; graphile-worker will retry this job`,
      options,
    );
    this.taskIdentifier = taskIdentifier;
    this.lockKey = lockKey;
  }
}

/**
 * The reason a superseded job's `helpers.abortSignal` fires with: a newer job of its key was enqueued with
 * `supersede` (the task's option, or the enqueue's). The job should stop; it ends as completed whether it
 * stops or not (not failed, not retried), and keeps its key until it returns.
 */
export class SupersededError extends LocksError {
  readonly taskIdentifier: string;
  /** The key whose newer job superseded this one (slot 0 of the task's key). */
  readonly lockKey: bigint;
  /** The superseded job. */
  readonly jobId: string | null;
  /** The job that superseded it. */
  readonly byJobId: string;
  constructor(
    taskIdentifier: string,
    lockKey: bigint,
    jobId: string | null,
    byJobId: string,
    options?: { cause?: unknown },
  ) {
    super(
      ErrorCodes.SUPERSEDED,
      `Job ${jobId ?? "(none)"} of task '${taskIdentifier}' was superseded by job ${byJobId} of its key ${lockKey}: stop; it ends as completed`,
      options,
    );
    this.taskIdentifier = taskIdentifier;
    this.lockKey = lockKey;
    this.jobId = jobId;
    this.byJobId = byJobId;
  }
}

/**
 * Bad input: an unknown option value, or a payload that JSON cannot carry faithfully. It is a `TypeError`
 * (as validation errors conventionally are) that also carries a `code`, and it is always thrown before
 * anything is written.
 */
export class InvalidArgumentError extends TypeError {
  readonly code = ErrorCodes.INVALID_ARGUMENT;
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "InvalidArgumentError";
  }
}

/** The lock session is not connected, so no lock can be taken; the job is retried later. */
export function lockSessionUnavailable(reason: string, cause?: unknown): LocksError {
  return new LocksError(
    ErrorCodes.LOCK_SESSION_UNAVAILABLE,
    `The lock session is unavailable (${reason}); the job will be retried rather than run unlocked`,
    { cause },
  );
}

/**
 * The lock session could not connect: says where to and why (refused, unreachable, DNS, authentication,
 * missing database), with the driver's error as `cause`. Its code is GWL_LOCK_SESSION_UNAVAILABLE.
 */
export function lockSessionConnectFailed(target: string, cause: unknown): LocksError {
  return new LocksError(
    ErrorCodes.LOCK_SESSION_UNAVAILABLE,
    `The lock session could not connect to ${target} (${connectFailureReason(cause)})`,
    { cause },
  );
}

/** Why a connection failed, in words, from a node-postgres or Node.js network error. */
export function connectFailureReason(error: unknown): string {
  const e = error as { code?: unknown; message?: unknown } | null;
  const code = typeof e?.code === "string" ? e.code : undefined;
  const message = typeof e?.message === "string" ? e.message : String(error);
  switch (code) {
    case "ECONNREFUSED":
      return "connection refused";
    case "ENOTFOUND":
    case "EAI_AGAIN":
    case "EAI_NONAME":
      return "host name not resolved (DNS)";
    case "EHOSTUNREACH":
    case "ENETUNREACH":
      return "host unreachable";
    case "ETIMEDOUT":
      return "connection timed out";
    case "ECONNRESET":
      return "connection reset by the server";
    case "28P01":
      return `authentication failed: ${message}`;
    case "28000":
      return `authentication rejected: ${message}`;
    case "3D000":
      return `database missing: ${message}`;
    case "57P03":
      return `the server is not accepting connections yet: ${message}`;
    case "53300":
      return `too many connections: ${message}`;
    default:
      return code ? `${message} [${code}]` : message;
  }
}

/**
 * The lock session's statements reached a second PostgreSQL backend: it goes through a pooler in transaction
 * (or statement) mode, where a session advisory lock stays on a pooled backend that other clients then use.
 */
export function lockSessionPooled(detail: string): LocksError {
  return new LocksError(
    ErrorCodes.LOCK_SESSION_POOLED,
    `The lock session goes through a connection pooler in transaction mode (${detail}): session advisory ` +
      "locks do not work there, so no lock is taken. Set `lockConnectionString` to a direct connection to " +
      "PostgreSQL or to a session-mode pool (enqueueing and graphile-worker may stay on the transaction-mode pool)",
  );
}

/** SQLSTATEs of a named prepared statement a pooler's backend does not have (26000) or has already (42P05). */
const PREPARED_STATEMENT_STATES: ReadonlySet<string> = new Set(["26000", "42P05"]);

/**
 * Whether `error` is PostgreSQL's refusal of a named prepared statement that the connection's backend does
 * not have, or has already: what a pooler that does not carry prepared statements causes. Such a statement
 * did not run (the error comes at its parse or bind).
 */
export function isPreparedStatementError(error: unknown): boolean {
  const code = (error as { code?: unknown } | null)?.code;
  const message = (error as { message?: unknown } | null)?.message;
  return (
    typeof code === "string" &&
    PREPARED_STATEMENT_STATES.has(code) &&
    typeof message === "string" &&
    message.includes("prepared statement")
  );
}

/**
 * `error` as a GWL_PREPARED_STATEMENTS_UNSUPPORTED error (with `error` as its `cause`) when it is a missing
 * or duplicate prepared statement, which is what a pooler that does not carry prepared statements causes;
 * otherwise `error` itself.
 */
function explainPreparedStatementError(error: unknown): unknown {
  if (!isPreparedStatementError(error)) return error;
  const { code, message } = error as { code: string; message: string };
  return new LocksError(
    ErrorCodes.PREPARED_STATEMENTS_UNSUPPORTED,
    `${message} [${code}]: the connection goes through a pooler that does not carry prepared statements ` +
      "(PgBouncer in transaction mode before 1.21, or without `max_prepared_statements`). Pass " +
      "`preparedStatements: false` to makeLocks and `noPreparedStatements: true` to graphile-worker, or " +
      "set PgBouncer's `max_prepared_statements` (1.21+)",
    { cause: error },
  );
}

/** Rethrows `error`, explained by {@link explainPreparedStatementError}: for a query's `catch`. */
export function rethrowExplained(error: unknown): never {
  throw explainPreparedStatementError(error);
}

/** SQLSTATE of PostgreSQL's "out of shared memory" when its lock table is full (also plain out of memory). */
const OUT_OF_MEMORY = "53200";

/**
 * Whether `error` is PostgreSQL refusing a statement for want of resources (SQLSTATE class 53:
 * insufficient_resources, out_of_memory, disk_full, configuration_limit_exceeded). The statement failed, the
 * connection did not: what the statement did not finish is undone (or, for session locks, can be read back).
 */
export function isOutOfResources(error: unknown): boolean {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" && code.length === 5 && code.startsWith("53");
}

/** The server's lock table settings, read when a lock statement met a full table. */
export interface LockTableSize {
  maxLocksPerTransaction: number;
  maxConnections: number;
  maxPreparedTransactions: number;
}

/**
 * A lock statement failed for want of resources (`cause`, SQLSTATE class 53): for a full lock table (53200),
 * the message names the setting to raise and, when `size` is known, how many entries the table holds.
 */
export function lockTableFull(cause: unknown, size: LockTableSize | null): LocksError {
  const code = (cause as { code?: unknown } | null)?.code;
  const message = (cause as { message?: unknown } | null)?.message;
  const what = `${typeof message === "string" ? message : String(cause)} [${String(code)}]`;
  let advice = "";
  if (code === OUT_OF_MEMORY) {
    const formula = "max_locks_per_transaction × (max_connections + max_prepared_transactions)";
    const holds = size
      ? `${formula} = ${size.maxLocksPerTransaction} × (${size.maxConnections} + ${size.maxPreparedTransactions}) = ${
          size.maxLocksPerTransaction * (size.maxConnections + size.maxPreparedTransactions)
        } entries`
      : formula;
    advice =
      `: PostgreSQL's shared lock table is full (it holds ${holds}, shared by every session). ` +
      "Raise the server setting `max_locks_per_transaction` (a restart applies it)";
  }
  return new LocksError(
    ErrorCodes.LOCK_TABLE_FULL,
    `The lock session could not take a lock (${what})${advice}; the job goes back to the queue without its attempt counted`,
    { cause },
  );
}

export function lockLost(cause?: unknown): LocksError {
  return new LocksError(
    ErrorCodes.LOCK_LOST,
    "The lock session was lost while this job held its lock; another job may now hold the key",
    { cause },
  );
}

/**
 * Thrown by `onDuplicate: "raise"` when a unique job with the same key already blocks this one. Carries
 * the existing job (null when only its id is known, e.g. a bulk enqueue inside an aborted transaction).
 */
export class UniqueConflictError extends LocksError {
  readonly uniqueKey: string;
  readonly existingJobId: string | null;
  readonly existingJob: Job | null;
  constructor(
    taskIdentifier: string,
    uniqueKey: string,
    existingJobId: string | null,
    existingJob: Job | null,
    options?: { cause?: unknown },
  ) {
    super(
      ErrorCodes.UNIQUE_CONFLICT,
      `A job of task '${taskIdentifier}' with unique key ${uniqueKey} already exists${existingJobId ? ` (job ${existingJobId})` : ""}`,
      options,
    );
    this.uniqueKey = uniqueKey;
    this.existingJobId = existingJobId;
    this.existingJob = existingJob;
  }
}

/**
 * graphile-worker's schema is at a migration level this library was not tested with. The library writes
 * into graphile-worker's private job table, whose shape may change with any release, so it refuses to run
 * rather than guess; `allowUntestedWorkerSchema: true` overrides.
 */
export class UntestedWorkerSchemaError extends LocksError {
  readonly workerSchema: string;
  /** graphile-worker's migration level found (the highest id of `<workerSchema>.migrations`; 0: none). */
  readonly level: number;
  /** The graphile-worker versions this library is tested with, and the migration level of each. */
  readonly tested: ReadonlyArray<{ version: string; level: number }>;
  constructor(
    workerSchema: string,
    level: number,
    tested: ReadonlyArray<{ version: string; level: number }>,
    options?: { cause?: unknown },
  ) {
    super(
      ErrorCodes.WORKER_SCHEMA_UNTESTED,
      `graphile-worker's schema '${workerSchema}' is at migration ${level}, which graphile-worker-locks was not tested with: it supports ${tested.map((t) => `graphile-worker ${t.version} (migration ${t.level})`).join(" and ")}. Use a supported graphile-worker version, or set \`allowUntestedWorkerSchema: true\` once you have checked this one`,
      options,
    );
    this.workerSchema = workerSchema;
    this.level = level;
    this.tested = tested;
  }
}

/** Checks a delay given to `snooze` or `pause`: a non-negative finite number of milliseconds. */
function assertDelay(name: string, ms: unknown): asserts ms is number {
  if (typeof ms !== "number" || !Number.isFinite(ms) || ms < 0) {
    throw new InvalidArgumentError(
      `\`${name}\` needs a non-negative number of milliseconds, got ${String(ms)}`,
    );
  }
}

/**
 * Thrown by a task (of `locks.exclusive`) to give its job back to the queue to run `ms` from now (on the
 * database's clock), without counting an attempt. The job completes without running further; its copy
 * runs later. See also {@link snooze}.
 */
export class SnoozeError extends LocksError {
  readonly ms: number;
  constructor(ms: number) {
    assertDelay("snooze", ms);
    super(ErrorCodes.SNOOZE, `Snoozed for ${ms} ms`);
    this.ms = ms;
  }
}

/** Gives the running job back to the queue to run `ms` from now, without counting an attempt: throws a {@link SnoozeError}. */
export function snooze(ms: number): never {
  throw new SnoozeError(ms);
}

/** Which key a pause stops: the job's rate key, or its (lock) key. */
export type PauseScope = "rate" | "key";

/**
 * Thrown by a task (of `locks.exclusive` with a `rate` or `pausable: true`) to pause its key for `ms`: no
 * job of that key starts before then, in any process (the pause lives in the database, so it survives a
 * restart of the worker, and ends on its own). The job itself goes back to the queue, without counting an
 * attempt, to run when the pause ends. `scope`: `"rate"` pauses the job's rate key (the default when the
 * task has a `rate`), `"key"` its lock key (the task's `key` option). See also {@link pause}.
 */
export class PauseError extends LocksError {
  readonly ms: number;
  readonly scope: PauseScope | undefined;
  constructor(ms: number, options?: { scope?: PauseScope }) {
    assertDelay("pause", ms);
    const scope = options?.scope;
    if (scope !== undefined && scope !== "rate" && scope !== "key") {
      throw new InvalidArgumentError(
        `\`pause\`: \`scope\` must be "rate" or "key", got ${JSON.stringify(scope)}`,
      );
    }
    super(ErrorCodes.PAUSE, `Paused for ${ms} ms`);
    this.ms = ms;
    this.scope = scope;
  }
}

/** Pauses the running job's key for `ms` and gives the job back to run then: throws a {@link PauseError}. */
export function pause(ms: number, options?: { scope?: PauseScope }): never {
  throw new PauseError(ms, options);
}

/** A task threw a {@link PauseError} that its task's options cannot carry out; the job fails with this. */
export class NotPausableError extends LocksError {
  readonly taskIdentifier: string;
  constructor(taskIdentifier: string, reason: string, options?: { cause?: unknown }) {
    super(
      ErrorCodes.NOT_PAUSABLE,
      `Task '${taskIdentifier}' threw a PauseError, but ${reason}`,
      options,
    );
    this.taskIdentifier = taskIdentifier;
  }
}
