-- graphile-worker-locks, migration 2: unique jobs.
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
-- A window alone (`uniqueFor` without a scope) must outlive its job, so it is a row of `unique_windows`,
-- removed once expired (by `sweep_unique_windows`, and reused by the next claim of the same key).
--
-- Requires graphile-worker's schema (its job tables are read and written here; tested against each
-- supported graphile-worker version).

create table :GWL_SCHEMA.unique_windows (
  unique_key text primary key,
  job_id bigint,
  expires_at timestamptz not null
);
create index unique_windows_expires_at on :GWL_SCHEMA.unique_windows (expires_at);

create type :GWL_SCHEMA.unique_job_spec as (
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
  on_duplicate text,
  -- bulk only: whether this is the batch's first scoped item of its key (the caller knows; saves a sort)
  first boolean
);

-- Whether an existing job still refuses a duplicate, by its own scope and window.
create function :GWL_SCHEMA.unique_job_blocks(j :GRAPHILE_WORKER_SCHEMA._private_jobs) returns boolean
language sql stable as $$
  select
    case
      when j.flags ? 'gwl:unique:queued' then j.locked_at is null and j.attempts = 0
      when j.flags ? 'gwl:unique:exists' then true
      -- active (also the rule for a keyed row without our flags): queued, running or waiting to retry
      else j.locked_at is not null or j.attempts < j.max_attempts
    end
    and coalesce((
      select to_timestamp(substr(f, 18)::float8) > now()
      from jsonb_object_keys(coalesce(j.flags, '{}'::jsonb)) as f
      where f like 'gwl:unique-until:%'
      limit 1
    ), true)
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

-- One enqueue. Outcomes: added, duplicate (job = the existing job, or null when a window outlived it),
-- replaced (job = the existing job, updated). A duplicate writes nothing.
create function :GWL_SCHEMA.add_unique_job_one(s :GWL_SCHEMA.unique_job_spec, p_notify boolean,
  out outcome text, out job :GRAPHILE_WORKER_SCHEMA._private_jobs)
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
      insert into :GRAPHILE_WORKER_SCHEMA._private_jobs
        (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
        coalesce(s.max_attempts, 25), null, coalesce(s.priority, 0), s.flags)
      returning * into job;
      outcome := 'added';
      exit;
    end if;

    if s.scope is null then
      -- A window alone: claim the key in unique_windows unless an unexpired window holds it.
      insert into :GWL_SCHEMA.unique_windows as w (unique_key, job_id, expires_at)
        values (s.unique_key, null, v_until)
        on conflict (unique_key) do update set job_id = null, expires_at = excluded.expires_at
          where w.expires_at <= now()
        returning w.unique_key into v_claimed;
      if found then
        insert into :GRAPHILE_WORKER_SCHEMA._private_jobs
          (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
        values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
          coalesce(s.max_attempts, 25), null, coalesce(s.priority, 0), s.flags)
        returning * into job;
        update :GWL_SCHEMA.unique_windows set job_id = job.id where unique_key = s.unique_key;
        outcome := 'added';
        exit;
      end if;
      select w.job_id into v_window_job from :GWL_SCHEMA.unique_windows w
        where w.unique_key = s.unique_key and w.expires_at > now();
      if not found then
        continue; -- expired or removed meanwhile
      end if;
      select * into job from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_window_job for update;
      if not found then
        job := null;
      end if;
    else
      insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
        coalesce(s.max_attempts, 25), s.unique_key, coalesce(s.priority, 0),
        :GWL_SCHEMA.unique_flags(s.flags, s.scope, v_until))
      on conflict (key) do nothing
      returning * into job;
      if found then
        outcome := 'added';
        exit;
      end if;
      select * into job from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.key = s.unique_key for update;
      if not found then
        continue; -- it completed, or its inserter rolled back: try again
      end if;
      if not :GWL_SCHEMA.unique_job_blocks(job) then
        -- Out of its scope: it keeps running or retrying, without the key.
        update :GRAPHILE_WORKER_SCHEMA._private_jobs j set key = null, updated_at = now() where j.id = job.id;
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
    return;
  end loop;

  if p_notify then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":1}');
  end if;
end;
$$;

