/** What the parts of one `Locks` instance share. Internal. */
import type { LocksEvents } from "./events.js";
import type { AddJobResult } from "./types.js";
import type { AddJobSpec } from "./options.js";
import type { ConnectionState } from "./session/connection.js";
import type { AcquireResult, HoldInfo, RateRide } from "./session/holds.js";
import type { AheadAcquisition } from "./session/lock-ahead.js";
import type { LineWaiter } from "./session/handoff.js";
import type { Sql } from "./sql.js";
import type { LimitKeys } from "./key.js";
import type { LockedAborts } from "./exclusive/aborts.js";

/** What the task wrapper asks of the lock session (session/session.ts). */
export interface LockService {
  /**
   * Tries the slots in order and takes the first that is free; `{ acquired: false }` on a conflict, throws
   * GWL_LOCK_SESSION_UNAVAILABLE when there is no session. With `limits` (a job with several limits), one
   * slot of each, all or nothing; a conflict says which limit was full. With `ride` (a single key), the
   * job's rate is asked in the same statement (see `RateRide`).
   */
  acquire(
    slots: readonly bigint[],
    info: HoldInfo,
    limits?: ReadonlyArray<readonly bigint[]>,
    ride?: RateRide,
  ): Promise<AcquireResult>;
  /** True as soon as the session is ready, false when it is still not after `timeoutMs` or is closed. */
  whenReady(timeoutMs: number): Promise<boolean>;
  /**
   * The id of the job that superseded job `jobId` of `key` (slot 0 of its task's key), if the session heard
   * of one lately (`supersede`); else null.
   */
  supersededBy(key: bigint, jobId: string): string | null;
  /** See LockSession.lineWaiter and waitInLine. */
  lineWaiter(key: string, jobId: string): LineWaiter;
  waitInLine(
    waiter: LineWaiter,
    slots: readonly bigint[],
    info: HoldInfo,
    until: number,
    now: boolean,
  ): Promise<AcquireResult | "timeout" | "recheck">;
  /** The backend pid of the session's connection, if connected. */
  readonly pid: number | null;
  readonly state: ConnectionState;
}

/** A connection of graphile-worker's pool, as a job's `withPgClient` lends it. */
export interface PoolClientLike {
  query<R extends Record<string, unknown>>(config: {
    name?: string;
    text: string;
    values: unknown[];
  }): Promise<{ rows: R[] }>;
}

export interface LocksContext {
  readonly session: LockService;
  readonly sql: Sql;
  /** The abort signals its tasks' jobs see, shared by every task of the instance (exclusive/aborts.ts). */
  readonly aborts: LockedAborts;
  /**
   * Runs statement `text`, called `name`, on `client`, a connection of graphile-worker's pool lent to a job:
   * prepared unless the instance's prepared statements are off, or that pool turned out not to carry them
   * (then, once warned, every such statement of the instance goes unprepared).
   */
  poolQuery<R extends Record<string, unknown>>(
    client: PoolClientLike,
    name: string,
    text: string,
    values: unknown[],
  ): Promise<{ rows: R[] }>;
  /** How long a job waits for an unavailable lock session before it goes back to the queue (ms). */
  readonly lockSessionWaitMs: number;
  /** Jobs that wait out an unavailable lock session, and jobs being given back meanwhile (for `status()`). */
  readonly outage: { waitingForSession: number; givingBack: number };
  emit<K extends keyof LocksEvents>(event: K, payload: LocksEvents[K]): void;
  /** Whether anyone listens to `event` (to skip building its payload). */
  listening(event: keyof LocksEvents): boolean;
  lockAvailable(keys: readonly bigint[]): Promise<boolean>;
  /** How many slots of each limit are held right now (by any session). */
  limitsHeld(limits: readonly LimitKeys[]): Promise<number[]>;
  /** The lock-ahead acquisition of a starting job, if its lock was taken ahead (see session/lock-ahead.ts). */
  lockedAhead(jobId: string): AheadAcquisition | undefined;
  /** Whether job `jobId`, starting, was fetched in a batch of a local queue. */
  fetchedInBatch(jobId: string): boolean;
  /**
   * Wakes a job given back to run in `delayMs` at that moment (rates/wakes.ts); `reservedCopy`: the copy's id,
   * when it was given back over its rate.
   */
  wakeIn(delayMs: number, reservedCopy?: string): void;
  /** Enqueues with the rules of the task defined under `taskIdentifier`. */
  addJob(
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
  ): Promise<AddJobResult>;
}
