-- graphile-worker-locks: the library's schema.
--
-- Placeholders replaced at run time: :GWL_SCHEMA (this library's schema, already created) and
-- :GRAPHILE_WORKER_SCHEMA (graphile-worker's schema). Both arrive quoted.
--
-- Contents, in order:
--   1. The data model: who holds what, unique windows, the lines of `reschedule` keys, jobs given back, the
--      held_locks view and the job_spec type.
--   2. graphile-worker's conventions: a job's defaults and the `jobs:insert` notification.
--   3. The lock statement's helpers.
--   4. The line of a `reschedule` key: parking's order, waking.
--   5. Jobs given back to the queue: parked or deferred, and cleaned.
--   6. Enqueueing, one job or a batch, with the unique helpers at its head.
--   7. Sweeps.
--
-- The functions here read and write graphile-worker's private tables (`_private_jobs`, `_private_tasks`,
-- `_private_job_queues`) as its own add_job does; the library refuses a graphile-worker schema level it was
-- not tested with (src/migrate.ts).


-- 1. The data model ---------------------------------------------------------------------------------------

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

-- Each lock session of this library, written by the session when it connects: the process it belongs to and
-- that process's host, which PostgreSQL does not know (its `pid` is the backend's). A row counts only while
-- its backend is the one that wrote it (`backend_start`), so a backend pid reused by another client shows no
-- process; stale rows are dropped by the next session that connects.
create unlogged table :GWL_SCHEMA.lock_sessions (
  pid int primary key,
  backend_start timestamptz not null,
  process_id int not null,
  host text not null
);

-- Windows of unique jobs with a window alone (`uniqueFor` without a scope), which must outlive their job
-- (section 6): removed once expired, by `sweep_unique_windows`, or reused by the next claim of the same key.
create table :GWL_SCHEMA.unique_windows (
  unique_key text primary key,
  job_id bigint,
  expires_at timestamptz not null
);
create index unique_windows_expires_at on :GWL_SCHEMA.unique_windows (expires_at);

-- Jobs waiting in line for a `reschedule` key (section 4): each a waiter of its key until it is woken.
create table :GWL_SCHEMA.waiters (
  id bigserial primary key,
  lock_key bigint not null,
  job_id bigint not null,
  -- the job's run_at when it met the conflict, given back when it is woken
  run_at timestamptz,
  since timestamptz not null default now(),
  -- its place in line: the id of its job as it was first parked or enqueued
  pos bigint not null
);
create index waiters_lock_key_pos on :GWL_SCHEMA.waiters (lock_key, pos);
create index waiters_job_id on :GWL_SCHEMA.waiters (job_id);

-- Each key's last wake: when, which job, and that job's place in line. A key's row is also the lock that
-- orders the changes to its line (lock_lines).
create table :GWL_SCHEMA.wakes (
  lock_key bigint primary key,
  at timestamptz not null,
  job_id bigint,
  pos bigint
);

-- The job of each key woken early (prewake), which waits for the release instead of parking.
create table :GWL_SCHEMA.prewakes (
  lock_key bigint primary key,
  job_id bigint not null,
  at timestamptz not null
);

-- A job given back to the queue (parked, or deferred because the lock session was unavailable) leaves no row
-- behind. Its own row gives up its key and its retries, to be deleted by graphile-worker's completion when
-- the task returns; that completion can be lost (the process dies before it, or the job fails after the park
-- committed), and the row would stay as a permanently failed job that did not fail. So each such row is
-- recorded here, with the lock session that gave it back (its backend pid, when that session was up), and
-- clean_given_back removes a recorded row that is still the given-up row (no key, no retries left) and that
-- graphile-worker will not complete: unlocked (it was failed), locked by a process whose lock session is
-- gone, or locked for longer than a minute (a completion takes milliseconds). A queue that row still locks is
-- unlocked with it. Records of rows that are gone (completed as usual) are dropped.
create table :GWL_SCHEMA.given_back (
  job_id bigint primary key,
  -- the lock session's backend pid of the process that gave the job back, null if it had none then
  owner_pid int,
  -- the copy that runs in its place
  copy_id bigint,
  given_back_at timestamptz not null default now()
);

-- Every advisory lock held in this database (one-bigint form), with the holder's session and, for locks
-- taken by this library, the worker process and its host, and the task, job and time of acquisition.
create view :GWL_SCHEMA.held_locks as
select
  ((l.classid::int8 << 32) | l.objid::int8) as lock_key,
  h.task_identifier,
  h.job_id,
  l.pid,
  a.application_name,
  a.client_addr,
  h.since,
  a.backend_start as session_started_at,
  s.process_id,
  s.host
from pg_catalog.pg_locks l
join pg_catalog.pg_stat_activity a on a.pid = l.pid
left join :GWL_SCHEMA.lock_holders h
  on h.pid = l.pid and h.lock_key = ((l.classid::int8 << 32) | l.objid::int8)
left join :GWL_SCHEMA.lock_sessions s on s.pid = l.pid and s.backend_start = a.backend_start
where l.locktype = 'advisory'
  and l.objsubid = 1
  and l.granted
  and l.database = (select oid from pg_catalog.pg_database where datname = current_database());

