/**
 * Options of `makeLocks` and `locks.exclusive`, their defaults, and their validation. Validation errors are
 * `InvalidArgumentError`s (a `TypeError`) naming the option in backticks.
 */
import type { Pool, PoolClient, Client } from "pg";
import type { Logger, TaskSpec } from "graphile-worker";
import { InvalidArgumentError } from "./errors.js";
import type { LimitRule } from "./key.js";
import { resolveRate, type RateOptions, type ResolvedRate } from "./rates/options.js";

const CONFLICT_STRATEGIES = ["drop", "reschedule", "raise"] as const;
/** What an exclusive job does when its key is held: see the README. */
export type ConflictStrategy = (typeof CONFLICT_STRATEGIES)[number];

/**
 * The `reschedule` strategy parks a conflicting job until its key frees: the releasing worker wakes it at
 * once. These delays are the safety net, when no release wakes it (its holder crashed, say).
 */
export interface RescheduleOptions {
  /** Delay after the first conflict, in milliseconds. @defaultValue `5000` */
  minDelay?: number;
  /** The delay doubles with each consecutive conflict on the same key, up to this. @defaultValue `60000` */
  maxDelay?: number;
  /** Fraction of the delay that is randomised (0 to 1) so that waiting jobs spread out. @defaultValue `0.5` */
  jitter?: number;
}

export interface ExclusiveOptions<TPayload = unknown> extends UniqueOptions<TPayload> {
  /**
   * What to do when the job's key is held by another job when it is about to run.
   * - `"drop"`: complete the job without running it (que-locks semantics).
   * - `"reschedule"`: replace it by a copy that runs later, without counting an attempt.
   * - `"raise"`: throw a `LockConflictError`, so graphile-worker retries it with its own backoff.
   * @defaultValue `"drop"`
   */
  onConflict?: ConflictStrategy;
  /** What identifies "the same job": the value whose canonical JSON makes the key. @defaultValue the whole payload */
  key?: (payload: TPayload) => unknown;
  /**
   * How many jobs with the same key may run at once: a number, or a function of the key value (what `key`
   * returns, not the rest of the payload, so that every job of a key agrees), which must return a positive
   * integer. @defaultValue `1`
   */
  limit?: number | ((keyValue: never) => number);
  /**
   * Shares lock keys across tasks that name the same group: jobs of those tasks whose `key` values are equal
   * take the same key (and its `limit` slots). Tasks of one group should agree on `limit`.
   * @defaultValue the task identifier
   */
  lockGroup?: string;
  /**
   * Several limits, all of which a job must get a slot of before it runs: taken all or nothing, in one lock
   * statement. Each limit has its own `key` (default: the task's `key`), `limit` (a number or a function of
   * its key value; default `1`) and `group` (default: the task's `lockGroup`). Replaces `limit`; a list of
   * one is the same as the task's own `key`, `limit` and `lockGroup`.
   * @defaultValue none (the task's single limit)
   */
  limits?: ReadonlyArray<LimitOptions<TPayload>>;
  /**
   * Whether `addJob` drops a job up front when its key is held.
   * @defaultValue `true` with `onConflict: "drop"`, `false` otherwise (jobs that must run later are never dropped)
   */
  preemptive?: boolean;
  /** Backoff of the `reschedule` strategy. */
  reschedule?: RescheduleOptions;
  /**
   * Whether a new job of a key stops the job running for it (latest wins): the running job's
   * `helpers.abortSignal` fires with a `SupersededError`, in whatever process it runs; it ends as completed
   * (not failed, not retried) whether it stops or not, and keeps its key until it returns; the new job runs
   * as soon as it lets go. Jobs of the key still waiting (queued or parked) are removed by the enqueue
   * (`addJob` or `addJobs`). With `limit > 1` every job running for the key is stopped (with several
   * `limits`, the first limit's key). Needs `onConflict: "reschedule"` (the new job waits for the one it
   * stops). Per enqueue: `spec.supersede`.
   * @defaultValue `false`
   */
  supersede?: boolean;
  /**
   * Throttle per key: at most `rate.limit` starts of a key in any `rate.period` (ms), across every process.
   * A job over the rate goes back to the queue, without an attempt counted, to run when its slot frees.
   * @defaultValue none
   */
  rate?: RateOptions<TPayload>;
  /**
   * Whether the task's jobs take an execution lock. `false` makes a task with a `rate` (or `pausable`) and
   * no lock: its jobs may run at once, only their starts are counted.
   * @defaultValue `true`
   */
  lock?: boolean;
  /**
   * Whether the task may pause its key (`PauseError`, `pause(ms)`), and so whether its starts check for a
   * pause (one statement per job).
   * @defaultValue `true` with a `rate`, else `false`
   */
  pausable?: boolean;
}

