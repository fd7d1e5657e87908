/**
 * Introspection of the advisory locks held in the database (the `held_locks` view, sql/000001.sql), for
 * `locks.heldLocks()` and the CLI's `status`.
 */
import type { Sql } from "./sql.js";
import type { HeldLock } from "./types.js";

interface HeldLockRow {
  lock_key: string;
  task_identifier: string | null;
  job_id: string | null;
  pid: number;
  process_id: number | null;
  host: string | null;
  application_name: string;
  since: Date | null;
  session_started_at: Date;
}

/** Every advisory lock held in the database with its holder, or only those of `keys`; oldest first. */
export async function readHeldLocks(
  db: { query<R extends object>(text: string, values: unknown[]): Promise<{ rows: R[] }> },
  sql: Sql,
  keys: readonly bigint[] | null = null,
): Promise<HeldLock[]> {
  const { rows } = await db.query<HeldLockRow>(sql.heldLocks, [keys ? keys.map(String) : null]);
  return rows.map((r) => ({
    lockKey: BigInt(r.lock_key),
    taskIdentifier: r.task_identifier,
    jobId: r.job_id,
    pid: r.pid,
    processId: r.process_id,
    host: r.host,
    applicationName: r.application_name,
    since: r.since,
    sessionStartedAt: r.session_started_at,
  }));
}
