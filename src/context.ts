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
  lockAvailable(taskIdentifier: string, keys: readonly bigint[]): Promise<boolean>;
  addJob(
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
    check: { keys: readonly bigint[]; preemptive: boolean },
  ): Promise<AddJobResult>;
}