/** One limit of `limits`. */
export interface LimitOptions<TPayload = unknown> {
  /** The value whose canonical JSON makes this limit's key. @defaultValue the task's `key` */
  key?: (payload: TPayload) => unknown;
  /** How many jobs of a key value may hold this limit at once, or a function of the key value. @defaultValue `1` */
  limit?: number | ((keyValue: never) => number);
  /** The key space of this limit (shared with the tasks and limits that name it). @defaultValue the task's `lockGroup` */
  group?: string;
}

export interface ResolvedExclusiveOptions<TPayload = unknown> {
  onConflict: ConflictStrategy;
  key: (payload: TPayload) => unknown;
  /** How errors name the key value: `payload`, or `key(payload)` with a custom `key`. */
  keyPath: string;
  limit: number | ((keyValue: never) => number);
  /** The key space of the task's keys; undefined: the task identifier. */
  lockGroup: string | undefined;
  /** Two or more limits, each with its own key, limit and group; null for the single limit above. */
  limits: readonly LimitRule[] | null;
  preemptive: boolean;
  reschedule: Required<RescheduleOptions>;
  supersede: boolean;
  /** The throttle, if any. */
  rate: ResolvedRate | null;
  /** Whether jobs take an execution lock. */
  lock: boolean;
  /** Whether starts check for a pause (and the task may pause). */
  pausable: boolean;
}

/** Options of `locks.define`: a task's rules without its function, for processes that only enqueue. */
export interface DefineOptions<TPayload = unknown> extends ExclusiveOptions<TPayload> {
  /** Whether the task is exclusive (its jobs take a lock, and enqueues get the preemptive check). @defaultValue `false` */
  exclusive?: boolean;
}

