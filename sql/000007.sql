-- graphile-worker-locks: a key's line is locked by a transaction-level advisory lock, not by a row.
--
-- lock_lines (000001.sql) locked a key's line by its row in `wakes`, making a placeholder row when the key
-- had none; wake_waiters removes a key's row again when nobody waits. So every release of a `reschedule` key
-- or of a key in a lock group wrote a row and deleted it, with the index and vacuum work that follows, most
-- of what a lock group costs a job (bench/README.md, section "Limits").
--
-- The line lock is now pg_advisory_xact_lock on the key split into its two 32-bit halves. PostgreSQL keeps
-- advisory locks of one bigint and of two integers apart, so it never meets the jobs' own locks (one bigint
-- each) even for the same key. It is held, as the row lock was, until the caller's transaction ends, and
-- taken in key order, so two callers that lock several lines never deadlock. `wakes` now holds only wakes.

-- The two 32-bit halves of `p_key`, for the line lock.
create function :GWL_SCHEMA.line_lock_high(p_key bigint) returns int
language sql immutable parallel safe as $$ select (p_key >> 32)::int $$;
create function :GWL_SCHEMA.line_lock_low(p_key bigint) returns int
language sql immutable parallel safe as $$ select ((p_key << 32) >> 32)::int $$;

-- Locks the line of each key, in key order, until the caller's transaction ends (see 000001.sql for who
-- takes it and why).
create or replace function :GWL_SCHEMA.lock_lines(p_keys bigint[]) returns int
language plpgsql volatile as $$
declare
  v_key bigint;
begin
  for v_key in select distinct k from unnest(p_keys) as u(k) order by k loop
    perform pg_catalog.pg_advisory_xact_lock(
      :GWL_SCHEMA.line_lock_high(v_key), :GWL_SCHEMA.line_lock_low(v_key));
  end loop;
  return coalesce(cardinality(p_keys), 0);
end;
$$;

-- The sweep of waiters whose job is gone and of wakes a minute old. A line locked right now is left for the
-- next sweep: a sweep never waits for, or deadlocks with, it.
create or replace function :GWL_SCHEMA.sweep_waiters() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.waiters w
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = w.job_id)
    returning 1
  ), stale as (
    delete from :GWL_SCHEMA.wakes k
    where k.at < now() - interval '1 minute'
      and pg_catalog.pg_try_advisory_xact_lock(
        :GWL_SCHEMA.line_lock_high(k.lock_key), :GWL_SCHEMA.line_lock_low(k.lock_key))
  )
  select count(*) from gone
$$;

-- Placeholder rows that the row lock left behind name no job and order nothing.
delete from :GWL_SCHEMA.wakes where job_id is null;