-- One job to add: unique (unique_key with a scope, or a window alone) or not (unique_key null). enqueue_job
-- takes one by name (identifier, queue_name); a batch (enqueue_jobs) is a JSON array of them that names its
-- task and queue by place instead (task, queue), lighter to write and to parse. A field left out of an
-- item of the batch is null.
create type :GWL_SCHEMA.job_spec as (
  identifier text,
  payload json,
  queue_name text,
  run_at timestamptz,
  max_attempts int,
  priority int,
  -- graphile-worker's flags object ({"flag": true}), with the gwl:unique:<scope> flag already added
  flags jsonb,
  unique_key text,
  scope text,
  window_seconds float8,
  -- null: reject
  on_duplicate text,
  -- in a batch: whether this is the batch's first scoped item of its key; null: false
  first boolean,
  -- in a batch: its task and queue, as places in p_tasks and p_queues (from 1); no queue: null
  task int,
  queue int,
  -- in a batch: an item added waiting in line: its run_at, in milliseconds from now (its safety net)
  park_ms float8
);


-- 2. graphile-worker's conventions ------------------------------------------------------------------------

-- graphile-worker's defaults for what a job_spec leaves null: payload {}, run_at now, max_attempts 25,
-- priority 0. A single select, so that PostgreSQL inlines it where a batch inserts its rows.
create function :GWL_SCHEMA.job_defaults(p_payload json, p_run_at timestamptz, p_max_attempts int,
  p_priority int)
returns table (payload json, run_at timestamptz, max_attempts int, priority int)
language sql stable as $$
  select coalesce(p_payload, '{}'::json), coalesce(p_run_at, now()), coalesce(p_max_attempts, 25),
    coalesce(p_priority, 0)
$$;

-- Tells graphile-worker's workers that `p_count` jobs became runnable (added or woken), as its add_job does;
-- nothing when there are none.
create function :GWL_SCHEMA.announce_jobs(p_count int) returns void
language sql volatile as $$
  select pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || p_count::text || '}')
  where p_count > 0
$$;


-- 3. The lock statement's helpers -------------------------------------------------------------------------

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


