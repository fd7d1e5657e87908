-- graphile-worker-locks, migration 12: the line holds under load.
--
-- A job of a `reschedule` task takes a free key only if no job of that key is ahead of it in line (is_next,
-- migrations 4 and 9). Two kinds of job ahead were let past too soon, and on a busy machine a job could
-- overtake the one before it:
--
-- - A woken job (its waiter row is gone, its place kept in wakes) counted as on its way to the key for
--   100 ms only. With every worker busy, or on a loaded server, it can take longer to be fetched and to try
--   the key; after 100 ms the job behind it took the key first, and a parker's own check (wake_if_free) woke
--   a second job for the same release. A woken job now counts as on its way while it still exists (it has
--   not run, and has not parked again under a new id), for up to 2 seconds: long enough for any fetch and
--   lock on a live worker, short enough that a wake whose worker died does not stop the line for long (the
--   safety net of each parked job still runs it).
-- - A waiter fetched by its safety net, deciding right now, did not hold the line up at all: if the key
--   freed between its attempt and the attempt of a waiter behind it (also fetched by its safety net), the
--   one behind went first. A waiter ahead now holds the line while it waits, or while it is fetched and
--   deciding (locked in the last 2 seconds); a fetch older than that is a worker that died (graphile-worker
--   keeps such a job locked for hours), and is passed.
--
-- A waiter that takes its key by its safety net keeps its waiter row while it runs. Its release used to
-- meet that row first when waking the line, count the releasing job itself as on its way, and wake nobody:
-- the next in line waited for its safety net. The release now removes the releasing job's own row first.

-- Whether the job woken at `p_at` is still on its way to its key: woken in the last 100 ms, or in the last
-- 2 seconds and not yet run or parked again (it still exists under the id it was woken with).
create function :GWL_SCHEMA.wake_on_its_way(p_at timestamptz, p_job_id bigint) returns boolean
language sql stable as $$
  select p_at > clock_timestamp() - interval '2 seconds' and (
    p_at > clock_timestamp() - interval '100 milliseconds'
    or exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id)
  )
$$;

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
      where j.id = w.job_id and (j.locked_at is null or j.locked_at > now() - interval '2 seconds')
      limit 1
    ) j
  ) and not exists (
    select 1 from :GWL_SCHEMA.wakes k
    where k.lock_key = p_key and k.job_id is distinct from p_job_id
      and k.pos < (select pos from me)
      and :GWL_SCHEMA.wake_on_its_way(k.at, k.job_id)
  )
$$;

-- The parker's half of the hand-off (migration 4), with a woken job on its way as wake_on_its_way says.
create or replace function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint, p_job_id bigint)
returns int
language plpgsql volatile as $$
begin
  if exists (
    select 1 from :GWL_SCHEMA.wakes w
    where w.lock_key = p_key and w.job_id is distinct from p_job_id
      and :GWL_SCHEMA.wake_on_its_way(w.at, w.job_id)
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

-- release_waiters (migration 7), except that the releasing job's own waiter row, if it took its key by its
-- safety net, leaves the line first.
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
    if p_job_ids[v_i] is not null then
      delete from :GWL_SCHEMA.waiters w where w.job_id = p_job_ids[v_i] and w.lock_key = v_key;
    end if;
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
