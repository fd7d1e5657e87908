-- graphile-worker-locks, migration 9: is_next keeps its plan whatever the line's statistics say.
--
-- is_next (migration 4) runs for every lock attempt of a `reschedule` job. Once autovacuum had analyzed the
-- waiters table while it held a long line (thousands of rows over a few keys), PostgreSQL planned its join
-- of waiters and jobs as a merge join over both tables' id indexes: every call then read every waiter and
-- every job instead of the few waiters of one key ahead of one position. Measured in the contention
-- benchmark: a round of 2,000 jobs took 10–12 s instead of 4.7 s from the moment the statistics changed.
-- Now the waiters of the key ahead of the job are read by the (lock_key, pos) index, and each one's job is
-- looked up by its primary key, one at a time, stopping at the first that still waits: the same answer,
-- and a plan that does not depend on how full the table was when it was last analyzed.
create or replace function :GWL_SCHEMA.is_next(p_key bigint, p_job_id bigint) returns boolean
language sql stable as $$
  with me as (select :GWL_SCHEMA.line_position(p_key, p_job_id) as pos)
  select not exists (
    select 1
    from (
      select w.job_id from :GWL_SCHEMA.waiters w
      where w.lock_key = p_key and w.pos < (select pos from me)
      offset 0
    ) w
    cross join lateral (
      select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j
      where j.id = w.job_id and j.locked_at is null
      limit 1
    ) j
  ) and not exists (
    select 1 from :GWL_SCHEMA.wakes k
    where k.lock_key = p_key and k.job_id is distinct from p_job_id
      and k.pos < (select pos from me) and k.at > clock_timestamp() - interval '100 milliseconds'
  )
$$;
