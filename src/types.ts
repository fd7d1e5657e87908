/**
 * The public types of the library in one place: the `Locks` interface and what its methods take and
 * answer, and payload types from graphile-worker's `GraphileWorker.Tasks` declaration merging (a task
 * declared there has its payload type checked by this library's API; any other task takes `unknown`).
 * Options, with their defaults, are in options.ts; events in events.ts; errors in errors.ts.
 */
import "graphile-worker";
import type { Client, PoolClient } from "pg";
import type { Job, JobHelpers, Task, WorkerEvents } from "graphile-worker";
import type { LocksEventEmitter } from "./events.js";
import type { HandoffCounts } from "./session/handoff.js";
import type { CanStartResult } from "./exclusive/can-start.js";
import type { PausedBlocker, PausedKey, RateBlocker, ThrottledKey } from "./rates/status.js";
import type {
  AddJobSpec,
  DefineOptions,
  ExclusiveOptions,
  ResolvedExclusiveOptions,
  UniqueOptions,
} from "./options.js";

/** The payload type of `taskIdentifier`: from `GraphileWorker.Tasks` if declared there, else `unknown`. */
export type TaskPayload<TIdentifier extends string> = TIdentifier extends keyof GraphileWorker.Tasks
  ? GraphileWorker.Tasks[TIdentifier]
  : unknown;

/** The task identifiers declared in `GraphileWorker.Tasks`. */
export type DeclaredTask = keyof GraphileWorker.Tasks & string;

/** `TIdentifier`, unless it is declared in `GraphileWorker.Tasks` (then the typed overload applies). */
export type UndeclaredTask<TIdentifier extends string> = TIdentifier extends DeclaredTask
  ? never
  : TIdentifier;

/** A row of the held-locks view. */
export interface HeldLock {
  lockKey: bigint;
  /** Set for locks taken by this library, once the holder registry caught up (within about half a second). */
  taskIdentifier: string | null;
  jobId: string | null;
  /** The holder's backend (PostgreSQL's pid of its session). */
  pid: number;
  /** For a lock session of this library: the id of the process it belongs to (null for other holders). */
  processId: number | null;
  /** For a lock session of this library: the host of that process (null for other holders). */
  host: string | null;
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
   * Whether a job of this task with this payload could start now, and if not, what stops it, as `Blocker`s:
   * each of its limits (`limits`, or its single limit) with no free slot (`limit`), its rate's slots of the
   * current period used or reserved (`rate`, with when the next frees), or its key paused (`paused`, until
   * when). Advisory, side-effect free: it reads PostgreSQL's lock table and the rate tables, and takes nothing.
   */
  canStart<TIdentifier extends string>(
    taskIdentifier: TIdentifier,
    payload: TaskPayload<TIdentifier>,
  ): Promise<CanStartResult>;
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
  /**
   * The throttled keys (a start in their current period, or jobs waiting for a slot): used/limit in the
   * current period and when the next slot frees; and the keys paused now, with their end.
   */
  rateStatus(): Promise<{ throttled: ThrottledKey[]; paused: PausedKey[] }>;
  /**
   * Removes expired `uniqueFor` windows, enqueue rate logs, debounce rows and throttled keys' start logs that
   * no longer count, and ended pauses, now (it also happens on its own); resolves how many.
   */
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
    /**
     * Jobs of this process that wait, right now, for an unavailable lock session (up to `lockSessionWait`),
     * and jobs being given back to the queue meanwhile (a give-back whose answer did not come is asked
     * again, and the job does not run until one comes).
     */
    outage: { waitingForSession: number; givingBack: number };
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
  /**
   * Closes the lock session (releasing every lock it holds) and the pool it created. Unlocks of jobs that
   * have finished are sent and answered first.
   */
  release(): Promise<void>;
}

export type { Blocker, LimitBlocker, CanStartResult } from "./exclusive/can-start.js";
export type { RateBlocker, PausedBlocker, ThrottledKey, PausedKey };

export interface AddJobResult {
  /** The job added, or for a duplicate the existing job (null if a `uniqueFor` window outlived it). */
  job: Job | null;
  /**
   * - `added`: a new job.
   * - `duplicate`: a unique job with the same key refused it; `job` is that job.
   * - `replaced`: `onDuplicate: "replace"` updated the waiting duplicate; `job` is it, updated.
   * - `dropped`: the preemptive check found the key's lock held; `job` is null.
   * - `rateLimited`: `enqueueRate` refused it (its key's window is full); `job` is null.
   * - `debounced`: `debounce` collapsed it into its key's pending run; `job` is that job, updated.
   */
  outcome: "added" | "duplicate" | "replaced" | "dropped" | "rateLimited" | "debounced";
  /**
   * A superseding enqueue (`supersede`; in `addJobs`, per item) that added its job: the ids of the jobs of
   * its key that waited (not yet fetched) and that it removed, each also told by a `job:superseded` event.
   * The jobs running for the key are told to stop when the enqueue commits.
   */
  superseded?: string[];
}

/** A graphile-worker task that runs at most `limit` jobs per key at a time. */
export interface ExclusiveTask<TPayload = unknown> extends Task {
  readonly taskIdentifier: string;
  readonly options: Readonly<ResolvedExclusiveOptions<TPayload>>;
  /** The advisory lock key of a payload (slot 0 when `limit > 1`). */
  lockKey(payload: TPayload): bigint;
  /**
   * Whether a job with this payload could take its lock now (with several limits: a slot of every one).
   * Advisory: it never takes the lock. `locks.canStart` says which limit is full.
   */
  lockAvailable(payload: TPayload): Promise<boolean>;
  /** Adds a job of this task, dropped up front if its key is held (unless `preemptive: false`). */
  addJob(payload: TPayload, spec?: AddJobSpec): Promise<AddJobResult>;
}