export interface LocksOptions {
  /** Connection string for enqueueing and introspection (and for the lock session, unless `lockConnectionString` is set). */
  connectionString?: string;
  /** An existing pool for enqueueing and introspection, instead of `connectionString`. Not closed by `release()`. */
  pgPool?: Pool;
  /**
   * Connection string of the lock session. Set it when `connectionString` or `pgPool` goes through
   * PgBouncer in transaction mode: session advisory locks need a direct connection to PostgreSQL.
   * @defaultValue `connectionString`, or the pool's connection settings
   */
  lockConnectionString?: string;
  /** This library's schema. @defaultValue `"graphile_worker_locks"` */
  schema?: string;
  /** graphile-worker's schema; must match the runner's `schema`. @defaultValue `"graphile_worker"` */
  workerSchema?: string;
  /**
   * Whether to run against a graphile-worker schema at a migration level this library was not tested with
   * (graphile-worker 0.17.3: 19, 0.18.0: 20), instead of refusing with an `UntestedWorkerSchemaError` at the
   * first use. The library writes into graphile-worker's private job table, whose shape may change with any
   * release: only set it after checking that version yourself. A warning is logged when it applies.
   * @defaultValue `false`
   */
  allowUntestedWorkerSchema?: boolean;
  /**
   * `application_name` of the lock session, shown by `heldLocks()` and `pg_stat_activity`.
   * @defaultValue `"graphile-worker-locks/<host>/<pid>"` (cut to PostgreSQL's 63 characters)
   */
  applicationName?: string;
  /** Where warnings go. @defaultValue graphile-worker's console logger */
  logger?: Logger;
  /** How often the lock session is checked while it holds locks, in ms (detects a silently dead connection). @defaultValue `5000` */
  heartbeatInterval?: number;
  /**
   * How long the lock session may leave a heartbeat or a lock statement unanswered before it counts as lost
   * (the holders' abort signals fire, `lock:lost`, reconnection), in ms; also how long a connection attempt
   * may stall before it is cut and tried again. Generous, so that a busy server is not mistaken for a dead
   * network. @defaultValue `20000`
   */
  heartbeatTimeout?: number;
  /**
   * How long, in ms, the server keeps the locks of a lock session whose network went silent (a partition: no
   * reset, no answer) before it ends the session and frees them, counted from the last packet it had from it:
   * never sooner, at most a tenth (or 1 s) later (the next keepalive probe). Set as TCP keepalives and
   * `tcp_user_timeout` of the session's backend (keepalives at whole seconds; `tcp_user_timeout` is Linux
   * only, elsewhere the keepalives alone end it, in about the same time). It must exceed `heartbeatInterval + heartbeatTimeout`, the time the holder
   * takes to find the connection dead (its abort signals fire first), or another process could take a key
   * while its holder still runs unaware.
   * @defaultValue `60000`, or `2 × (heartbeatInterval + heartbeatTimeout)` when that is longer
   */
  partitionTimeout?: number;
  /**
   * How long a job that finds the lock session unavailable (reconnecting after a lost connection) waits for
   * it, in ms. A job whose session comes back in time runs then; otherwise it goes back to the queue without
   * its attempt counted (`job:deferred`) and runs as soon as the session is back. It never runs unlocked. A
   * job whose lock PostgreSQL could not take for want of lock memory (a full lock table) goes back at once
   * and runs again this much later (at least a second).
   * @defaultValue `5000`
   */
  lockSessionWait?: number;
  /** Reconnection backoff of the lock session, in ms. @defaultValue `{ min: 100, max: 5000 }` */
  reconnectDelay?: { min?: number; max?: number };
  /** Defaults for every exclusive task of this instance. */
  defaults?: ExclusiveOptions;
  /**
   * Whether enqueue and introspection statements, and those a job sends on graphile-worker's connection
   * (its rate's start, a `reschedule` job's park), are prepared (named). Turn off behind a connection pooler
   * that cannot carry prepared statements (PgBouncer in transaction mode before 1.21), as graphile-worker's
   * `noPreparedStatements`. The lock session always prepares its statement (it is a direct connection).
   * @defaultValue `true`
   */
  preparedStatements?: boolean;
}

/** A graphile-worker `TaskSpec` plus what this library adds to an enqueue. */
export interface AddJobSpec extends TaskSpec, UniqueOptions<never> {
  /**
   * Override the task's `preemptive` option for this call. `true` on a task that is not exclusive on this
   * instance checks the lock of the default derivation (whole payload, limit 1).
   */
  preemptive?: boolean;
  /**
   * Whether this job supersedes the jobs of its key: the running one is told to stop, the waiting ones are
   * removed (see the exclusive option `supersede`). Only on a task defined with `onConflict: "reschedule"`;
   * `false` turns the task's `supersede` off for this enqueue. A superseding enqueue has no preemptive
   * check, and is told at commit: inside a transaction that rolls back, nothing is stopped or removed.
   * @defaultValue the task's `supersede`
   */
  supersede?: boolean;
  /** Enqueue on this client, e.g. inside your own transaction. @defaultValue the Locks pool */
  pgClient?: PoolClient | Client;
}

/** Checks the timing options of `makeLocks` (positive numbers of ms, where given). */
export function validateLocksTimings(options: LocksOptions): void {
  for (const name of ["heartbeatInterval", "heartbeatTimeout"] as const) {
    const value = options[name];
    if (value === undefined) continue;
    if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
      throw new InvalidArgumentError(
        `\`${name}\` must be a positive number of milliseconds, got ${String(value)}`,
      );
    }
  }
  if (options.lockSessionWait !== undefined)
    assertNonNegative("lockSessionWait", options.lockSessionWait);
  resolvePartitionTimeout(options);
}

