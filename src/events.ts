/**
 * Typed events on `locks.events`. Listeners run synchronously; an exception thrown by a listener is logged
 * and never disturbs the job or the lock.
 */
import { EventEmitter } from "node:events";
import type { Job, TaskSpec } from "graphile-worker";
import type { ConflictStrategy } from "./options.js";

export interface LocksEvents {
  /** A job took its key and is about to run. */
  "lock:acquired": { taskIdentifier: string; lockKey: bigint; job: Job };
  /** A job's key was held when it was about to run; `strategy` says what happens next. */
  "lock:conflict": {
    taskIdentifier: string;
    lockKey: bigint;
    job: Job;
    strategy: ConflictStrategy;
    /** True when this process itself holds the key (no round trip was needed to know). */
    local: boolean;
  };
  /** A job finished and its key was released. `outcome` is `lost` when the session had died first. */
  "lock:released": {
    taskIdentifier: string;
    lockKey: bigint;
    job: Job;
    outcome: "ok" | "lost" | "unverified";
    heldMs: number;
  };
  /**
   * The lock session died; every listed hold lost its lock and its job's `abortSignal` fired. A hold with
   * `returned: true` belongs to a job that had already returned when the loss was noticed (its unlock was
   * not answered, or its key passed in memory to the next job of its key and the pass was not confirmed):
   * its abort came too late to matter, and whether its key stayed held until it returned is unknown
   * (another job of the key may have started while it ran; a warning names it).
   */
  "lock:lost": {
    holds: Array<{
      taskIdentifier: string;
      lockKey: bigint;
      jobId: string | null;
      returned: boolean;
    }>;
    error: Error;
  };
  /** The lock session (re)connected. */
  "session:connected": { pid: number | null };
  /** A job was completed without running, because its key was held (`onConflict: "drop"`). */
  "job:dropped": { taskIdentifier: string; lockKey: bigint; job: Job };
  /** A job met a conflict and was replaced by a copy that runs later (`onConflict: "reschedule"`). */
  "job:rescheduled": {
    taskIdentifier: string;
    lockKey: bigint;
    job: Job;
    newJobId: string;
    runAt: Date;
    delayMs: number;
  };
  /**
   * A job was superseded by a newer job of its key (`supersede`), and ended as completed: not failed, not
   * retried. `state` says where it was:
   * - `running`: it held the key; its `abortSignal` fired with a `SupersededError`, and it ended when it
   *   returned or threw (emitted by its own process, once it returned; it kept its key until then);
   * - `starting`: fetched before the superseding enqueue, it met the supersession before its task started
   *   (it had just taken the key, or was about to park), and ended without running;
   * - `waiting`: not yet fetched (queued, scheduled, waiting to retry, or parked in the key's line), it was
   *   removed by the superseding enqueue (emitted by the enqueuing process when the enqueue answered: inside
   *   a transaction of yours, before it commits). `job` is null then.
   */
  "job:superseded": {
    /** The task of the superseded job (its own, also when a lock group makes it another than the new job's). */
    taskIdentifier: string;
    /** The key (slot 0 of the task's key). */
    lockKey: bigint;
    jobId: string;
    /** The job that superseded it. */
    byJobId: string;
    state: "running" | "starting" | "waiting";
    job: Job | null;
  };
  /**
   * A job went back to the queue without its attempt counted: it met an unavailable lock session and waited
   * `lockSessionWait` for it in vain (its copy `newJobId` runs at `runAt`, or as soon as the session is back),
   * or PostgreSQL could not take its lock for want of lock memory (`error.code` GWL_LOCK_TABLE_FULL, whose
   * message names the server setting to raise; its copy runs at `runAt`).
   */
  "job:deferred": {
    taskIdentifier: string;
    job: Job;
    newJobId: string;
    runAt: Date;
    /** Why the session was unavailable. */
    error: Error;
  };
  /**
   * Rows of jobs that parked or were deferred and whose completion graphile-worker lost (a process died, or
   * the job failed after it was given back) were deleted: their copies carry on.
   */
  "givenBack:cleaned": { jobIds: string[] };
  /**
   * A job of a task with a `rate` was admitted: `at` is its start on the database's clock, the instant the
   * rate counts (a job that then fails still counted its start).
   */
  "rate:admitted": { taskIdentifier: string; rateKey: bigint; job: Job; at: Date };
  /**
   * A job did not start: it went over its rate (`reason: "rate"`; its copy `newJobId` has the slot reserved
   * at `runAt`), or its key is paused (`reason: "paused"`; its copy runs when the pause ends, `runAt`). No
   * attempt was counted.
   */
  "job:throttled": {
    taskIdentifier: string;
    job: Job;
    reason: "rate" | "paused";
    newJobId: string;
    runAt: Date;
  };
  /** A task snoozed its job (`SnoozeError`): its copy `newJobId` runs at `runAt`, no attempt counted. */
  "job:snoozed": { taskIdentifier: string; job: Job; newJobId: string; runAt: Date };
  /** A task paused its key (`PauseError`) until `until`; its job's copy `newJobId` runs then. */
  "job:paused": {
    taskIdentifier: string;
    job: Job;
    pauseKey: bigint;
    scope: "rate" | "key";
    newJobId: string;
    until: Date;
  };
  /** `addJob` did not add a job because its key was held (the preemptive check). */
  "enqueue:dropped": {
    taskIdentifier: string;
    lockKey: bigint;
    payload: unknown;
    spec: TaskSpec | undefined;
  };
  /** A unique enqueue met a job with the same key that still refuses duplicates; nothing was added. */
  "enqueue:duplicate": {
    taskIdentifier: string;
    uniqueKey: string;
    payload: unknown;
    /** The existing job (null when a `uniqueFor` window outlived it). */
    job: Job | null;
  };
  /** `onDuplicate: "replace"` updated the waiting job with this enqueue's payload, `runAt` and `priority`. */
  "enqueue:replaced": { taskIdentifier: string; uniqueKey: string; payload: unknown; job: Job };
  /** `enqueueRate` refused an enqueue: its key had `limit` jobs added in the last `period`. Nothing was added. */
  "job:rateLimited": {
    taskIdentifier: string;
    /** The rate's key (`gwl:r:<sha-256 hex>`). */
    rateKey: string;
    payload: unknown;
    spec: TaskSpec | undefined;
  };
  /** `debounce` collapsed an enqueue into its key's pending run, `job`, which now carries its payload. */
  "job:debounced": {
    taskIdentifier: string;
    /** The debounce's key (`gwl:d:<sha-256 hex>`). */
    debounceKey: string;
    payload: unknown;
    job: Job;
  };
}

export type LocksEventName = keyof LocksEvents;

/** An `EventEmitter` whose event names and payloads are typed. */
export interface LocksEventEmitter extends EventEmitter {
  on<K extends LocksEventName>(event: K, listener: (payload: LocksEvents[K]) => void): this;
  once<K extends LocksEventName>(event: K, listener: (payload: LocksEvents[K]) => void): this;
  off<K extends LocksEventName>(event: K, listener: (payload: LocksEvents[K]) => void): this;
  emit<K extends LocksEventName>(event: K, payload: LocksEvents[K]): boolean;
}

export function makeEmitter(): LocksEventEmitter {
  return new EventEmitter() as LocksEventEmitter;
}
