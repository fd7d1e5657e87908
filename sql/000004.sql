-- graphile-worker-locks, migration 4: rescheduled jobs keep their place in line (FIFO per key).
--
-- Every waiter has a position: the id of the job as it was first parked (graphile-worker's ids follow the
-- enqueue order). It survives being woken and parked again: a woken job that loses the key to a race, or a
-- parked job fetched by its safety net while others still wait, parks again in the same place.
--
-- A job of a `reschedule` task takes a free key only if no parked job of that key is ahead of it (see
-- is_next): a job fetched for the first time while others wait for its key parks behind them instead of
-- overtaking them, and the woken job, which is the first in line, finds the key as its releaser left it.
--
-- Waking still removes the waiter; the woken job's position is kept with the key's last wake (wakes), which
-- is where a woken job that has to park again finds it.

alter table :GWL_SCHEMA.waiters add column pos bigint;
update :GWL_SCHEMA.waiters set pos = job_id;
alter table :GWL_SCHEMA.waiters alter column pos set not null;
drop index :GWL_SCHEMA.waiters_lock_key;
create index waiters_lock_key_pos on :GWL_SCHEMA.waiters (lock_key, pos);
create index waiters_job_id on :GWL_SCHEMA.waiters (job_id);

alter table :GWL_SCHEMA.wakes add column job_id bigint, add column pos bigint;

-- A job's place in the line of `p_key`: its waiter's, the last wake's if it was that job, else its own id.
create function :GWL_SCHEMA.line_position(p_key bigint, p_job_id bigint) returns bigint
language sql stable as $$
  select coalesce(
    (select w.pos from :GWL_SCHEMA.waiters w where w.job_id = p_job_id and w.lock_key = p_key limit 1),
    (select k.pos from :GWL_SCHEMA.wakes k where k.lock_key = p_key and k.job_id = p_job_id),
    p_job_id
  )
$$;

-- Whether no job of `p_key` is ahead of job `p_job_id`: no parked one, and no woken one on its way (woken
-- in the last 100 ms, as wake_if_free counts it). A waiter whose job is gone, or is running (fetched by its
-- safety net and deciding right now), does not hold the line up.
create function :GWL_SCHEMA.is_next(p_key bigint, p_job_id bigint) returns boolean
language sql stable as $$
  with me as (select :GWL_SCHEMA.line_position(p_key, p_job_id) as pos)
  select not exists (
    select 1
    from :GWL_SCHEMA.waiters w
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = w.job_id and j.locked_at is null
    where w.lock_key = p_key and w.pos < (select pos from me)
  ) and not exists (
    select 1 from :GWL_SCHEMA.wakes k
    where k.lock_key = p_key and k.job_id is distinct from p_job_id
      and k.pos < (select pos from me) and k.at > clock_timestamp() - interval '100 milliseconds'
  )
$$;

-- park_job, with the safety net timed by the job's place in line: `p_per_position` later for each parked
-- job ahead of it (the caller's estimate of one job's hold), but no later than `p_latest`. A job far back in
-- a long line is not fetched by its safety net long before its turn can come, only to park again.
-- Returns the copy and when it runs.
drop function :GWL_SCHEMA.park_job(bigint, timestamptz, bigint);
create function :GWL_SCHEMA.park_job(
  p_job_id bigint,
  p_run_at timestamptz,
  p_lock_key bigint,
  p_per_position interval,
  p_latest timestamptz
) returns table (id bigint, run_at timestamptz)
language plpgsql volatile as $$
declare
  v_run_at timestamptz;
  v_pos bigint;
  v_ahead bigint;
  v_safety_net timestamptz;
  v_new_id bigint;
