-- graphile-worker-locks, migration 6: one wake per release.
--
-- A parker's own check (wake_if_free) can find its key free in the moment between a release, which has
-- already woken the next waiter, and that waiter taking the key; waking another then sends two jobs after
-- one key, and one of them parks again (a wasted fetch). The time of each key's last wake is kept, and the
-- parker's check does not wake while that wake is fresh: the woken job takes the key, and its release wakes
-- the parker. If the woken job never comes (its worker died), the parker's safety-net delay still runs it.

create table :GWL_SCHEMA.wakes (
  lock_key bigint primary key,
  at timestamptz not null
);

create or replace function :GWL_SCHEMA.wake_waiters(p_keys bigint[]) returns int
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
      -- (a woken waiter goes ahead of the jobs queued with it: see migration 5)
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

create or replace function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint) returns int
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

create or replace function :GWL_SCHEMA.sweep_waiters() returns bigint
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
