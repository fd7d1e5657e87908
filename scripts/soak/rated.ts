/**
 * The soak's throttled tasks: at most RATE.limit starts per RATE.periodMs per key. `soak_rated` has no lock;
 * `soak_rated_locked` takes an execution lock of its job's own (`drop`), so its rate is asked in its lock
 * statement (sql/000012.sql). Each worker records every start it is told of (`rate:admitted`, the
 * database's clock); the enqueuer adds one such job for every RATE.every of its enqueues, the two tasks in
 * turn, through graphile-worker's own `add_job`; the soak counts rate violations: starts s of a key whose
 * window [s, s + period) holds more than the limit.
 */
import type pg from "pg";
import type { Task } from "graphile-worker";
import type { Locks } from "../../src/index.js";
import { SOAK_SCHEMA } from "./shared.js";

export const RATE = {
  task: "soak_rated",
  lockedTask: "soak_rated_locked",
  limit: 5,
  periodMs: 1000,
  keys: 3,
  every: 5,
};

/** The table of recorded starts (created with the soak's records). */
export const RATED_SCHEMA = `create table ${SOAK_SCHEMA}.rate_starts (
  id bigserial primary key, k text not null, job_id bigint not null, at timestamptz not null);`;

/** The tasks, whose starts `record` writes (the locked task's keys recorded as `L:` and the key). */
export function ratedTask(
  locks: Locks,
  record: (text: string, values: unknown[]) => void,
): Record<string, Task> {
  locks.events.on("rate:admitted", ({ taskIdentifier, job, at }) => {
    if (taskIdentifier !== RATE.task && taskIdentifier !== RATE.lockedTask) return;
    const k = (job.payload as { k: string }).k;
    record(`insert into ${SOAK_SCHEMA}.rate_starts (k, job_id, at) values ($1, $2, $3)`, [
      taskIdentifier === RATE.task ? k : `L:${k}`,
      job.id,
      at,
    ]);
  });
  const task = locks.exclusive(RATE.task, async () => undefined, {
    lock: false,
    key: (p: { k: string }) => p.k,
    rate: { limit: RATE.limit, period: RATE.periodMs },
  });
  const locked = locks.exclusive(RATE.lockedTask, async () => undefined, {
    key: (p: { k: string; n: number }) => p.n,
    rate: { limit: RATE.limit, period: RATE.periodMs, key: (p) => p.k },
  });
  return { [RATE.task]: task, [RATE.lockedTask]: locked };
}

/** Adds a job of the task for every RATE.every-th enqueue `n` (best effort: PostgreSQL may be away). */
export async function enqueueRated(pool: pg.Pool, n: number): Promise<void> {
  if (n % RATE.every !== 0) return;
  const turn = n / RATE.every;
  await pool
    .query("select graphile_worker.add_job($1, json_build_object('k', $2::text, 'n', $3::int))", [
      turn % 2 === 0 ? RATE.task : RATE.lockedTask,
      `r${Math.floor(turn / 2) % RATE.keys}`,
      n,
    ])
    .catch(() => undefined);
}

/**
 * How many starts open a window of the period holding more than the limit, how many starts in all, and how
 * many of them were of the locked task.
 */
export async function rateViolations(
  admin: pg.Pool,
): Promise<{ starts: number; lockedStarts: number; violations: number }> {
  const { rows } = await admin.query<{ starts: number; lockedStarts: number; violations: number }>(
    `select count(*)::int as starts, count(*) filter (where s.k like 'L:%')::int as "lockedStarts",
       count(*) filter (where (
       select count(*) from ${SOAK_SCHEMA}.rate_starts t
       where t.k = s.k and t.at >= s.at and t.at < s.at + $1 * interval '1 millisecond') > $2)::int as violations
     from ${SOAK_SCHEMA}.rate_starts s`,
    [RATE.periodMs, RATE.limit],
  );
  return rows[0]!;
}
