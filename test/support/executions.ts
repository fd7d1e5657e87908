import type pg from "pg";
import { highestConcurrency } from "../../scripts/overlap.js";

export interface Execution {
  jobId: string;
  lockKey: string;
  worker: string;
  attempts: number;
  /** What the task wrote beside the execution (the fixture worker: the payload's `n`). */
  note?: string | null;
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
    note: string | null;
    s: string;
    e: string | null;
  }>(
    `select job_id::text, lock_key, worker, attempts, note,
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
    note: r.note,
    start: BigInt(r.s),
    end: r.e === null ? null : BigInt(r.e),
  }));
}

/**
 * The highest number of executions that ran at the same time, per key: a sweep over start and end
 * instants (an end at the same microsecond as a start counts as before it).
 */
export function maxConcurrencyPerKey(executions: readonly Execution[]): Map<string, number> {
  const byKey = new Map<string, Array<{ start: bigint; end: bigint }>>();
  for (const e of executions) {
    if (e.end === null) throw new Error(`execution of job ${e.jobId} has no end`);
    const intervals = byKey.get(e.lockKey) ?? [];
    intervals.push({ start: e.start, end: e.end });
    byKey.set(e.lockKey, intervals);
  }
  return new Map([...byKey].map(([key, intervals]) => [key, highestConcurrency(intervals)]));
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
