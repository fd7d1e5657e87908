import type { Job } from "graphile-worker";

/**
 * Errors thrown by graphile-worker-locks. Every error carries a stable, readable `code`; subclasses exist
 * only where callers are expected to branch on them.
 */

/** Codes carried by {@link LocksError} and its subclasses. */
export const ErrorCodes = {
  /** Another holder has the key; thrown by the `raise` conflict strategy. */
  LOCK_CONFLICT: "GWL_LOCK_CONFLICT",
  /** The lock session is down (reconnecting or closed); the job is retried rather than run unlocked. */
  LOCK_SESSION_UNAVAILABLE: "GWL_LOCK_SESSION_UNAVAILABLE",
  /** The lock session died while the job held its key. */
  LOCK_LOST: "GWL_LOCK_LOST",
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
