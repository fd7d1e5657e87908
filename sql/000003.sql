-- graphile-worker-locks, migration 3: waking rescheduled jobs the moment their key frees.
--
-- A job that meets a held key under the `reschedule` strategy is parked: replaced by a copy whose run_at is
-- a safety net some time ahead (reschedule_job), and registered here as a waiter of its key, in the same
-- transaction. The process that releases a key wakes the oldest waiter of that key (its run_at becomes now,
-- and workers are notified as for a new job) in the same statement as the unlock. No polling.
--
-- Lost wake-ups are closed by ordering: the releaser unlocks, then reads the waiters; the parker commits
-- its waiter, then looks at the lock (wake_if_free). Whichever comes second sees the other.

create table :GWL_SCHEMA.waiters (
  id bigserial primary key,
  lock_key bigint not null,
  job_id bigint not null,
  since timestamptz not null default now()
);
create index waiters_lock_key on :GWL_SCHEMA.waiters (lock_key, id);

create function :GWL_SCHEMA.park_job(p_job_id bigint, p_run_at timestamptz, p_lock_key bigint) returns bigint
language plpgsql volatile as $$
declare
  v_new_id bigint;
begin
  v_new_id := :GWL_SCHEMA.reschedule_job(p_job_id, p_run_at);
  if v_new_id is not null then
    insert into :GWL_SCHEMA.waiters (lock_key, job_id) values (p_lock_key, v_new_id);
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
  v_job_id bigint;
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
        returning w.job_id into v_job_id;
      exit when not found;
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, now())
        where j.id = v_job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
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

-- The parker's half of the hand-off: if fewer than all slots of the key are held, wake a waiter.
create function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint) returns int
language plpgsql volatile as $$
begin
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

-- Waiters whose job no longer exists (it ran after its safety-net delay, or was removed).
create function :GWL_SCHEMA.sweep_waiters() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.waiters w
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = w.job_id)
    returning 1
  )
  select count(*) from gone
$$;
