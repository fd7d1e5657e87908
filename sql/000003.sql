-- graphile-worker-locks: supersede.
--
-- A job enqueued with `supersede` (a `reschedule` task's option, or the enqueue's) supersedes the jobs of its
-- key enqueued before it. In the enqueue's own transaction, after the new job's insert, `supersede`:
--   - removes the jobs of the key that wait (queued, scheduled, waiting to retry, or parked in a line ahead of
--     the new job) and that no worker has fetched, on every slot of the key: the jobs of a `reschedule` task
--     enqueued through the library carry the key's flag, gwl:lock:<key> for a key of one slot (runners skip
--     it while the key is held) and gwl:key:<key> otherwise (a key of several slots, or several limits,
--     whose first slot is <key>); a parked one is a waiter of the key's line or, with several limits, of
--     another limit's line and flagged. Finding the flagged ones reads the waiting jobs (graphile-worker's
--     table has no index on flags): a cost paid only by a superseding enqueue;
--   - tells every lock session, on the channel 'gwl_supersede' (payload '<key>:<new job id>'), that the key's
--     jobs older than the new one are superseded: a session that holds the key (any of its slots) for such a
--     job aborts that job's signal, and one that is about to give the key to such a job, or park one, ends
--     it instead.
-- A notification is delivered when the transaction commits, and not at all if it rolls back, with the rows
-- it removed. Rows a worker or a waker has locked right now are skipped, never waited for (an enqueue inside
-- a caller's long transaction must not stall a lock session's release): such a job is on its way to the key,
-- and its session, told by the notification, ends it when it gets there.
--
-- Returns the jobs removed, in id order, as a JSON array of {"id", "task"} (the id as text; the task is the
-- removed job's own, which a lock group may make another than the new job's).
create function :GWL_SCHEMA.supersede(p_key bigint, p_job_id bigint) returns json
language plpgsql volatile as $$
declare
  v_flags text[] := array['gwl:lock:' || p_key::text, 'gwl:key:' || p_key::text];
  v_removed json;
  v_ids bigint[];
begin
  with flagged as (
    select j.id from :GRAPHILE_WORKER_SCHEMA._private_jobs j
    where j.locked_at is null and j.attempts < j.max_attempts and j.flags ?| v_flags
  ), parked as (
    delete from :GWL_SCHEMA.waiters w
    where w.id in (
      select x.id from :GWL_SCHEMA.waiters x
      where x.pos < p_job_id and (x.lock_key = p_key or x.job_id in (select f.id from flagged f))
      for update skip locked
    )
    returning w.job_id
  ), waiting as (
    select j.id from :GRAPHILE_WORKER_SCHEMA._private_jobs j
    where j.locked_at is null and j.attempts < j.max_attempts
      -- (a parked job's row may be newer than the new job, its place in line is not)
      and (j.id in (select p.job_id from parked p)
        or (j.id < p_job_id and j.id in (select f.id from flagged f)))
    for update skip locked
  ), removed as (
    delete from :GRAPHILE_WORKER_SCHEMA._private_jobs j using waiting where j.id = waiting.id
    returning j.id, j.task_id
  )
  select coalesce(json_agg(json_build_object('id', r.id::text, 'task', t.identifier) order by r.id), '[]'),
    coalesce(array_agg(r.id), '{}')
  into v_removed, v_ids
  from removed r left join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.id = r.task_id;
  -- A removed job woken a moment ago is no longer on its way to the key (wake_on_its_way, wake_if_free).
  if cardinality(v_ids) > 0 then
    delete from :GWL_SCHEMA.wakes k where k.job_id = any(v_ids);
    delete from :GWL_SCHEMA.prewakes p where p.job_id = any(v_ids);
  end if;
  perform pg_notify('gwl_supersede', p_key::text || ':' || p_job_id::text);
  return v_removed;
end;
$$;
