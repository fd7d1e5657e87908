/**
 * The soak's throttled task, `soak_rated`: at most RATE.limit starts per RATE.periodMs per key, no lock.
 * Each worker records every start it is told of (`rate:admitted`, the database's clock); the enqueuer adds
 * one such job for every RATE.every of its enqueues, through graphile-worker's own `add_job`; the soak
 * counts rate violations: starts s of a key whose window [s, s + period) holds more than the limit.
 */
import type pg from "pg";
import type { Task } from "graphile-worker";
import type { Locks } from "../../src/index.js";
import { SOAK_SCHEMA } from "./shared.js";

export const RATE = { task: "soak_rated", limit: 5, periodMs: 1000, keys: 3, every: 5 };

/** The table of recorded starts (created with the soak's records). */
export const RATED_SCHEMA = `create table ${SOAK_SCHEMA}.rate_starts (
  id bigserial primary key, k text not null, job_id bigint not null, at timestamptz not null);`;

/** The task, whose starts `record` writes. */
export function ratedTask(
  locks: Locks,
  record: (text: string, values: unknown[]) => void,
): Record<string, Task> {
  locks.events.on("rate:admitted", ({ taskIdentifier, job, at }) => {
    if (taskIdentifier !== RATE.task) return;
    record(`insert into ${SOAK_SCHEMA}.rate_starts (k, job_id, at) values ($1, $2, $3)`, [
      (job.payload as { k: string }).k,
      job.id,
      at,
    ]);
  });
  const task = locks.exclusive(RATE.task, async () => undefined, {
    lock: false,
    key: (p: { k: string }) => p.k,
    rate: { limit: RATE.limit, period: RATE.periodMs },
  });
  return { [RATE.task]: task };
}

/** Adds a job of the task for every RATE.every-th enqueue `n` (best effort: PostgreSQL may be away). */
export async function enqueueRated(pool: pg.Pool, n: number): Promise<void> {
  if (n % RATE.every !== 0) return;
  await pool
    .query("select graphile_worker.add_job($1, json_build_object('k', $2::text))", [
      RATE.task,
      `r${(n / RATE.every) % RATE.keys}`,
    ])
    .catch(() => undefined);
}

/** How many starts open a window of the period holding more than the limit, and how many starts in all. */
export async function rateViolations(
  admin: pg.Pool,
): Promise<{ starts: number; violations: number }> {
  const { rows } = await admin.query<{ starts: number; violations: number }>(
    `select count(*)::int as starts, count(*) filter (where (
       select count(*) from ${SOAK_SCHEMA}.rate_starts t
       where t.k = s.k and t.at >= s.at and t.at < s.at + $1 * interval '1 millisecond') > $2)::int as violations
     from ${SOAK_SCHEMA}.rate_starts s`,
    [RATE.periodMs, RATE.limit],
  );
  return rows[0]!;
}
