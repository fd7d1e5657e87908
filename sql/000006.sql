-- graphile-worker-locks, migration 6: the next job in line is woken a little before its key frees.
--
-- A hand-off used to be three round trips in a row after the task ended: the unlock and wake, the woken
-- job's fetch, its lock. Now a holder whose key has a line wakes the first waiter shortly before it expects
-- to finish (prewake, from the lock session, timed by the task's average hold). The woken job is fetched
-- while the holder still runs, finds the key held and, being the one woken early, waits for the release
-- instead of parking. The release then only has to tell it (a notification on 'gwl_release' whose payload is
-- the key, which lock sessions listen to), and its session takes the key: one round trip after the unlock.
-- When the woken job is fetched by the holder's own process, the key passes from one job to the next in
-- memory, without an unlock at all.
--
-- The line stays as migration 4 keeps it: the early wake is the ordinary wake of the first waiter, with its
-- place kept in wakes. What is new is remembering which job was woken early (prewakes), so that the release
-- does not wake a second job for the same key while that one is on its way.

create table :GWL_SCHEMA.prewakes (
  lock_key bigint primary key,
  job_id bigint not null,
  at timestamptz not null
);

-- Wakes the first waiter of each key now, while the caller still holds the key. Returns, for each key
-- (by its index in p_keys) that had a waiter to wake, the woken job's id.
create function :GWL_SCHEMA.prewake(p_keys bigint[])
returns table (i int, job_id bigint)
language plpgsql volatile as $$
declare
  v_i int;
  v_job bigint;
begin
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    if :GWL_SCHEMA.wake_waiters(array[p_keys[v_i]]) > 0 then
      select k.job_id into v_job from :GWL_SCHEMA.wakes k where k.lock_key = p_keys[v_i];
      insert into :GWL_SCHEMA.prewakes (lock_key, job_id, at)
        values (p_keys[v_i], v_job, clock_timestamp())
        on conflict (lock_key) do update set job_id = excluded.job_id, at = excluded.at;
      return query select v_i, v_job;
    end if;
  end loop;
end;
$$;

-- The release's half: for each key released by the job at the same index of p_job_ids, if a job woken early
-- is still on its way (its wake is recent, it still exists and it was not parked again), notify its session
-- and wake nobody else; its wake is renewed, so that jobs behind it do not take the key first (is_next).
-- Otherwise wake the first waiter, as wake_waiters does. Returns how many jobs were woken.
create function :GWL_SCHEMA.release_waiters(p_keys bigint[], p_job_ids bigint[]) returns int
language plpgsql volatile as $$
declare
  v_i int;
  v_key bigint;
  v_early bigint;
  v_wake bigint[] := '{}';
begin
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    v_key := p_keys[v_i];
    delete from :GWL_SCHEMA.prewakes p where p.lock_key = v_key returning p.job_id into v_early;
    if v_early is not null and v_early is distinct from p_job_ids[v_i] and exists (
      select 1 from :GWL_SCHEMA.wakes k
      join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = k.job_id
      where k.lock_key = v_key and k.job_id = v_early
        and k.at > clock_timestamp() - interval '2 seconds'
        -- parked again, it waits under a new job id in its old place
        and not exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = v_key and w.pos = k.pos)
    ) then
      update :GWL_SCHEMA.wakes k set at = clock_timestamp() where k.lock_key = v_key;
      perform pg_notify('gwl_release', v_key::text);
    else
      v_wake := v_wake || v_key;
    end if;
  end loop;
  return :GWL_SCHEMA.wake_waiters(v_wake);
end;
$$;

-- Whether job p_job_id is the one woken early for p_key (it then waits for the release instead of parking).
create function :GWL_SCHEMA.is_prewoken(p_key bigint, p_job_id bigint) returns boolean
language sql stable as $$
  select exists (select 1 from :GWL_SCHEMA.prewakes p where p.lock_key = p_key and p.job_id = p_job_id)
$$;

create function :GWL_SCHEMA.sweep_prewakes() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.prewakes where at < now() - interval '1 minute' returning 1
  )
  select count(*) from gone
$$;