create function :GWL_SCHEMA.add_unique_job(s :GWL_SCHEMA.unique_job_spec,
  out outcome text, out job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language sql volatile as $$
  select * from :GWL_SCHEMA.add_unique_job_one(s, true)
$$;

-- Bulk enqueue in one statement: fresh keys and items without uniqueness are inserted set-based; in-batch
-- duplicates (the first of a key wins), keys that meet existing jobs and windows alone go through
-- add_unique_job_one in input order. The caller passes the batch's distinct task identifiers and queue
-- names, and marks the first item of each key. Rows of the set-based part come back with a null ord (the caller maps them by job key to
-- the first item of that key); the others with their 1-based position. A duplicate whose on_duplicate is
-- 'raise' aborts the whole batch with SQLSTATE GWLUQ (detail: the existing job's id, hint: the item's
-- position), so nothing of the batch is written.
create function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_specs :GWL_SCHEMA.unique_job_spec[];
  v_plain_ords int[];
  v_plain_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_ids bigint[];
  v_keys text[];
  v_spec record;
  v_one record;
  v_added int := 0;
begin
  -- The caller sends the distinct task identifiers and queue names; the specs are parsed once.
  insert into :GRAPHILE_WORKER_SCHEMA._private_tasks (identifier)
    select t.identifier from unnest(p_tasks) as t(identifier)
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_tasks x where x.identifier = t.identifier)
    on conflict do nothing;
  if cardinality(p_queues) > 0 then
    insert into :GRAPHILE_WORKER_SCHEMA._private_job_queues (queue_name)
      select q.queue_name from unnest(p_queues) as q(queue_name)
      where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_job_queues x where x.queue_name = q.queue_name)
      on conflict do nothing;
  end if;
  with first_of_key as (
    select s.*
    from json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs) with ordinality as s
    where s.first
  ), inserted as (
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    select q.id, t.id, coalesce(f.payload, '{}'::json), coalesce(f.run_at, now()), coalesce(f.max_attempts, 25),
      f.unique_key, coalesce(f.priority, 0),
      case when f.window_seconds is null then f.flags
           else :GWL_SCHEMA.unique_flags(f.flags, f.scope,
             coalesce(f.run_at, now()) + f.window_seconds * interval '1 second') end
    from first_of_key f
    join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = f.identifier
    left join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = f.queue_name
    order by f.ordinality
    on conflict (key) do nothing
    returning j.id, j.key
  )
  select coalesce(array_agg(i.id), '{}'), coalesce(array_agg(i.key), '{}') into v_ids, v_keys from inserted i;

  v_added := cardinality(v_ids);
  -- (ids and keys only: arrays of whole rows cost more than reading them back by primary key)
  return query select null::int, 'added'::text, j
    from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids);

  if v_added = p_count then
    -- the common case: every item was a fresh key
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_added::text || '}');
    return;
  end if;
  -- The rest needs the items again.
  v_specs := array(select json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs));

  -- Items without uniqueness, set-based too; rows come back in insertion order, which follows the items'.
  v_plain_ords := array(
    select s.ordinality::int from unnest(v_specs) with ordinality as s
    where s.unique_key is null order by s.ordinality);
  if cardinality(v_plain_ords) > 0 then
    with inserted as (
      insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      select q.id, t.id, coalesce(f.payload, '{}'::json), coalesce(f.run_at, now()), coalesce(f.max_attempts, 25),
        null, coalesce(f.priority, 0), f.flags
      from unnest(v_specs) with ordinality as f
      join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = f.identifier
      left join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = f.queue_name
      where f.unique_key is null
      order by f.ordinality
      returning j.*
    )
    select coalesce(array_agg(i), '{}') into v_plain_jobs from inserted i;
    return query select v_plain_ords[n], 'added'::text, v_plain_jobs[n] from generate_subscripts(v_plain_jobs, 1) as n;
    v_added := v_added + cardinality(v_plain_jobs);
  end if;

  if v_added = p_count then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_added::text || '}');
    return;
  end if;
  if cardinality(v_ids) = p_first then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  for v_spec in
    select x.spec, x.ord
    from (
      select row(s.identifier, s.payload, s.queue_name, s.run_at, s.max_attempts, s.priority, s.flags,
          s.unique_key, s.scope, s.window_seconds, s.on_duplicate, s.first):::GWL_SCHEMA.unique_job_spec as spec,
        s.ordinality::int as ord, s.unique_key, s.first
      from unnest(v_specs) with ordinality as s
    ) x
    -- every first-of-key item was inserted unless fewer rows came back than there are of them
    where x.unique_key is not null
      and not (x.first and (v_keys is null or x.unique_key in (select unnest(v_keys))))
    order by x.ord
  loop
    select * into v_one from :GWL_SCHEMA.add_unique_job_one(v_spec.spec, false);
    if v_one.outcome = 'duplicate' and (v_spec.spec).on_duplicate = 'raise' then
      raise exception 'graphile-worker-locks: item % of the batch duplicates job %', v_spec.ord, (v_one.job).id
        using errcode = 'GWLUQ', detail = coalesce((v_one.job).id::text, ''), hint = v_spec.ord::text;
    end if;
    if v_one.outcome = 'added' then
      v_added := v_added + 1;
    end if;
    ord := v_spec.ord;
    outcome := v_one.outcome;
    job := v_one.job;
    return next;
  end loop;

  if v_added > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_added::text || '}');
  end if;
end;
$$;

-- Removes expired windows; returns how many.
create function :GWL_SCHEMA.sweep_unique_windows() returns bigint
language sql volatile as $$
  with gone as (delete from :GWL_SCHEMA.unique_windows where expires_at <= now() returning 1)
  select count(*) from gone
$$;
