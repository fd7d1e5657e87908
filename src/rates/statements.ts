/**
 * The SQL of rates, snooze and pause (functions of sql/000004.sql), for the two escaped schema names.
 */

export function rateStatements(s: string, w: string) {
  return {
    /**
     * rate_admit: admits job $1 or gives it back; $13: a probe, which counts the start only when the key is
     * at most half used; $14: the job probed and holds its lock (see sql/000011.sql and sql/000004.sql).
     */
    rateAdmit: `select r.admitted, r.at, (extract(epoch from r.at) * 1000000)::bigint::text as at_us,
        r.copy_id::text as copy_id, r.reason, r.now
      from ${s}.rate_admit($1::bigint, $2::bigint, $3::text, $4::int, $5::interval, $6::int,
        $7::bigint[], $8::int, $9::interval, $10::interval, $11::interval, $12::interval,
        $13::boolean, $14::boolean) r`,
    /** Takes back the start at $2 (µs since the epoch) of key $1, whose job did not start. */
    rateRefund: `select ${s}.rate_refund($1::bigint, $2::bigint)`,
    /** Gives job $1 back to run $2 from now. */
    snooze: `select r.copy_id::text as copy_id, r.run_at, clock_timestamp() as now from ${s}.snooze_job($1::bigint, $2::interval, $3::int) r`,
    /**
     * Makes the copies $1, given back over their rate, runnable ahead of the jobs queued after them, those
     * whose slot, planned again, is at most $2 away; answers the others with their new slots (their run_at
     * moved to the slot less $3).
     */
    wakeReserved: `select r.copy_id::text as copy_id, r.at, r.now
      from ${s}.wake_reserved_planned($1::bigint[], $2::interval, $3::interval) r`,
    /** Tells graphile-worker's workers that $1 jobs became runnable (as a new job does). */
    announce: `select ${s}.announce_jobs($1::int)`,
    /** Pauses key $2 (named $3) for $4 and gives job $1 back to run then. */
    pause: `select r.copy_id::text as copy_id, r.until, clock_timestamp() as now
      from ${s}.pause_key($1::bigint, $2::bigint, $3::text, $4::interval, $5::int) r`,
    /**
     * Each throttled key (or only those of $1, when not null) with a start in its last period or a job
     * waiting for a slot: its readable name, limit and period, starts in the current period, the jobs that
     * reserved a slot, and when the next slot frees for a job that comes now (its plan included).
     */
    throttled: `with k as (
        select r.* from ${s}.rates r
        where ($1::bigint[] is null or r.rate_key = any($1::bigint[]))
      ), live as (
        select v.rate_key, v.at, v.pos from ${s}.rate_reservations v
        where exists (select 1 from ${w}._private_jobs j where j.id = v.job_id)
          and ($1::bigint[] is null or v.rate_key = any($1::bigint[]))
      )
      select k.rate_key::text as rate_key, k.label, k.lim as "limit",
        (extract(epoch from k.period) * 1000)::float8 as period,
        (select count(*) from unnest(k.starts) t where t > clock_timestamp() - k.period)::int as used,
        (select count(*) from live where live.rate_key = k.rate_key)::int as waiting,
        ${s}.rate_next(k.starts || array(
            select live.at from live where live.rate_key = k.rate_key order by live.pos desc limit k.lim
          ), k.lim, k.period, k.burst, clock_timestamp()) as next_at,
        clock_timestamp() as now
      from k
      where $1::bigint[] is not null
        or exists (select 1 from unnest(k.starts) t where t > clock_timestamp() - k.period)
        or exists (select 1 from live where live.rate_key = k.rate_key)
      order by k.label`,
    /** Paused keys (only those of $1, when not null) whose pause has not ended. */
    paused: `select p.pause_key::text as pause_key, p.label, p.until from ${s}.pauses p
      where p.until > clock_timestamp() and ($1::bigint[] is null or p.pause_key = any($1::bigint[]))
      order by p.until`,
  };
}

export type RateStatements = ReturnType<typeof rateStatements>;
