-- graphile-worker-locks, migration 3: waking rescheduled jobs the moment their key frees.
--
-- A job that meets a held key under the `reschedule` strategy is parked: replaced by a copy whose run_at is
-- a safety net some time ahead (reschedule_job), and registered here as a waiter of its key, in the same
-- transaction. The process that releases a key wakes the oldest waiter of that key (its run_at becomes now,
-- and workers are notified as for a new job) in the same statement as the unlock. No polling.
--
-- Lost wake-ups are closed by ordering: the releaser unlocks, then reads the waiters; the parker commits
-- its waiter, then looks at the lock (wake_if_free). Whichever comes second sees the other.
--
-- A woken waiter gets back the run_at its job had when it met the conflict, less a millisecond: graphile-
-- worker fetches by priority, then run_at, then id, so the copy (a newer id) goes ahead of the jobs queued
-- with it, which would otherwise meet the key first and park in turn.
--
-- One wake per release: a parker's own check can find the key free in the moment between a release, which
-- has already woken the next waiter, and that waiter taking the key; waking another would send two jobs
-- after one key. The time of each key's last wake is kept, and the parker's check does not wake while it
-- is fresh: the woken job takes the key, and its release wakes the parker. If the woken job never comes
-- (its worker died), the parker's safety-net delay still runs it.

create table :GWL_SCHEMA.waiters (
  id bigserial primary key,
  lock_key bigint not null,
  job_id bigint not null,
  -- the job's run_at when it met the conflict, given back when it is woken
  run_at timestamptz,
  since timestamptz not null default now()
);
create index waiters_lock_key on :GWL_SCHEMA.waiters (lock_key, id);

create table :GWL_SCHEMA.wakes (
  lock_key bigint primary key,
  at timestamptz not null
);

create function :GWL_SCHEMA.park_job(p_job_id bigint, p_run_at timestamptz, p_lock_key bigint) returns bigint
language plpgsql volatile as $$
declare
  v_run_at timestamptz;
  v_new_id bigint;
begin
  select j.run_at into v_run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id;
  v_new_id := :GWL_SCHEMA.reschedule_job(p_job_id, p_run_at);
  if v_new_id is not null then
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at) values (p_lock_key, v_new_id, v_run_at);
  end if;
  return v_new_id;
end;
$$;

-- For each key, makes the oldest waiter whose job still waits runnable now. Returns how many were woken.
-- Plpgsql, so that each statement here sees what committed before it ran (after the caller's unlocks).
create function :GWL_SCHEMA.wake_waiters(p_keys bigint[]) returns int
language plpgsql volatile as $$
declare
  v_key bigint;
  v_waiter record;
  v_woken int := 0;
begin
  if p_keys is null or cardinality(p_keys) = 0 then
    return 0;
  end if;
  foreach v_key in array p_keys loop
    loop
      delete from :GWL_SCHEMA.waiters w
        where w.id = (
          select x.id from :GWL_SCHEMA.waiters x
          where x.lock_key = v_key
          order by x.id
          limit 1
          for update skip locked
        )
        returning w.job_id, w.run_at into v_waiter;
      exit when not found;
      -- (a woken waiter goes ahead of the jobs queued with it: see the top of this file)
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now()) - interval '1 millisecond'
        where j.id = v_waiter.job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
        insert into :GWL_SCHEMA.wakes (lock_key, at) values (v_key, clock_timestamp())
          on conflict (lock_key) do update set at = excluded.at;
        exit;
      end if;
      -- that job is gone or already running: try the next waiter
    end loop;
  end loop;
  if v_woken > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_woken::text || '}');
  end if;
  return v_woken;
end;
$$;

-- The parker's half of the hand-off: if fewer than all slots of the key are held, and no fresh wake is on
-- its way to it, wake a waiter.
create function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint) returns int
language plpgsql volatile as $$
begin
  if exists (
    select 1 from :GWL_SCHEMA.wakes w
    where w.lock_key = p_key and w.at > clock_timestamp() - interval '100 milliseconds'
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

-- Waiters whose job no longer exists (it ran after its safety-net delay, or was removed), and old wakes.
create function :GWL_SCHEMA.sweep_waiters() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.waiters w
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = w.job_id)
    returning 1
  ), stale as (
    delete from :GWL_SCHEMA.wakes where at < now() - interval '1 minute'
  )
  select count(*) from gone
$$;