begin
  select j.run_at into v_run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id;
  v_pos := :GWL_SCHEMA.line_position(p_lock_key, p_job_id);
  select count(*) into v_ahead from :GWL_SCHEMA.waiters w
    where w.lock_key = p_lock_key and w.pos < v_pos;
  v_safety_net := greatest(p_run_at, least(p_run_at + v_ahead * p_per_position, p_latest));
  v_new_id := :GWL_SCHEMA.reschedule_job(p_job_id, v_safety_net);
  if v_new_id is null then
    return;
  end if;
  -- A waiter fetched by its safety net parks again in its own row; anyone else gets a row at its place.
  update :GWL_SCHEMA.waiters w set job_id = v_new_id
    where w.job_id = p_job_id and w.lock_key = p_lock_key;
  if not found then
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      values (p_lock_key, v_new_id, v_run_at, v_pos);
  end if;
  return query select v_new_id, v_safety_net;
end;
$$;

-- For each key, makes the first waiter in line whose job still waits runnable now. Returns how many were
-- woken. Plpgsql, so that each statement here sees what committed before it ran (after the caller's unlocks).
create or replace function :GWL_SCHEMA.wake_waiters(p_keys bigint[]) returns int
language plpgsql volatile as $$
declare
  v_key bigint;
  v_waiter record;
  v_woken int := 0;
  v_on_its_way boolean;
begin
  if p_keys is null or cardinality(p_keys) = 0 then
    return 0;
  end if;
  foreach v_key in array p_keys loop
    v_on_its_way := false;
    loop
      delete from :GWL_SCHEMA.waiters w
        where w.id = (
          select x.id from :GWL_SCHEMA.waiters x
          where x.lock_key = v_key
          order by x.pos, x.id
          limit 1
          for update skip locked
        )
        returning w.job_id, w.run_at, w.pos into v_waiter;
      exit when not found;
      -- (a woken waiter goes ahead of the jobs queued with it: see migration 3)
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now()) - interval '1 millisecond'
        where j.id = v_waiter.job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
      elsif not exists (
        select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_waiter.job_id
      ) then
        continue; -- that job is gone: the next in line
      end if;
      -- Woken, or already running (fetched by its safety net): either way it is on its way to the key, with
      -- its place kept here should it have to park again.
      insert into :GWL_SCHEMA.wakes (lock_key, at, job_id, pos)
        values (v_key, clock_timestamp(), v_waiter.job_id, v_waiter.pos)
        on conflict (lock_key) do update
          set at = excluded.at, job_id = excluded.job_id, pos = excluded.pos;
      v_on_its_way := true;
      exit;
    end loop;
    if not v_on_its_way then
      -- Nobody waits: whoever was woken last has come and gone (this is its release, or a later one's). Its
      -- wake must not keep counting as one on its way, or a job that parks a moment later would wait for it
      -- (wake_if_free) instead of being woken, until its safety net.
      delete from :GWL_SCHEMA.wakes k where k.lock_key = v_key;
    end if;
  end loop;
  if v_woken > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_woken::text || '}');
  end if;
  return v_woken;
end;
$$;

-- The parker's half of the hand-off, as in migration 3 (which this replaces), except that a fresh wake of the very job that is
-- parking (woken, it lost the key after all) is not one on its way to the key.
drop function :GWL_SCHEMA.wake_if_free(bigint[], bigint);
create function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint, p_job_id bigint) returns int
language plpgsql volatile as $$
begin
  if exists (
    select 1 from :GWL_SCHEMA.wakes w
    where w.lock_key = p_key and w.at > clock_timestamp() - interval '100 milliseconds'
      and w.job_id is distinct from p_job_id
  ) then
    return 0; -- a woken job is on its way to the key
  end if;
  if (
    select count(*)
    from pg_catalog.pg_locks l
    join unnest(p_slots) as s(k)
      on l.classid = ((s.k >> 32) & 4294967295)::oid and l.objid = (s.k & 4294967295)::oid
    where l.locktype = 'advisory' and l.objsubid = 1 and l.granted
      and l.database = (select oid from pg_catalog.pg_database where datname = current_database())
  ) < cardinality(p_slots) then
    return :GWL_SCHEMA.wake_waiters(array[p_key]);
  end if;
  return 0;
end;
$$;