-- 4. The line of a `reschedule` key -----------------------------------------------------------------------
--
-- A job that meets a held key under the `reschedule` strategy is parked: replaced by a copy whose run_at is
-- a safety net some time ahead, and registered as a waiter of its key, in the same transaction (park_job).
-- The process that releases a key wakes the first waiter in line (its run_at becomes now, and workers are
-- notified as for a new job) in the same statement as the unlock. No polling.
--
-- Every waiter has a position: the id of the job as it was first parked (graphile-worker's ids follow the
-- enqueue order). It survives being woken and parked again: a woken job that loses the key to a race, or a
-- parked job fetched by its safety net while others still wait, parks again in the same place. Waking
-- removes the waiter; the woken job's position is kept with the key's last wake (wakes), which is where a
-- woken job that has to park again finds it.
--
-- A job of a `reschedule` task takes a free key only if no job of that key is ahead of it (is_next): a job
-- fetched for the first time while others wait for its key parks behind them instead of overtaking them,
-- and the woken job, which is the first in line, finds the key as its releaser left it.
--
-- Lost wake-ups are closed by ordering: the releaser unlocks, then reads the waiters; the parker commits
-- its waiter, then looks at the lock (wake_if_free). Whichever comes second sees the other. Both hold the
-- key's line (lock_lines) meanwhile, the releaser from before its unlock: they take turns, so that the second
-- also sees the first's wake.
--
-- A woken waiter gets back the run_at its job had when it met the conflict, less a millisecond: graphile-
-- worker fetches by priority, then run_at, then id, so the copy (a newer id) goes ahead of the jobs queued
-- with it, which would otherwise meet the key first and park in turn.
--
-- One wake per release: a parker's own check can find the key free in the moment between a release, which
-- has already woken the next waiter, and that waiter taking the key; waking another would send two jobs
-- after one key. So while a woken job is on its way (wake_on_its_way), the parker's check wakes nobody: the
-- woken job takes the key, and its release wakes the parker.
--
-- Early wakes: a holder whose key has a line wakes the first waiter shortly before it expects to finish
-- (prewake, from the lock session, timed by the task's average hold). The woken job is fetched while the
-- holder still runs, finds the key held and, being the one woken early, waits for the release instead of
-- parking. The release then only has to tell it (a notification on 'gwl_release' whose payload is the key,
-- which lock sessions listen to), and its session takes the key: one round trip after the unlock. When the
-- woken job is fetched by the holder's own process, the key passes from one job to the next in memory. A
-- session that knows an idle worker of its own process wakes the job without notifying every worker and
-- nudges that worker itself; if nobody has fetched the job by the release, the release notifies.

-- Locks the line of each key, in key order, until the caller's transaction ends: whoever parks a job, wakes
-- one or releases the key (before its unlock) holds it, so that each sees what the other did. Without it a
-- parker that finds the key free the moment after a release's unlock, while the release's wake is not yet
-- committed, would wake the job behind the one the release is waking: two jobs sent after one key, and the
-- first one's place in line lost. The lock is the key's row in `wakes`, made when missing (a placeholder that
-- names no job).
create function :GWL_SCHEMA.lock_lines(p_keys bigint[]) returns int
language plpgsql volatile as $$
declare
  v_key bigint;
begin
  for v_key in select distinct k from unnest(p_keys) as u(k) order by k loop
    loop
      perform 1 from :GWL_SCHEMA.wakes k where k.lock_key = v_key for update;
      exit when found;
      insert into :GWL_SCHEMA.wakes (lock_key, at) values (v_key, '-infinity') on conflict do nothing;
    end loop;
  end loop;
  return coalesce(cardinality(p_keys), 0);
end;
$$;

-- A job's place in the line of `p_key`: its waiter's, the last wake's if it was that job, else its own id.
create function :GWL_SCHEMA.line_position(p_key bigint, p_job_id bigint) returns bigint
language sql stable as $$
  select coalesce(
    (select w.pos from :GWL_SCHEMA.waiters w where w.job_id = p_job_id and w.lock_key = p_key limit 1),
    (select k.pos from :GWL_SCHEMA.wakes k where k.lock_key = p_key and k.job_id = p_job_id),
    p_job_id
  )
$$;

-- Whether the job woken at `p_at` is still on its way to its key: woken in the last 100 ms, or in the last
-- 2 seconds and not yet run or parked again (it still exists under the id it was woken with). Two seconds
-- is long enough for any fetch and lock on a live worker, and short enough that a wake whose worker died
-- does not stop the line for long (each parked job's safety net still runs it).
create function :GWL_SCHEMA.wake_on_its_way(p_at timestamptz, p_job_id bigint) returns boolean
language sql stable as $$
  select p_at > clock_timestamp() - interval '2 seconds' and (
    p_at > clock_timestamp() - interval '100 milliseconds'
    or exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id)
  )
$$;

-- Whether no job of `p_key` is ahead of job `p_job_id`: no parked one that waits, or that is fetched and
-- deciding right now (locked in the last 2 seconds; an older fetch is a worker that died, which
-- graphile-worker keeps locked for hours), and no woken one on its way. The waiters ahead are read by the
-- (lock_key, pos) index and each one's job by its primary key, stopping at the first that still counts: a
-- plan that does not depend on how long the line was when the table was last analyzed.
create function :GWL_SCHEMA.is_next(p_key bigint, p_job_id bigint) returns boolean
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

-- Whether job p_job_id is the one woken early for p_key (it then waits for the release instead of parking).
create function :GWL_SCHEMA.is_prewoken(p_key bigint, p_job_id bigint) returns boolean
language sql stable as $$
  select exists (select 1 from :GWL_SCHEMA.prewakes p where p.lock_key = p_key and p.job_id = p_job_id)
$$;

-- For each key, makes the first waiter in line whose job still waits runnable now, announcing it to every
-- worker (jobs:insert) when `p_notify`. Returns how many were woken. Plpgsql, so that each statement here
-- sees what committed before it ran (after the caller's unlocks).
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
      -- Woken, or already running (fetched by its safety net): either way it is on its way to the key, with
      -- its place kept here should it have to park again.
      insert into :GWL_SCHEMA.wakes (lock_key, at, job_id, pos)
        values (v_key, clock_timestamp(), v_waiter.job_id, v_waiter.pos)
        on conflict (lock_key) do update
          set at = excluded.at, job_id = excluded.job_id, pos = excluded.pos;
      v_on_its_way := true;
      exit;
    end loop;
    if not v_on_its_way then
      -- Nobody waits: whoever was woken last has come and gone. Its wake must not keep counting as one on its
      -- way, or a job that parks a moment later would wait for it (wake_if_free) instead of being woken.
      delete from :GWL_SCHEMA.wakes k where k.lock_key = v_key;
    end if;
  end loop;
  if p_notify then
    perform :GWL_SCHEMA.announce_jobs(v_woken);
  end if;
  return v_woken;
end;
$$;

-- The parker's half of the hand-off: if fewer than all slots of the key are held, and no woken job other
-- than the parker itself is on its way to it, wake a waiter.
create function :GWL_SCHEMA.wake_if_free(p_slots bigint[], p_key bigint, p_job_id bigint)
returns int
language plpgsql volatile as $$
begin
  perform :GWL_SCHEMA.lock_lines(array[p_key]);
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
    return :GWL_SCHEMA.wake_waiters(array[p_key], true);
  end if;
  return 0;
end;
$$;

-- Wakes the first waiter of each key now, while the caller still holds the key, announcing it to every
-- worker when `p_notify` (without it, the caller's process fetches the job). Returns, for each key (by its
-- index in p_keys) that had a waiter to wake, the woken job's id.
create function :GWL_SCHEMA.prewake(p_keys bigint[], p_notify boolean)
returns table (i int, job_id bigint)
language plpgsql volatile as $$
declare
  v_i int;
  v_job bigint;
begin
  perform :GWL_SCHEMA.lock_lines(p_keys);
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

-- The release's half: for each key released by the job at the same index of p_job_ids (whose own waiter
-- row, if it took its key by its safety net, leaves the line first), if a job woken early is still on its
-- way (its wake is recent, it still exists and it was not parked again), notify its session and wake nobody
-- else; its wake is renewed, so that jobs behind it do not take the key first (is_next), and a job woken
-- early that nobody has fetched yet is announced to every worker. Otherwise wake the first waiter. Returns
-- how many jobs were woken. The caller holds the lines of p_keys, taken before its unlocks (the lock
-- statement calls lock_lines first).
create function :GWL_SCHEMA.release_waiters(p_keys bigint[], p_job_ids bigint[]) returns int
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
  perform :GWL_SCHEMA.announce_jobs(v_announce);
  return :GWL_SCHEMA.wake_waiters(v_wake, true);
end;
$$;


-- 5. Jobs given back to the queue -------------------------------------------------------------------------
--
-- A running job is given back to the queue when it meets its held key under the `reschedule` strategy
-- (park_job: it waits in line) or when the lock session is unavailable (defer_job). Either way a copy runs in
-- its place, and the row given back is recorded (given_back) until graphile-worker completes it.

-- Replaces the running job (which the worker completes as soon as this commits) by a copy that runs at
-- `p_run_at`, without counting the attempt that met the conflict. The running row gives up its job key and
-- its retries in the same transaction, so a crash between this and its completion neither loses the job
-- (the copy exists) nor runs it twice (this row will not be retried).
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

-- Gives a running job back to the queue (reschedule_job), recording the row given back (given_back) with
-- `p_owner_pid`, the lock session of the process that gives it back. A slot the job reserved over its rate
-- (rate_reservations, sql/000004.sql) passes to the copy, so a job parked in a line, deferred or paused
-- keeps its place among its key's reservations. Returns the copy's id.
create function :GWL_SCHEMA.give_back_job(p_job_id bigint, p_run_at timestamptz, p_owner_pid int)
returns bigint
language plpgsql volatile as $$
declare
  v_new_id bigint := :GWL_SCHEMA.reschedule_job(p_job_id, p_run_at);
begin
  if v_new_id is not null then
    insert into :GWL_SCHEMA.given_back (job_id, owner_pid, copy_id)
      values (p_job_id, p_owner_pid, v_new_id)
      on conflict (job_id) do update
        set owner_pid = excluded.owner_pid, copy_id = excluded.copy_id, given_back_at = now();
    update :GWL_SCHEMA.rate_reservations r set job_id = v_new_id where r.job_id = p_job_id;
  end if;
  return v_new_id;
end;
$$;

-- Parks a job as a waiter of `p_lock_key`, its copy's safety net timed by its place in line:
-- `p_per_position` later for each parked job ahead of it (the caller's estimate of one job's hold), but no
-- later than `p_latest`. A job far back in a long line is not fetched by its safety net long before its turn
-- can come, only to park again. Returns the copy and when it runs.
create function :GWL_SCHEMA.park_job(
  p_job_id bigint,
  p_run_at timestamptz,
  p_lock_key bigint,
  p_per_position interval,
  p_latest timestamptz,
  p_owner_pid int
) returns table (id bigint, run_at timestamptz)
language plpgsql volatile as $$
declare
  v_run_at timestamptz;
  v_pos bigint;
  v_ahead bigint;
  v_safety_net timestamptz;
  v_new_id bigint;
begin
  perform :GWL_SCHEMA.lock_lines(array[p_lock_key]);
  select j.run_at into v_run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id;
  v_pos := :GWL_SCHEMA.line_position(p_lock_key, p_job_id);
  select count(*) into v_ahead from :GWL_SCHEMA.waiters w
    where w.lock_key = p_lock_key and w.pos < v_pos;
  v_safety_net := greatest(p_run_at, least(p_run_at + v_ahead * p_per_position, p_latest));
  v_new_id := :GWL_SCHEMA.give_back_job(p_job_id, v_safety_net, p_owner_pid);
  if v_new_id is null then
    return;
  end if;
  -- A waiter fetched by its safety net parks again in its own row; anyone else gets a row at its place.
  update :GWL_SCHEMA.waiters w set job_id = v_new_id
    where w.job_id = p_job_id and w.lock_key = p_lock_key;
  if not found then
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      values (p_lock_key, v_new_id, v_run_at, v_pos);
  end if;
  return query select v_new_id, v_safety_net;
end;
$$;

-- Gives a running job back to the queue without counting its attempt: a copy runs at p_run_at. Idempotent:
-- a job already given back answers with its copy, so that a caller who did not hear the answer of a first
-- call (its connection died around the commit) can ask again, and never runs the job beside its copy.
create function :GWL_SCHEMA.defer_job(p_job_id bigint, p_run_at timestamptz, p_owner_pid int)
returns bigint
language plpgsql volatile as $$
declare
  v_new_id bigint;
begin
  select g.copy_id into v_new_id from :GWL_SCHEMA.given_back g where g.job_id = p_job_id;
  if found then
    return v_new_id;
  end if;
  return :GWL_SCHEMA.give_back_job(p_job_id, p_run_at, p_owner_pid);
end;
$$;

-- Removes given-up rows that graphile-worker will not complete; returns their ids.
create function :GWL_SCHEMA.clean_given_back() returns table (job_id bigint)
language plpgsql volatile as $$
begin
  delete from :GWL_SCHEMA.given_back p
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p.job_id);
  return query
  with stale as (
    select j.id, j.job_queue_id, j.locked_by
    from :GWL_SCHEMA.given_back p
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
    delete from :GWL_SCHEMA.given_back p using removed where p.job_id = removed.id
  )
  select removed.id from removed;