/**
 * `partitionTimeout`, or its default; refused when the server could free a silent holder's locks before the
 * holder's heartbeat finds its connection dead.
 */
export function resolvePartitionTimeout(options: LocksOptions): number {
  const detection = (options.heartbeatInterval ?? 5000) + (options.heartbeatTimeout ?? 20_000);
  const value = options.partitionTimeout;
  if (value === undefined) return Math.max(60_000, 2 * detection);
  if (typeof value !== "number" || !Number.isFinite(value) || value < 1000) {
    throw new InvalidArgumentError(
      `\`partitionTimeout\` must be a number of milliseconds of at least 1000, got ${String(value)}`,
    );
  }
  if (value <= detection) {
    throw new InvalidArgumentError(
      `\`partitionTimeout\` (${value} ms) must exceed \`heartbeatInterval\` + \`heartbeatTimeout\` (${detection} ms): ` +
        "the server would free the locks of a holder cut off by the network before the holder finds out, and " +
        "another process could take a key while its holder still runs",
    );
  }
  return value;
}

/** A `limit` option: a positive integer, or a function of the key value (checked where it is called). */
function assertLimit(name: string, value: unknown): number | ((keyValue: never) => number) {
  if (typeof value === "function") return value as (keyValue: never) => number;
  if (typeof value !== "number" || !Number.isInteger(value) || value < 1) {
    throw new InvalidArgumentError(
      `\`${name}\` must be a positive integer or a function of the key value, got ${String(value)}`,
    );
  }
  return value;
}

/** A group option (`lockGroup`, a limit's `group`): a non-empty string that is not only whitespace. */
function assertGroup(name: string, value: unknown): string | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== "string" || value.trim().length === 0) {
    throw new InvalidArgumentError(
      `\`${name}\` must be a non-empty string, got ${JSON.stringify(value) ?? String(value)}`,
    );
  }
  return value;
}

/** Checks `limits` and fills in each limit's defaults from the task's `key` and `lockGroup`. */
function resolveLimits(
  limits: ReadonlyArray<LimitOptions<never>>,
  taskKey: ((payload: never) => unknown) | undefined,
  lockGroup: string | undefined,
): LimitRule[] {
  if (!Array.isArray(limits) || limits.length === 0) {
    throw new InvalidArgumentError(
      `\`limits\` must be a non-empty array of { key?, limit?, group? }, got ${Array.isArray(limits) ? "[]" : String(limits)}`,
    );
  }
  return limits.map((entry: unknown, i) => {
    if (!entry || typeof entry !== "object" || Array.isArray(entry)) {
      throw new InvalidArgumentError(
        `\`limits[${i}]\` must be an object { key?, limit?, group? }, got ${String(entry)}`,
      );
    }
    for (const name of Object.keys(entry)) {
      if (name !== "key" && name !== "limit" && name !== "group") {
        throw new InvalidArgumentError(
          `\`limits[${i}]\`: unknown option \`${name}\` (known: key, limit, group)`,
        );
      }
    }
    const { key, limit, group } = entry as LimitOptions<never>;
    if (key !== undefined && typeof key !== "function") {
      throw new InvalidArgumentError(
        `\`limits[${i}].key\` must be a function of the payload, got ${typeof key}`,
      );
    }
    const own = key ?? taskKey;
    return {
      key: own ?? ((payload: never) => payload),
      keyPath: own ? "key(payload)" : "payload",
      limit: assertLimit(`limits[${i}].limit`, limit ?? 1),
      group: assertGroup(`limits[${i}].group`, group) ?? lockGroup,
    };
  });
}

function assertNonNegative(name: string, value: unknown): asserts value is number {
  if (typeof value !== "number" || !Number.isFinite(value) || value < 0) {
    throw new InvalidArgumentError(
      `\`${name}\` must be a non-negative number, got ${String(value)}`,
    );
  }
}

