/** What the parts of one `Locks` instance share. Internal. */
import type { LocksEvents } from "./events.js";
import type { AddJobResult } from "./enqueue.js";
import type { AddJobSpec } from "./options.js";
import type { LockSession } from "./session.js";
import type { Sql } from "./sql.js";

export interface LocksContext {
  readonly session: LockSession;
  readonly sql: Sql;
  emit<K extends keyof LocksEvents>(event: K, payload: LocksEvents[K]): void;
  lockAvailable(keys: readonly bigint[]): Promise<boolean>;
  /** Enqueues with the rules of the task defined under `taskIdentifier`. */
  addJob(
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
  ): Promise<AddJobResult>;
}
