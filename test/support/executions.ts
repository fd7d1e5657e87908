import type pg from "pg";

export interface Execution {
  jobId: string;
  lockKey: string;
  worker: string;
  attempts: number;
  /** Microseconds since the epoch, from PostgreSQL's clock_timestamp(). */
  start: bigint;
  end: bigint | null;
}

export async function readExecutions(pool: pg.Pool, task = "exec"): Promise<Execution[]> {
  const { rows } = await pool.query<{
    job_id: string;
    lock_key: string;
    worker: string;
    attempts: number;
    s: string;
    e: string | null;
  }>(
    `select job_id::text, lock_key, worker, attempts,
       (extract(epoch from started_at) * 1000000)::bigint::text as s,
       (extract(epoch from ended_at) * 1000000)::bigint::text as e
     from test_executions where task = $1 order by id`,
    [task],
  );
  return rows.map((r) => ({
    jobId: r.job_id,
    lockKey: r.lock_key,
    worker: r.worker,
    attempts: r.attempts,
    start: BigInt(r.s),
    end: r.e === null ? null : BigInt(r.e),
  }));
}

/**
 * The highest number of executions that ran at the same time, per key: a sweep over start and end
 * instants (an end at the same microsecond as a start counts as before it).
 */
export function maxConcurrencyPerKey(executions: readonly Execution[]): Map<string, number> {
  const byKey = new Map<string, Array<[bigint, number]>>();
  for (const e of executions) {
    if (e.end === null) throw new Error(`execution of job ${e.jobId} has no end`);
    const points = byKey.get(e.lockKey) ?? [];
    points.push([e.start, 1], [e.end, -1]);
    byKey.set(e.lockKey, points);
  }
  const result = new Map<string, number>();
  for (const [key, points] of byKey) {
    points.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] - b[1]));
    let current = 0;
    let max = 0;
    for (const [, delta] of points) {
      current += delta;
      max = Math.max(max, current);
    }
    result.set(key, max);
  }
  return result;
}

export async function readEvents(
  pool: pg.Pool,
  kind: string,
): Promise<Array<{ jobId: string; worker: string; detail: unknown }>> {
  const { rows } = await pool.query<{ job_id: string; worker: string; detail: unknown }>(
    "select job_id::text, worker, detail from test_events where kind = $1 order by id",
    [kind],
  );
  return rows.map((r) => ({ jobId: r.job_id, worker: r.worker, detail: r.detail }));
}