/**
 * `options` over `defaults`, checked and with their defaults filled in. `taskIdentifier`, when given, is named
 * by the errors that concern the task as a whole (`supersede` without `onConflict: "reschedule"`).
 */
export function resolveExclusiveOptions<TPayload>(
  options: ExclusiveOptions<TPayload> | undefined,
  defaults: ExclusiveOptions | undefined,
  taskIdentifier?: string,
): ResolvedExclusiveOptions<TPayload> {
  const merged = { ...defaults, ...options } as ExclusiveOptions<TPayload>;
  validateUniqueOptions(merged as UniqueOptions<never>, "task options");
  const onConflict = merged.onConflict ?? "drop";
  if (!CONFLICT_STRATEGIES.includes(onConflict)) {
    throw new InvalidArgumentError(
      `\`onConflict\` must be one of ${CONFLICT_STRATEGIES.map((s) => `"${s}"`).join(", ")}, got ${JSON.stringify(onConflict)}`,
    );
  }
  if (merged.key !== undefined && typeof merged.key !== "function") {
    throw new InvalidArgumentError(
      `\`key\` must be a function of the payload, got ${typeof merged.key}`,
    );
  }
  let limit = assertLimit("limit", merged.limit ?? 1);
  let lockGroup = assertGroup("lockGroup", merged.lockGroup);
  let key = merged.key;
  let limits: LimitRule[] | null = null;
  if (merged.limits !== undefined) {
    if (options?.limit !== undefined && options.limits !== undefined) {
      throw new InvalidArgumentError(
        "`limit` and `limits` cannot both be set: give each limit of `limits` its own `limit`",
      );
    }
    limits = resolveLimits(merged.limits as ReadonlyArray<LimitOptions<never>>, key, lockGroup);
    if (limits.length === 1) {
      // One limit is the task's single limit: today's keys and statements.
      const only = limits[0]!;
      key = only.keyPath === "payload" ? undefined : (only.key as (payload: TPayload) => unknown);
      limit = only.limit;
      lockGroup = only.group;
      limits = null;
    }
  }
  const rate = resolveRate(merged.rate);
  const lock = merged.lock ?? true;
  if (typeof lock !== "boolean") {
    throw new InvalidArgumentError(`\`lock\` must be a boolean, got ${typeof lock}`);
  }
  const pausable = merged.pausable ?? rate !== null;
  if (typeof pausable !== "boolean") {
    throw new InvalidArgumentError(`\`pausable\` must be a boolean, got ${typeof pausable}`);
  }
  if (!lock && !rate && !pausable) {
    throw new InvalidArgumentError(
      "`lock: false` needs a `rate` (or `pausable: true`): a task with neither has nothing to enforce (for unique enqueues alone, use `locks.unique`)",
    );
  }
  if (!lock && merged.preemptive === true) {
    throw new InvalidArgumentError(
      "`preemptive: true` needs a lock: with `lock: false` no key is held to drop a job for",
    );
  }
  if (!lock && (merged.limits !== undefined || merged.supersede === true)) {
    throw new InvalidArgumentError(
      `\`${merged.limits !== undefined ? "limits" : "supersede"}\` needs a lock: with \`lock: false\` no key is held`,
    );
  }
  if (!lock && merged.limit !== undefined && merged.limit !== 1) {
    throw new InvalidArgumentError(
      "`limit` needs a lock: with `lock: false` jobs of a key run at once without bound (use `rate` to bound their starts)",
    );
  }
  // Dropping at enqueue is only in keeping with a task that drops at run time too.
  const preemptive = merged.preemptive ?? (lock && onConflict === "drop");
  if (typeof preemptive !== "boolean") {
    throw new InvalidArgumentError(`\`preemptive\` must be a boolean, got ${typeof preemptive}`);
  }
  const reschedule = {
    minDelay: 5000,
    maxDelay: 60_000,
    jitter: 0.5,
    ...defaults?.reschedule,
    ...options?.reschedule,
  };
  assertNonNegative("reschedule.minDelay", reschedule.minDelay);
  assertNonNegative("reschedule.maxDelay", reschedule.maxDelay);
  assertNonNegative("reschedule.jitter", reschedule.jitter);
  if (reschedule.jitter > 1) {
    throw new InvalidArgumentError(
      `\`reschedule.jitter\` must be between 0 and 1, got ${reschedule.jitter}`,
    );
  }
  if (reschedule.maxDelay < reschedule.minDelay) {
    throw new InvalidArgumentError(
      `\`reschedule.maxDelay\` (${reschedule.maxDelay}) must not be below \`reschedule.minDelay\` (${reschedule.minDelay})`,
    );
  }
  const supersede = merged.supersede ?? false;
  if (typeof supersede !== "boolean") {
    throw new InvalidArgumentError(`\`supersede\` must be a boolean, got ${typeof supersede}`);
  }
  if (supersede && onConflict !== "reschedule") {
    throw new InvalidArgumentError(
      `${taskIdentifier === undefined ? "" : `task '${taskIdentifier}': `}\`supersede\` needs \`onConflict: "reschedule"\` (the new job waits for the one it stops; "${onConflict}" would drop it or fail it instead), got \`onConflict: "${onConflict}"\``,
    );
  }
  return {
    onConflict,
    key: key ?? ((payload: TPayload) => payload),
    keyPath: key ? "key(payload)" : "payload",
    limit,
    lockGroup,
    limits,
    preemptive,
    reschedule,
    supersede,
    rate,
    lock,
    pausable,
  };
}

