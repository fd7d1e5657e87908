/** What the parts of one `Locks` instance share. Internal. */
import type { LocksEvents } from "./events.js";
import type { AddJobResult } from "./types.js";
import type { AddJobSpec } from "./options.js";
import type { LockSession } from "./session/session.js";
import type { Prefetch } from "./session/lock-ahead.js";
import type { Sql } from "./sql.js";

export interface LocksContext {
  readonly session: LockSession;
  readonly sql: Sql;
  /** How long a job waits for an unavailable lock session before it goes back to the queue (ms). */
  readonly lockSessionWaitMs: number;
  /** Jobs that wait out an unavailable lock session, and jobs being given back meanwhile (for `status()`). */
  readonly outage: { waitingForSession: number; givingBack: number };
  emit<K extends keyof LocksEvents>(event: K, payload: LocksEvents[K]): void;
  /** Whether anyone listens to `event` (to skip building its payload). */
  listening(event: keyof LocksEvents): boolean;
  lockAvailable(keys: readonly bigint[]): Promise<boolean>;
  /** The lock-ahead acquisition of a starting job, if its batch was prefetched (see prefetch.ts). */
  prefetched(jobId: string): Prefetch | undefined;
  /** Enqueues with the rules of the task defined under `taskIdentifier`. */
  addJob(
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
  ): Promise<AddJobResult>;
}
