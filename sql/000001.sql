-- graphile-worker-locks, migration 1: the lock registry, the held-locks view, and the functions the lock
-- session and the `reschedule` conflict strategy call. Never edit a shipped migration; add a new file.
--
-- Placeholders replaced at run time: :GWL_SCHEMA (this library's schema, already created) and
-- :GRAPHILE_WORKER_SCHEMA (graphile-worker's schema). Both arrive escaped.

-- Who holds which key, written by each lock session about twice a second for the locks it holds (never on
-- the hot path). pg_locks is the truth; this table only adds the task, the job and the time of acquisition.
-- Unlogged: after a crash it is empty, which is what the truth is too.
create unlogged table :GWL_SCHEMA.lock_holders (
  pid int not null,
  lock_key bigint not null,
  task_identifier text not null,
  job_id bigint,
  since timestamptz not null,
  primary key (pid, lock_key)
);

-- Every advisory lock held in this database (one-bigint form), with the holder's session and, for locks
-- taken by this library, the task, job and time of acquisition.
create view :GWL_SCHEMA.held_locks as
select
  ((l.classid::int8 << 32) | l.objid::int8) as lock_key,
  h.task_identifier,
  h.job_id,
  l.pid,
  a.application_name,
  a.client_addr,
  h.since,
  a.backend_start as session_started_at
from pg_catalog.pg_locks l
join pg_catalog.pg_stat_activity a on a.pid = l.pid
left join :GWL_SCHEMA.lock_holders h
  on h.pid = l.pid and h.lock_key = ((l.classid::int8 << 32) | l.objid::int8)
where l.locktype = 'advisory'
  and l.objsubid = 1
  and l.granted
  and l.database = (select oid from pg_catalog.pg_database where datname = current_database());

-- Semaphore acquisition: try each slot in order and keep the first that is free. Callers never pass a slot
-- this session already holds (session locks are re-entrant, so that would "succeed").
create function :GWL_SCHEMA.try_lock_first(keys bigint[]) returns bigint
language plpgsql volatile as $$
declare
  k bigint;
begin
  foreach k in array keys loop
    if pg_catalog.pg_try_advisory_lock(k) then
      return k;
    end if;
  end loop;
  return null;
end;
$$;

-- The `reschedule` conflict strategy: replace the running job (which the worker will complete as soon as
-- this returns) by a copy that runs at `p_run_at`, without counting the attempt that met the conflict. The
-- running row gives up its job key and its retries in the same transaction, so a crash between this and
-- its completion neither loses the job nor runs it twice. Reads and writes graphile-worker's private job
-- table (as its own add_job does), which is tested against each supported version.
create function :GWL_SCHEMA.reschedule_job(p_job_id bigint, p_run_at timestamptz) returns bigint
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