const UNIQUE_SCOPES = ["queued", "active", "exists"] as const;
/**
 * How long an existing job refuses a duplicate:
 * - `queued`: until it starts running.
 * - `active`: until it succeeds or fails for good (refused while queued, running, or waiting to retry).
 * - `exists`: while graphile-worker has its row, permanently failed included.
 */
export type UniqueScope = (typeof UNIQUE_SCOPES)[number];

const DUPLICATE_STRATEGIES = ["reject", "raise", "replace"] as const;
/**
 * What an enqueue does when a job with its unique key already refuses it:
 * - `reject`: add nothing; the result carries the existing job and `outcome: "duplicate"`.
 * - `raise`: throw a `UniqueConflictError` carrying the existing job.
 * - `replace`: update the existing job's payload, `runAt` and `priority` if it has not started
 *   (`outcome: "replaced"`); if it has, behave as `reject`.
 */
export type DuplicateStrategy = (typeof DUPLICATE_STRATEGIES)[number];

/**
 * `enqueueRate`: at most `limit` jobs of a key added in any `period` (a sliding window, counted on the
 * database's clock at each enqueue); an enqueue over it adds nothing and answers `outcome: "rateLimited"`.
 */
export interface EnqueueRateOptions<TPayload = unknown> {
  /** How many jobs of a key may be added in any `period`. A positive integer. */
  limit: number;
  /** The window, in milliseconds. */
  period: number;
  /** What identifies a key. @defaultValue the task's `key` option if it is exclusive, else the whole payload */
  key?: (payload: TPayload) => unknown;
  /** Shares the count across tasks that name the same group. @defaultValue the task identifier */
  group?: string;
}

/**
 * `debounce`: the jobs of a key enqueued in a burst collapse into one run, `delay` after the last enqueue
 * but never later than `maxWait` after the first; the run gets the last enqueue's payload (and its task,
 * queue, priority, `maxAttempts` and flags). A collapsed enqueue answers `outcome: "debounced"` with the
 * job that will run. A burst ends when its run starts.
 */
export interface DebounceOptions<TPayload = unknown> {
  /** How long after the last enqueue of a burst its run starts, in milliseconds. */
  delay: number;
  /** The latest the run starts after the first enqueue of its burst, in milliseconds; at least `delay`. */
  maxWait: number;
  /**
   * Whether an enqueue that finds its key quiet (no enqueue for `delay`, no pending run) runs at once; the
   * enqueues that follow it collapse into one trailing run. @defaultValue `false`
   */
  leading?: boolean;
  /** What identifies a key. @defaultValue the task's `key` option if it is exclusive, else the whole payload */
  key?: (payload: TPayload) => unknown;
  /** Shares bursts across tasks that name the same group. @defaultValue the task identifier */
  group?: string;
}

