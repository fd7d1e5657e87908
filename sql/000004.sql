-- graphile-worker-locks, migration 4: cheaper parking, and woken jobs keep their place in line.
--
-- reschedule_job writes the copy directly (as add_unique_job does) instead of through add_job's general
-- path, and a woken waiter gets back the run_at its job had when it met the conflict, so that it runs
-- before jobs that arrived after it (graphile-worker fetches by priority, then run_at).

alter table :GWL_SCHEMA.waiters add column run_at timestamptz;

create or replace function :GWL_SCHEMA.reschedule_job(p_job_id bigint, p_run_at timestamptz) returns bigint
language plpgsql volatile as $$
declare
  v_old :GRAPHILE_WORKER_SCHEMA._private_jobs;
  v_new_id bigint;
begin
  select * into v_old from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id for update;
  if not found then
    return null;
  end if;
  -- The running row gives up its key and its retries: a crash before its completion neither loses the
  -- job (the copy exists) nor runs it twice (this row will not be retried).
  update :GRAPHILE_WORKER_SCHEMA._private_jobs j
    set key = null, attempts = j.max_attempts, updated_at = now()
    where j.id = p_job_id;
  insert into :GRAPHILE_WORKER_SCHEMA._private_jobs
    (job_queue_id, task_id, payload, run_at, attempts, max_attempts, last_error, key, priority, flags)
  values (v_old.job_queue_id, v_old.task_id, v_old.payload, p_run_at, greatest(v_old.attempts - 1, 0),
    v_old.max_attempts, v_old.last_error, v_old.key, v_old.priority, v_old.flags)
  returning id into v_new_id;
  return v_new_id;
end;
$$;

create or replace function :GWL_SCHEMA.park_job(p_job_id bigint, p_run_at timestamptz, p_lock_key bigint) returns bigint
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
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now())
        where j.id = v_waiter.job_id and j.locked_at is null;
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