end;
$$;


-- 6. Enqueueing -------------------------------------------------------------------------------------------
--
-- The library inserts into graphile-worker's job table itself (src/enqueue.ts says why), with
-- graphile-worker's defaults (job_defaults) and its `jobs:insert` notification (announce_jobs).
--
-- The unique helpers come first, then the enqueue of one job, then a batch's.
--
-- A unique job's key is stored as its graphile-worker job key (`gwl:u:<sha-256>`), so the database's own
-- unique index on that column decides every race: two enqueuers of one key can never both insert. The job's
-- own rules travel on its row as flags, so they survive retries and the `reschedule` strategy's copy:
--   gwl:unique:queued | gwl:unique:active | gwl:unique:exists   its scope
--   gwl:unique-until:<epoch seconds>                             the end of its `uniqueFor` window
-- A job whose key another enqueue meets either still blocks it (by the EXISTING job's scope and window) or
-- gives up the key (it keeps running or retrying, just without the key) to the new job. No bookkeeping
-- table is involved, so nothing is left behind when jobs complete.
--
-- A window alone (`uniqueFor` without a scope) must outlive its job, so it is a row of `unique_windows`.

-- Whether an existing job still refuses a duplicate, by its own scope and window. Written without a
-- subquery so that PostgreSQL inlines it where a batch's duplicates are answered in one join.
create function :GWL_SCHEMA.unique_job_blocks(j :GRAPHILE_WORKER_SCHEMA._private_jobs) returns boolean
language sql stable as $$
  select
    case
      when j.flags ? 'gwl:unique:queued' then j.locked_at is null and j.attempts = 0
      when j.flags ? 'gwl:unique:exists' then true
      -- active (also the rule for a keyed row without our flags): queued, running or waiting to retry
      else j.locked_at is not null or j.attempts < j.max_attempts
    end
    -- (silent: a row whose flags are not an object, such as the JSON value null, has no window)
    and coalesce(to_timestamp(substr(pg_catalog.jsonb_path_query_first(j.flags,
      '$.keyvalue() ? (@.key starts with "gwl:unique-until:").key', '{}', true) #>> '{}', 18)::float8)
      > now(), true)
$$;

-- The flags of a new unique job: the caller's (with its scope flag), plus the end of its window, if any.
create function :GWL_SCHEMA.unique_flags(p_flags jsonb, p_scope text, p_until timestamptz) returns jsonb
language sql immutable as $$
  select case when p_scope is null or p_until is null then p_flags
    else coalesce(p_flags, '{}'::jsonb)
      || jsonb_build_object('gwl:unique-until:' || extract(epoch from p_until)::text, true) end
$$;

-- Ensures the task and queue exist (as graphile-worker's add_job does) and returns their ids.
create function :GWL_SCHEMA.task_and_queue_ids(p_identifier text, p_queue_name text, out task_id int, out queue_id int)
language plpgsql volatile as $$
begin
  select t.id into task_id from :GRAPHILE_WORKER_SCHEMA._private_tasks t where t.identifier = p_identifier;
  if task_id is null then
    insert into :GRAPHILE_WORKER_SCHEMA._private_tasks (identifier) values (p_identifier) on conflict do nothing;
    select t.id into task_id from :GRAPHILE_WORKER_SCHEMA._private_tasks t where t.identifier = p_identifier;
  end if;
  if p_queue_name is not null then
    select q.id into queue_id from :GRAPHILE_WORKER_SCHEMA._private_job_queues q where q.queue_name = p_queue_name;
    if queue_id is null then
      insert into :GRAPHILE_WORKER_SCHEMA._private_job_queues (queue_name) values (p_queue_name) on conflict do nothing;
      select q.id into queue_id from :GRAPHILE_WORKER_SCHEMA._private_job_queues q where q.queue_name = p_queue_name;
    end if;
  end if;
end;
$$;

-- Replaces a duplicate's payload, run_at and priority, if it has not started. Null if it has.
create function :GWL_SCHEMA.replace_waiting_job(p_job_id bigint, p_payload json, p_run_at timestamptz, p_priority int)
returns :GRAPHILE_WORKER_SCHEMA._private_jobs
language plpgsql volatile as $$
declare
  v_job :GRAPHILE_WORKER_SCHEMA._private_jobs;
begin
  update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
    set payload = coalesce(p_payload, j.payload),
        run_at = coalesce(p_run_at, j.run_at),
        priority = coalesce(p_priority::smallint, j.priority),
        revision = j.revision + 1,
        updated_at = now()
    where j.id = p_job_id and j.locked_at is null and j.attempts = 0
    returning * into v_job;
  return v_job;
end;
$$;

-- Inserts a job of `s` (graphile-worker's defaults for what it leaves null) under task and queue ids, with
-- job key `p_key` and flags `p_flags`. Null when another job holds the key.
create function :GWL_SCHEMA.insert_job(s :GWL_SCHEMA.job_spec, p_task_id int, p_queue_id int, p_key text,
  p_flags jsonb)
returns :GRAPHILE_WORKER_SCHEMA._private_jobs
language plpgsql volatile as $$
declare
  v_job :GRAPHILE_WORKER_SCHEMA._private_jobs;
begin
  insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
    (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
  select p_queue_id, p_task_id, d.payload, d.run_at, d.max_attempts, p_key, d.priority, p_flags
  from :GWL_SCHEMA.job_defaults(s.payload, s.run_at, s.max_attempts, s.priority) d
  on conflict (key) do nothing
  returning * into v_job;
  return v_job;
end;
$$;

-- One enqueue, announced to the workers when `p_notify`, answered with its outcome, its job's task and its
-- job. Outcomes: added, duplicate (job = the existing job, or null when a window outlived it), replaced
-- (job = the existing job, updated). A duplicate writes nothing, and locks nothing: it is answered from the
-- existing job as last committed, without `for update`, because inside a caller's open transaction such a
-- lock would last until that transaction ends, and meanwhile graphile-worker could neither fetch the job
-- (its fetch skips locked rows) nor complete it. Only a job the enqueue changes is locked, by the update
-- that changes it: a job that no longer refuses the key gives it up in an update that checks again, on the
-- row as it is then, that it still does not refuse it. A window alone is read before it is claimed, so that
-- an unexpired window is answered without locking its row either.
create function :GWL_SCHEMA.enqueue_job(s :GWL_SCHEMA.job_spec, p_notify boolean,
  out outcome text, out task_identifier text, out job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_ids record;
  v_until timestamptz;
  v_window_job bigint;
  v_claimed text;
  v_replaced :GRAPHILE_WORKER_SCHEMA._private_jobs;
  v_tries int := 0;
begin
  select * into v_ids from :GWL_SCHEMA.task_and_queue_ids(s.identifier, s.queue_name);
  if s.window_seconds is not null then
    v_until := coalesce(s.run_at, now()) + s.window_seconds * interval '1 second';
  end if;

  loop
    v_tries := v_tries + 1;
    if v_tries > 20 then
      raise exception 'graphile-worker-locks: could not settle unique key % after 20 tries', s.unique_key;
    end if;

    if s.unique_key is null then
      -- uniqueness bypassed
      job := :GWL_SCHEMA.insert_job(s, v_ids.task_id, v_ids.queue_id, null, s.flags);
      outcome := 'added';
      exit;
    end if;

    if s.scope is null then
      -- A window alone: an unexpired window refuses the key; otherwise claim it in unique_windows, unless
      -- another enqueue claimed it meanwhile.
      select w.job_id into v_window_job from :GWL_SCHEMA.unique_windows w
        where w.unique_key = s.unique_key and w.expires_at > now();
      if not found then
        insert into :GWL_SCHEMA.unique_windows as w (unique_key, job_id, expires_at)
          values (s.unique_key, null, v_until)
          on conflict (unique_key) do update set job_id = null, expires_at = excluded.expires_at
            where w.expires_at <= now()
          returning w.unique_key into v_claimed;
        if not found then
          continue; -- claimed meanwhile: answer from that claim
        end if;
        job := :GWL_SCHEMA.insert_job(s, v_ids.task_id, v_ids.queue_id, null, s.flags);
        update :GWL_SCHEMA.unique_windows set job_id = job.id where unique_key = s.unique_key;
        outcome := 'added';
        exit;
      end if;
      select * into job from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_window_job;
      if not found then
        job := null;
      end if;
    else
      job := :GWL_SCHEMA.insert_job(s, v_ids.task_id, v_ids.queue_id, s.unique_key,
        :GWL_SCHEMA.unique_flags(s.flags, s.scope, v_until));
      if job.id is not null then
        outcome := 'added';
        exit;
      end if;
      select * into job from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.key = s.unique_key;
      if not found then
        continue; -- it completed, or its inserter rolled back: try again
      end if;
      if not :GWL_SCHEMA.unique_job_blocks(job) then
        -- Out of its scope: it keeps running or retrying, without the key (if it is still out of its scope
        -- as it is now; either way, try again).
        update :GRAPHILE_WORKER_SCHEMA._private_jobs j set key = null, updated_at = now()
          where j.id = job.id and j.key = s.unique_key and not :GWL_SCHEMA.unique_job_blocks(j);
        continue;
      end if;
    end if;

    -- A duplicate.
    outcome := 'duplicate';
    if s.on_duplicate = 'replace' and job.id is not null then
      v_replaced := :GWL_SCHEMA.replace_waiting_job(job.id, s.payload, s.run_at, s.priority);
      if v_replaced.id is not null then
        job := v_replaced;
        outcome := 'replaced';
      end if;
    end if;
    -- (the existing job may be another task's)
    select t.identifier into task_identifier from :GRAPHILE_WORKER_SCHEMA._private_tasks t
      where t.id = job.task_id;
    return;
  end loop;

  task_identifier := s.identifier;

  if p_notify then
    perform :GWL_SCHEMA.announce_jobs(1);
  end if;
end;
$$;

-- The ids of `p_names` in the graphile-worker table whose row type `p_row` has (_private_tasks by
-- identifier, _private_job_queues by queue_name), in the names' order. Missing names are created first, in
-- name order (C collation), so that two batches never create names in opposite orders and wait for each
-- other.
create function :GWL_SCHEMA.name_ids(p_row anyelement, p_column text, p_names text[]) returns int[]
language plpgsql volatile as $$
declare
  v_table regclass := (select c.oid from pg_catalog.pg_class c where c.reltype = pg_catalog.pg_typeof(p_row));
  v_ids int[];
begin
  execute format('insert into %s (%I) select u.n from unnest($1) as u(n)
      where not exists (select 1 from %s x where x.%I = u.n) order by u.n collate "C" on conflict do nothing',
    v_table, p_column, v_table, p_column) using p_names;
  execute format('select array(select x.id from unnest($1) with ordinality as u(n, i)
      join %s x on x.%I = u.n order by u.i)', v_table, p_column) into v_ids using p_names;
  return v_ids;
end;
$$;

-- A batch of enqueues in one statement. The caller sends the batch's distinct task identifiers and queue
-- names (p_tasks, p_queues), which the items (job_spec) name by place; marks the first scoped item of each
-- key (p_scoped_key_count of them); and names the items it adds waiting in line: for each, its place among
-- the items without a unique key (p_park_pos) and its lock key (p_park_keys).
--
-- The first scoped item of each key and every item without uniqueness go in one insert, and ids follow the
-- batch (graphile-worker runs jobs of equal priority and run_at by id). Whatever the batch can wait for
-- (new tasks and queues, keys another enqueue is inserting) it takes by name or key, so that two batches
-- never deadlock. An item added in line waits at its own place (its id), with its safety net as its run_at;
-- nothing of the batch is visible before it commits, so no worker can fetch the front of a line before the
-- line exists, and the front checks its key once it parks (wake_if_free), so a holder that released
-- meanwhile strands nobody. Duplicates that only need an answer (a scope, reject, and a holder that refuses
-- them) are answered in one join; the rest (in-batch duplicates, keys that meet existing jobs, windows
-- alone) go through enqueue_job one by one, by key (the items of one key in their order: the first of a key
-- wins). A duplicate whose on_duplicate is 'raise' aborts the whole batch with SQLSTATE GWLUQ (detail: the
-- existing job's id, hint: the item's place), so nothing of it is written.
--
-- The answer is one row per item, as enqueue_job answers: the item's place (from 1), its outcome, its job's
-- task and its job (a duplicate's holder, which may be another task's; null when a `uniqueFor` window
-- outlived it).
create function :GWL_SCHEMA.enqueue_jobs(p_items json, p_count int, p_scoped_key_count int,
  p_tasks text[], p_queues text[], p_park_pos int[], p_park_keys bigint[])
returns table (ord int, outcome text, task_identifier text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_task_ids int[];
  v_queue_ids int[];
  v_items :GWL_SCHEMA.job_spec[];
  v_ids bigint[];
  v_plain_ids bigint[];
  v_keys text[];
  v_parked int := 0;
  v_added int := 0;
  v_spec record;
  v_one record;
  v_done int[];
  v_done_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  -- the answer when not every item was simply added: for each item its place, outcome and job
  v_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_ords int[];
  v_outcomes text[];
  v_new_ids bigint[];
  v_seq regclass;
begin
  v_task_ids := :GWL_SCHEMA.name_ids(null:::GRAPHILE_WORKER_SCHEMA._private_tasks, 'identifier', p_tasks);
  if cardinality(p_queues) > 0 then
    v_queue_ids := :GWL_SCHEMA.name_ids(null:::GRAPHILE_WORKER_SCHEMA._private_job_queues, 'queue_name', p_queues);
  end if;
  -- The first scoped item of each key and every item without uniqueness, in one insert, ids following the
  -- items' order: the rows without a key, in id order, are the items without a unique key, in order. With
  -- two keys or more the rows go in by key (C collation), as every other step of the batch does, so that two
  -- batches never wait for each other's keys in opposite orders; their ids are drawn first then, one per
  -- item, ascending, and item n takes the n-th. Otherwise each row draws its id as it goes in, in the items'
  -- order.
  -- (the sequence found through the table's row type, which the placeholder gives as an identifier)
  v_seq := pg_catalog.pg_get_serial_sequence(
    (select c.oid from pg_catalog.pg_class c
      where c.reltype = pg_catalog.pg_typeof(null:::GRAPHILE_WORKER_SCHEMA._private_jobs))::regclass::text,
    'id')::regclass;
  if p_scoped_key_count > 1 then
    v_new_ids := array(select pg_catalog.nextval(v_seq) from generate_series(1, p_count) order by 1);
  end if;
  with inserted as (
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (id, job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    overriding system value
    select coalesce(v_new_ids[f.ordinality], pg_catalog.nextval(v_seq)), v_queue_ids[f.queue],
      v_task_ids[f.task], d.payload, d.run_at, d.max_attempts, f.unique_key, d.priority,
      case when f.window_seconds is null then f.flags
           else :GWL_SCHEMA.unique_flags(f.flags, f.scope, d.run_at + f.window_seconds * interval '1 second') end
    from json_populate_recordset(null:::GWL_SCHEMA.job_spec, p_items) with ordinality as f
    -- (an item added in line runs at its safety net)
    cross join lateral :GWL_SCHEMA.job_defaults(f.payload,
      coalesce(now() + f.park_ms * interval '1 millisecond', f.run_at), f.max_attempts, f.priority) d
    where f.unique_key is null or f.first
    order by case when p_scoped_key_count > 1 then f.unique_key end collate "C" nulls first, f.ordinality
    on conflict (key) do nothing
    returning j.id, j.key
  )
  select coalesce(array_agg(i.id order by i.id), '{}'),
    coalesce(array_agg(i.id order by i.id) filter (where i.key is null), '{}')
  into v_ids, v_plain_ids
  from inserted i;

  if p_park_pos is not null then
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      select u.k, v_plain_ids[u.p], now(), v_plain_ids[u.p]
      from unnest(p_park_pos, p_park_keys) as u(p, k);
    get diagnostics v_parked = row_count;
  end if;

  v_added := cardinality(v_ids);
  if v_added = p_count then
    -- The common case, every item a fresh key or none: its rows in its order, by primary key.
    return query select (row_number() over (order by j.id))::int, 'added'::text,
        p_tasks[array_position(v_task_ids, j.task_id)], j
      from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids) order by j.id;
    perform :GWL_SCHEMA.announce_jobs(v_added - v_parked);
    return;
  end if;

  -- The rest needs the items again.
  v_items := array(select json_populate_recordset(null:::GWL_SCHEMA.job_spec, p_items));
  -- The rows added so far, in id order: the items' order among those added, which are the items without a
  -- unique key and the first of each key that was free.
  v_jobs := array(select j from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids) order by j.id);
  v_keys := array(select x.key from unnest(v_jobs) as x where x.key is not null);
  v_ords := array(
    select s.ordinality::int from unnest(v_items) with ordinality as s
    where s.unique_key is null or (s.first and s.unique_key in (select unnest(v_keys)))
    order by s.ordinality);
  v_outcomes := array_fill('added'::text, array[cardinality(v_jobs)]);
  if cardinality(v_keys) = p_scoped_key_count then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  -- Duplicates that only need answering, set-based: items with a scope that ask to be rejected, whose key is
  -- held by a job that refuses them by its own rules; the rest goes one by one below.
  with answered as (
    select s.ordinality::int as ord, j as holder
    from unnest(v_items) with ordinality as s
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.key = s.unique_key
    where s.unique_key is not null and s.scope is not null and coalesce(s.on_duplicate, 'reject') = 'reject'
      and not (coalesce(s.first, false) and (v_keys is null or s.unique_key in (select unnest(v_keys))))
      and :GWL_SCHEMA.unique_job_blocks(j)
  )
  select coalesce(array_agg(a.ord), '{}'), coalesce(array_agg(a.holder), '{}')
    into v_done, v_done_jobs from answered a;
  v_jobs := v_jobs || v_done_jobs;
  v_ords := v_ords || v_done;
  v_outcomes := v_outcomes || array_fill('duplicate'::text, array[cardinality(v_done)]);

  for v_spec in
    select x.spec, x.ord
    from (
      select row(p_tasks[s.task], s.payload, p_queues[s.queue], s.run_at, s.max_attempts, s.priority, s.flags,
          s.unique_key, s.scope, s.window_seconds, coalesce(s.on_duplicate, 'reject'),
          coalesce(s.first, false), null, null, null):::GWL_SCHEMA.job_spec as spec,
        s.ordinality::int as ord, s.unique_key, coalesce(s.first, false) as first
      from unnest(v_items) with ordinality as s
    ) x
    -- every first-of-key item was inserted unless fewer rows came back than there are of them
    where x.unique_key is not null
      and not (x.first and (v_keys is null or x.unique_key in (select unnest(v_keys))))
      and not exists (select from unnest(v_done) as d(ord) where d.ord = x.ord)
    -- by key, as the insert above (the items of one key in their order: the first of a key wins)
    order by x.unique_key collate "C", x.ord
  loop
    select * into v_one from :GWL_SCHEMA.enqueue_job(v_spec.spec, false);
    if v_one.outcome = 'duplicate' and (v_spec.spec).on_duplicate = 'raise' then
      raise exception 'graphile-worker-locks: item % of the batch duplicates job %', v_spec.ord, (v_one.job).id
        using errcode = 'GWLUQ', detail = coalesce((v_one.job).id::text, ''), hint = v_spec.ord::text;
    end if;
    if v_one.outcome = 'added' then
      v_added := v_added + 1;
    end if;
    v_jobs := v_jobs || v_one.job;
    v_ords := v_ords || v_spec.ord;
    v_outcomes := v_outcomes || v_one.outcome;
  end loop;

  return query select v_ords[n], v_outcomes[n], t.identifier, v_jobs[n]
    from generate_subscripts(v_ords, 1) as n
    left join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.id = (v_jobs[n]).task_id;
  perform :GWL_SCHEMA.announce_jobs(v_added - v_parked);
end;
$$;


-- 7. Sweeps -----------------------------------------------------------------------------------------------

-- Waiters whose job no longer exists (it ran after its safety-net delay, or was removed), and old wakes.
create function :GWL_SCHEMA.sweep_waiters() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.waiters w
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = w.job_id)
    returning 1
  ), stale as (
    -- (a line locked right now is left for the next sweep: a sweep never waits for, or deadlocks with, it)
    delete from :GWL_SCHEMA.wakes k
    where k.lock_key in (
      select x.lock_key from :GWL_SCHEMA.wakes x where x.at < now() - interval '1 minute'
      for update skip locked
    ) and k.at < now() - interval '1 minute'
  )
  select count(*) from gone
$$;

create function :GWL_SCHEMA.sweep_prewakes() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.prewakes where at < now() - interval '1 minute' returning 1
  )
  select count(*) from gone
$$;

-- Removes expired windows; returns how many. A window an enqueue is claiming right now is left for the
-- next sweep (which it renews anyway), so that a sweep never waits for, or deadlocks with, an enqueue.
create function :GWL_SCHEMA.sweep_unique_windows() returns bigint
language sql volatile as $$
  with gone as (
    delete from :GWL_SCHEMA.unique_windows w
    where w.unique_key in (
      select x.unique_key from :GWL_SCHEMA.unique_windows x
      where x.expires_at <= now()
      for update skip locked
    ) and w.expires_at <= now()
    returning 1
  )
  select count(*) from gone
$$;