/**
 * Options that shape what an enqueue adds (uniqueness, rates, debounce): each a task option, and each also
 * per enqueue, where it overrides the task's.
 */
export interface UniqueOptions<TPayload = unknown> {
  /**
   * At most `limit` jobs of a key added in any `period`; the excess is refused (`outcome: "rateLimited"`,
   * event `job:rateLimited`). Per enqueue, `false` bypasses the task's. @defaultValue none
   */
  enqueueRate?: EnqueueRateOptions<TPayload> | false;
  /**
   * Collapses the enqueues of a key into one run (`outcome: "debounced"`, event `job:debounced`). Cannot be
   * combined with `unique`, `uniqueFor`, `enqueueRate`, `runAt` or a job key. Per enqueue, `false` bypasses
   * the task's. @defaultValue none
   */
  debounce?: DebounceOptions<TPayload> | false;
  /** The uniqueness scope, or `false` for none (per enqueue: bypasses the task's uniqueness). @defaultValue none */
  unique?: UniqueScope | false;
  /**
   * A window in seconds, counted from the job's `runAt` (so a scheduled delay counts). With a scope it bounds
   * the scope; alone, duplicates are refused until it expires, whatever became of the job. @defaultValue none
   */
  uniqueFor?: number | null;
  /** What identifies a duplicate. @defaultValue the task's `key` option if it is exclusive, else the whole payload */
  uniqueKey?: (payload: TPayload) => unknown;
  /** Shares unique keys across tasks that name the same group. @defaultValue the task identifier */
  uniqueGroup?: string;
  /** Whether the queue name is part of the unique key. @defaultValue `false` */
  uniqueByQueue?: boolean;
  /** @defaultValue `"reject"` */
  onDuplicate?: DuplicateStrategy;
}

export function validateUniqueOptions(
  options: UniqueOptions<never> | undefined,
  where: string,
): void {
  if (!options) return;
  const { unique, uniqueFor, uniqueKey, uniqueGroup, uniqueByQueue, onDuplicate } = options;
  validateEnqueueLimits(options, where);
  if (unique !== undefined && unique !== false && !UNIQUE_SCOPES.includes(unique)) {
    throw new InvalidArgumentError(
      `${where}: \`unique\` must be one of ${UNIQUE_SCOPES.map((s) => `"${s}"`).join(", ")} or false, got ${JSON.stringify(unique)}`,
    );
  }
  if (uniqueFor !== undefined && uniqueFor !== null) {
    if (typeof uniqueFor !== "number" || !Number.isFinite(uniqueFor) || uniqueFor <= 0) {
      throw new InvalidArgumentError(
        `${where}: \`uniqueFor\` must be a positive number of seconds, got ${String(uniqueFor)}`,
      );
    }
  }
  if (uniqueKey !== undefined && typeof uniqueKey !== "function") {
    throw new InvalidArgumentError(
      `${where}: \`uniqueKey\` must be a function of the payload, got ${typeof uniqueKey}`,
    );
  }
  if (uniqueGroup !== undefined && (typeof uniqueGroup !== "string" || uniqueGroup.length === 0)) {
    throw new InvalidArgumentError(
      `${where}: \`uniqueGroup\` must be a non-empty string, got ${String(uniqueGroup)}`,
    );
  }
  if (uniqueByQueue !== undefined && typeof uniqueByQueue !== "boolean") {
    throw new InvalidArgumentError(
      `${where}: \`uniqueByQueue\` must be a boolean, got ${typeof uniqueByQueue}`,
    );
  }
  if (onDuplicate !== undefined && !DUPLICATE_STRATEGIES.includes(onDuplicate)) {
    throw new InvalidArgumentError(
      `${where}: \`onDuplicate\` must be one of ${DUPLICATE_STRATEGIES.map((s) => `"${s}"`).join(", ")}, got ${JSON.stringify(onDuplicate)}`,
    );
  }
}

