/**
 * Checks of recorded starts against a rate: the most starts any window [s, s + period) holds, each start
 * taken as a window's left edge (the window that holds the most starts begins at one), and the fewest a
 * window of a backlog holds; and a record of every stamp the database wrote on an enqueue rate log.
 */
import type pg from "pg";

/** The most starts (ms on the database's clock, any order) any half-open window of `periodMs` holds. */
export function maxStartsInWindow(starts: readonly number[], periodMs: number): number {
  const sorted = [...starts].sort((a, b) => a - b);
  let most = 0;
  let end = 0;
  for (let i = 0; i < sorted.length; i++) {
    while (end < sorted.length && sorted[end]! < sorted[i]! + periodMs) end++;
    most = Math.max(most, end - i);
  }
  return most;
}

/**
 * The fewest starts a window [s, s + period) holds, s a start, over the windows that end by the last start
 * (while a backlog exists, each of them should be nearly full), and start no sooner than `fromMs` after the
 * first start.
 */
export function minStartsInWindow(starts: readonly number[], periodMs: number, fromMs = 0): number {
  const sorted = [...starts].sort((a, b) => a - b);
  const last = sorted[sorted.length - 1]!;
  let fewest = Number.POSITIVE_INFINITY;
  let end = 0;
  for (let i = 0; i < sorted.length && sorted[i]! + periodMs <= last; i++) {
    if (sorted[i]! < sorted[0]! + fromMs) continue;
    while (end < sorted.length && sorted[end]! < sorted[i]! + periodMs) end++;
    fewest = Math.min(fewest, end - i);
  }
  return fewest;
}

/**
 * The fewest starts a period holds, the periods taken one after another from the first start,
 * [first + k * period, first + (k + 1) * period), over those that end by the last start (while a backlog
 * exists).
 */
export function minStartsInPeriods(starts: readonly number[], periodMs: number): number {
  return Math.min(...startsPerPeriod(starts, periodMs));
}

/** The starts in each whole period from the first start, one after another (see minStartsInPeriods). */
export function startsPerPeriod(starts: readonly number[], periodMs: number): number[] {
  const sorted = [...starts].sort((a, b) => a - b);
  const first = sorted[0]!;
  const periods = Math.floor((sorted[sorted.length - 1]! - first) / periodMs);
  const counts = new Array<number>(periods).fill(0);
  for (const t of sorted) {
    const k = Math.floor((t - first) / periodMs);
    if (k < periods) counts[k]!++;
  }
  return counts;
}

/**
 * Records every stamp the database writes on an enqueue rate log, as it writes it, in `test_rate_stamps`
 * (rate_key, stamp): a trigger on the library's `enqueue_rates` (after its migration).
 */
export async function recordRateStamps(db: pg.Pool): Promise<void> {
  await db.query(`
    create table test_rate_stamps (id bigserial primary key, rate_key text not null,
      stamp timestamptz not null);
    create function test_record_rate_stamp() returns trigger language plpgsql as $$
    begin
      -- (a write of a log adds its stamps later than the log's newest before it: one, or a batch's
      -- admissions of the key, all at one instant)
      insert into test_rate_stamps (rate_key, stamp)
        select new.rate_key, u.t from unnest(new.stamps) as u(t)
        where u.t > coalesce((select max(o.t) from unnest(case when tg_op = 'UPDATE' then old.stamps end)
          as o(t)), '-infinity')
        order by u.t;
      return null;
    end;
    $$;
    create trigger test_rate_stamps after insert or update on graphile_worker_locks.enqueue_rates
      for each row when (cardinality(new.stamps) > 0) execute function test_record_rate_stamp();`);
}
