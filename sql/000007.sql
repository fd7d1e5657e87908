-- graphile-worker-locks, migration 7: an early wake can go to the holder's own process.
--
-- prewake (migration 6) made the next job in line runnable with graphile-worker's 'jobs:insert'
-- notification, which the idle workers of every process answer: the job went to whichever fetched first,
-- with 3 processes two times in three another process, whose hand-off then costs the release's notification
-- and a lock round trip where the holder's own process passes the key in memory. A session that knows an
-- idle worker of its own process (a runner given to `locks.attach`) now wakes the job without notifying and
-- nudges that worker itself. If a worker of another process takes the job first, nothing is lost: it waits
-- for the release as before. If nobody has fetched the job by the release, the release notifies.

-- wake_waiters (migration 4), with the notification optional. The one-argument form notifies, as before.
create function :GWL_SCHEMA.wake_waiters(p_keys bigint[], p_notify boolean) returns int
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
      insert into :GWL_SCHEMA.wakes (lock_key, at, job_id, pos)
        values (v_key, clock_timestamp(), v_waiter.job_id, v_waiter.pos)
        on conflict (lock_key) do update
          set at = excluded.at, job_id = excluded.job_id, pos = excluded.pos;
      v_on_its_way := true;
      exit;
    end loop;
    if not v_on_its_way then
      delete from :GWL_SCHEMA.wakes k where k.lock_key = v_key;
    end if;
  end loop;
  if v_woken > 0 and p_notify then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_woken::text || '}');
  end if;
  return v_woken;
end;
$$;

create or replace function :GWL_SCHEMA.wake_waiters(p_keys bigint[]) returns int
language sql volatile as $$
  select :GWL_SCHEMA.wake_waiters(p_keys, true)
$$;

-- prewake (migration 6), with the notification optional: without it, the caller's process fetches the job.
create function :GWL_SCHEMA.prewake(p_keys bigint[], p_notify boolean)
returns table (i int, job_id bigint)
language plpgsql volatile as $$
declare
  v_i int;
  v_job bigint;
begin
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    if :GWL_SCHEMA.wake_waiters(array[p_keys[v_i]], p_notify) > 0 then
      select k.job_id into v_job from :GWL_SCHEMA.wakes k where k.lock_key = p_keys[v_i];
      insert into :GWL_SCHEMA.prewakes (lock_key, job_id, at)
        values (p_keys[v_i], v_job, clock_timestamp())
        on conflict (lock_key) do update set job_id = excluded.job_id, at = excluded.at;
      return query select v_i, v_job;
    end if;
  end loop;
end;
$$;

create or replace function :GWL_SCHEMA.prewake(p_keys bigint[])
returns table (i int, job_id bigint)
language sql volatile as $$
  select * from :GWL_SCHEMA.prewake(p_keys, true)
$$;

-- release_waiters (migration 6), except that a job woken early that nobody has fetched yet (woken quietly,
-- for a worker of the holder's process that found another job) is announced to every worker now.
create or replace function :GWL_SCHEMA.release_waiters(p_keys bigint[], p_job_ids bigint[]) returns int
language plpgsql volatile as $$
declare
  v_i int;
  v_key bigint;
  v_early bigint;
  v_unfetched boolean;
  v_announce int := 0;
  v_wake bigint[] := '{}';
begin
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    v_key := p_keys[v_i];
    v_unfetched := null;
    delete from :GWL_SCHEMA.prewakes p where p.lock_key = v_key returning p.job_id into v_early;
    if v_early is not null and v_early is distinct from p_job_ids[v_i] then
      select j.locked_at is null into v_unfetched
        from :GWL_SCHEMA.wakes k
        join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = k.job_id
        where k.lock_key = v_key and k.job_id = v_early
          and k.at > clock_timestamp() - interval '2 seconds'
          -- parked again, it waits under a new job id in its old place
          and not exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = v_key and w.pos = k.pos);
    end if;
    if v_unfetched is not null then
      update :GWL_SCHEMA.wakes k set at = clock_timestamp() where k.lock_key = v_key;
      perform pg_notify('gwl_release', v_key::text);
      if v_unfetched then
        v_announce := v_announce + 1;
      end if;
    else
      v_wake := v_wake || v_key;
    end if;
  end loop;
  if v_announce > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_announce::text || '}');
  end if;
  return :GWL_SCHEMA.wake_waiters(v_wake);
end;
$$;
