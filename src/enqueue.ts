/**
 * Enqueueing through graphile-worker's public `add_job`, with the preemptive check: when the job's key is
 * held, the job is not added. The check and the insert are one statement; the check only reads pg_locks.
 */
import type { Job } from "graphile-worker";
import type { AddJobSpec } from "./options.js";
import { advisoryParts } from "./key.js";
import type { Sql } from "./sql.js";

export interface AddJobResult {
  /** The job that was added, or `null` when none was. */
  job: Job | null;
  /** `added`, or `dropped` when the preemptive check found the key held. */
  outcome: "added" | "dropped";
}

export interface Queryable {
  query<R extends object>(text: string, values?: unknown[]): Promise<{ rows: R[] }>;
}

/** pg_locks coordinates of keys, as the `lockAvailable` statement takes them. */
export function lockCoordinates(keys: readonly bigint[]): [number[], number[], number] {
  const parts = keys.map(advisoryParts);
  return [parts.map((p) => p.classid), parts.map((p) => p.objid), keys.length];
}

export async function lockAvailable(db: Queryable, sql: Sql, keys: readonly bigint[]): Promise<boolean> {
  const { rows } = await db.query<{ available: boolean }>(sql.lockAvailable, lockCoordinates(keys));
  return rows[0]!.available;
}

export async function addJob(
  db: Queryable,
  sql: Sql,
  taskIdentifier: string,
  payload: unknown,
  spec: AddJobSpec | undefined,
  checkKeys: readonly bigint[] | null,
): Promise<AddJobResult> {
  const values: unknown[] = [
    taskIdentifier,
    JSON.stringify(payload ?? {}),
    spec?.queueName ?? null,
    spec?.runAt ? spec.runAt.toISOString() : null,
    spec?.maxAttempts ?? null,
    spec?.jobKey ?? null,
    spec?.priority ?? null,
    spec?.flags ?? null,
    spec?.jobKeyMode ?? null,
  ];
  const text = checkKeys ? sql.addJobIfAvailable : sql.addJob;
  if (checkKeys) values.push(...lockCoordinates(checkKeys));
  const { rows } = await db.query<Job>(text, values);
  const row = rows[0];
  if (!row) return { job: null, outcome: "dropped" };
  return { job: { ...row, task_identifier: taskIdentifier }, outcome: "added" };
}