const RATE_FIELDS = ["limit", "period", "key", "group"];
const DEBOUNCE_FIELDS = ["delay", "maxWait", "leading", "key", "group"];

/** Checks an object option's fields against the known ones, and its `key` and `group`. */
function assertLimitObject(
  value: unknown,
  name: string,
  fields: readonly string[],
  where: string,
): asserts value is { key?: unknown; group?: unknown } {
  if (!value || typeof value !== "object" || Array.isArray(value)) {
    throw new InvalidArgumentError(
      `${where}: \`${name}\` must be an object or false, got ${String(value)}`,
    );
  }
  for (const field of Object.keys(value)) {
    if (!fields.includes(field)) {
      throw new InvalidArgumentError(
        `${where}: unknown option \`${name}.${field}\` (known: ${fields.join(", ")})`,
      );
    }
  }
  const { key, group } = value as { key?: unknown; group?: unknown };
  if (key !== undefined && typeof key !== "function") {
    throw new InvalidArgumentError(
      `${where}: \`${name}.key\` must be a function of the payload, got ${typeof key}`,
    );
  }
  if (group !== undefined && (typeof group !== "string" || group.length === 0)) {
    throw new InvalidArgumentError(
      `${where}: \`${name}.group\` must be a non-empty string, got ${String(group)}`,
    );
  }
}

function assertMilliseconds(value: unknown, name: string, where: string): asserts value is number {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new InvalidArgumentError(
      `${where}: \`${name}\` must be a positive number of milliseconds, got ${String(value)}`,
    );
  }
}

/** Checks `enqueueRate` and `debounce` of a task's options or an enqueue's. */
function validateEnqueueLimits(options: UniqueOptions<never>, where: string): void {
  const { enqueueRate, debounce } = options;
  if (enqueueRate !== undefined && enqueueRate !== false) {
    assertLimitObject(enqueueRate, "enqueueRate", RATE_FIELDS, where);
    const { limit, period } = enqueueRate as EnqueueRateOptions<never>;
    if (typeof limit !== "number" || !Number.isInteger(limit) || limit < 1) {
      throw new InvalidArgumentError(
        `${where}: \`enqueueRate.limit\` must be a positive integer, got ${String(limit)}`,
      );
    }
    assertMilliseconds(period, "enqueueRate.period", where);
  }
  if (debounce !== undefined && debounce !== false) {
    assertLimitObject(debounce, "debounce", DEBOUNCE_FIELDS, where);
    const { delay, maxWait, leading } = debounce as DebounceOptions<never>;
    assertMilliseconds(delay, "debounce.delay", where);
    assertMilliseconds(maxWait, "debounce.maxWait", where);
    if (maxWait < delay) {
      throw new InvalidArgumentError(
        `${where}: \`debounce.maxWait\` (${maxWait}) must not be below \`debounce.delay\` (${delay})`,
      );
    }
    if (leading !== undefined && typeof leading !== "boolean") {
      throw new InvalidArgumentError(
        `${where}: \`debounce.leading\` must be a boolean, got ${typeof leading}`,
      );
    }
  }
  assertDebounceAlone(options, where);
}

/**
 * Refuses `debounce` beside what it cannot be combined with: uniqueness (a debounced key is its own kind
 * of uniqueness) and `enqueueRate` (whether a collapsed enqueue counts would be a guess).
 */
export function assertDebounceAlone(options: UniqueOptions<never>, where: string): void {
  if (!options.debounce) return;
  const other = options.enqueueRate
    ? "enqueueRate"
    : options.unique
      ? "unique"
      : options.uniqueFor != null
        ? "uniqueFor"
        : null;
  if (other) {
    throw new InvalidArgumentError(`${where}: \`debounce\` cannot be combined with \`${other}\``);
  }
}
