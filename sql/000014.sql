-- graphile-worker-locks: a job fetched in a batch that meets its key held waits in line at its worker.
--
-- Placeholders as in 000001.sql.
--
-- A `reschedule` job fetched in a batch of graphile-worker's local queue used to park when it met its key
-- held, and be fetched a second time once woken. It now takes its place in the key's line as it is: a
-- waiter row of its own job, which its worker keeps locked (join_line). Such a waiter is woken as any other:
-- - wake_waiters, finding the first waiter already fetched, keeps it on its way (its `wakes` row, as for a
--   waiter fetched by its safety net) and tells it by a release notification whose payload names it
--   ('<key>/<job id>'): it then tries the key; release_waiters tells a fetched job woken early so too;
-- - prewake_line, the early wake of a hold, names such a waiter too (its id prefixed 'f'), so that the
--   holder's process passes it the key in memory at the release when it waits there. A hold that took its
--   key from its own place in line leaves the line first (`p_holders`), so that it never wakes itself.
-- A release notification '<key>/?' asks every waiter of the key at its worker to look at its line again
-- (a job ahead of it parked).

-- A fetched `reschedule` job that met its key held takes its place in the key's line as it is (a waiter row
-- of its own job, which stays locked by its worker), instead of being given back; a job already in line, or
-- woken from it, keeps its place. Returns -1 when the key looked free and the job next (the holder released
-- in between: the job tries again at once); -2, its
-- row not put in, when a job ahead of it in line is not fetched (a parked job, or one woken and on its way
-- to a worker): that job needs a worker, and one that waits here would keep it from it, so the job parks;
-- else how many wait ahead of it.
create function :GWL_SCHEMA.join_line(p_key bigint, p_job_id bigint, p_slots bigint[]) returns int
language plpgsql volatile as $$
declare
  v_pos bigint;
begin
  perform :GWL_SCHEMA.lock_lines(array[p_key]);
  v_pos := :GWL_SCHEMA.line_position(p_key, p_job_id);
  if exists (
    select 1 from :GWL_SCHEMA.waiters w
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = w.job_id
    where w.lock_key = p_key and w.pos < v_pos and j.locked_at is null
  ) or exists (
    select 1 from :GWL_SCHEMA.wakes k
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = k.job_id
    where k.lock_key = p_key and k.pos < v_pos and k.job_id <> p_job_id and j.locked_at is null
      and :GWL_SCHEMA.wake_on_its_way(k.at, k.job_id)
  ) then
    return -2;
  end if;
  insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
    select p_key, p_job_id, null, v_pos
    where not exists (
      select 1 from :GWL_SCHEMA.waiters w where w.lock_key = p_key and w.job_id = p_job_id
    );
  if (
    select count(*)
    from pg_catalog.pg_locks l
    join unnest(p_slots) as s(k)
      on l.classid = ((s.k >> 32) & 4294967295)::oid and l.objid = (s.k & 4294967295)::oid
    where l.locktype = 'advisory' and l.objsubid = 1 and l.granted
      and l.database = (select oid from pg_catalog.pg_database where datname = current_database())
  ) < cardinality(p_slots) then
    if :GWL_SCHEMA.is_next(p_key, p_job_id) then
      return -1;
    end if;
    -- The key is free and another job is next: one that joined the line after this job was woken, say. Unless
    -- a job woken for it is on its way, the first in line is woken (the parker's check, wake_if_free), so
    -- that the line does not stop here.
    perform :GWL_SCHEMA.wake_if_free(p_slots, p_key, p_job_id);
  end if;
  return (select count(*) from :GWL_SCHEMA.waiters w where w.lock_key = p_key and w.pos < v_pos);
end;
$$;

-- As in 000001.sql, and a first waiter whose job is fetched (it waits at its worker, join_line) is told by
-- a release notification that the key may be free.
create or replace function :GWL_SCHEMA.wake_waiters(p_keys bigint[], p_notify boolean) returns int
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
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now()) - interval '1 millisecond'
        where j.id = v_waiter.job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
      elsif not exists (
        select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_waiter.job_id
      ) then
        continue;
      else
        -- fetched: it waits at its worker (join_line), or decides right now; told, it tries the key
        perform pg_notify('gwl_release', v_key::text || '/' || v_waiter.job_id::text);
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
  if p_notify then
    perform :GWL_SCHEMA.announce_jobs(v_woken);
  end if;
  return v_woken;
end;
$$;

-- prewake (000001.sql), for holds whose jobs are p_holders: each holder's own place in line, if it took its
-- key from there, goes first; a first waiter already fetched is named too, its id prefixed 'f'.
create function :GWL_SCHEMA.prewake_line(p_keys bigint[], p_notify boolean, p_holders bigint[])
returns table (i int, job_id text)
language plpgsql volatile as $$
declare
  v_i int;
  v_job bigint;
  v_locked boolean;
begin
  perform :GWL_SCHEMA.lock_lines(p_keys);
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    if p_holders[v_i] is not null then
      delete from :GWL_SCHEMA.waiters w where w.lock_key = p_keys[v_i] and w.job_id = p_holders[v_i];
    end if;
    perform :GWL_SCHEMA.wake_waiters(array[p_keys[v_i]], p_notify);
    select k.job_id into v_job from :GWL_SCHEMA.wakes k
      where k.lock_key = p_keys[v_i] and k.at >= statement_timestamp();
    if v_job is not null then
      select j.locked_at is not null into v_locked
        from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_job;
      insert into :GWL_SCHEMA.prewakes (lock_key, job_id, at)
        values (p_keys[v_i], v_job, clock_timestamp())
        on conflict (lock_key) do update set job_id = excluded.job_id, at = excluded.at;
      return query select v_i, case when v_locked then 'f' else '' end || v_job::text;
    end if;
  end loop;
end;
$$;

-- As in 000008.sql, and a job woken early that is fetched and waits in line at its worker (join_line) is
-- told by a notification that names it ('<key>/<job id>'), besides the key's own notification that a job
-- woken early, waiting for the release as such, hears.
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
  if not exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = any(p_keys))
    and not exists (select 1 from :GWL_SCHEMA.prewakes p where p.lock_key = any(p_keys))
    and not exists (select 1 from :GWL_SCHEMA.wakes k where k.lock_key = any(p_keys)) then
    return 0;
  end if;
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
      else
        perform pg_notify('gwl_release', v_key::text || '/' || v_early::text);
      end if;
    else
      v_wake := v_wake || v_key;
    end if;
  end loop;
  perform :GWL_SCHEMA.announce_jobs(v_announce);
  return :GWL_SCHEMA.wake_waiters(v_wake, true);
end;
$$;
