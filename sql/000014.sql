-- graphile-worker-locks, migration 14: a job given back to the queue leaves no row behind.
--
-- A job that parks (`reschedule`) or is deferred (the lock session was unavailable) is replaced by a copy
-- (reschedule_job), and its own row gives up its key and its retries, to be deleted by graphile-worker's
-- completion when the task returns. That completion can be lost: the process dies before it, or the job
-- fails after the park committed. The row then stays as a permanently failed job that did not fail.
--
-- Each such row is recorded here, with the lock session that gave it back (its backend pid, when that session
-- was up). clean_parked removes a recorded row that is still the given-up row (no key, no retries left) and
-- that graphile-worker will not complete: unlocked (it was failed), locked by a process whose lock session is
-- gone, or locked for longer than a minute (a completion takes milliseconds). A queue that row still locks is
-- unlocked with it. Records of rows that are gone (completed as usual) are dropped.

create table :GWL_SCHEMA.parked_originals (
  job_id bigint primary key,
  -- the lock session's backend pid of the process that gave the job back, null if it had none then
  owner_pid int,
  parked_at timestamptz not null default now()
);

-- Gives a running job back to the queue without counting its attempt: a copy runs at p_run_at.
create function :GWL_SCHEMA.defer_job(p_job_id bigint, p_run_at timestamptz, p_owner_pid int)
returns bigint
language plpgsql volatile as $$
declare
  v_new_id bigint;
begin
  v_new_id := :GWL_SCHEMA.reschedule_job(p_job_id, p_run_at);
  if v_new_id is not null then
    insert into :GWL_SCHEMA.parked_originals (job_id, owner_pid) values (p_job_id, p_owner_pid)
      on conflict (job_id) do update set owner_pid = excluded.owner_pid, parked_at = now();
  end if;
  return v_new_id;
end;
$$;

-- Removes given-up rows that graphile-worker will not complete; returns their ids.
create function :GWL_SCHEMA.clean_parked() returns table (job_id bigint)
language plpgsql volatile as $$
begin
  delete from :GWL_SCHEMA.parked_originals p
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p.job_id);
  return query
  with stale as (
    select j.id, j.job_queue_id, j.locked_by
    from :GWL_SCHEMA.parked_originals p
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = p.job_id
    where j.key is null and j.attempts >= j.max_attempts
      and (
        j.locked_at is null
        or j.locked_at < now() - interval '1 minute'
        or (p.owner_pid is not null
            and not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = p.owner_pid))
      )
    for update of j skip locked
  ), unlocked_queues as (
    update :GRAPHILE_WORKER_SCHEMA._private_job_queues q set locked_at = null, locked_by = null
      from stale where q.id = stale.job_queue_id and q.locked_by = stale.locked_by
  ), removed as (
    delete from :GRAPHILE_WORKER_SCHEMA._private_jobs j using stale where j.id = stale.id
      returning j.id
  ), forgotten as (
    delete from :GWL_SCHEMA.parked_originals p using removed where p.job_id = removed.id
  )
  select removed.id from removed;
end;
$$;
