-- graphile-worker-locks, migration 8: a bulk enqueue puts the jobs of a `reschedule` key in line at once.
--
-- A bulk enqueue of many jobs of one `reschedule` key made them all runnable: every one was fetched only to
-- find its key held (or not its turn) and park, at the cost of a fetch, a lock attempt, a park and a
-- completion each, and of a worker's time. With 2,000 jobs over 10 keys the workers spent more than half the
-- run parking, and a woken job went to whichever worker of any process fetched next.
--
-- Now the caller can name an item's lock key (p_park_keys, aligned with the items; the library names it for
-- jobs of a `reschedule` task without a unique key or a run_at of their own). The first item of each named
-- key in the batch (its front) is added as usual; the others are added already waiting in line, in the same
-- statement: their run_at is their safety net (p_park_ms from now), and each has a waiter row at its place,
-- its own id, as a parked job has. The five-argument form (migration 5) names no key: it is this function
-- with none, so that a process of the previous version keeps working.
--
-- Why this is safe:
-- - Nothing of the batch is visible before it commits, so no worker can fetch a job before the line behind
--   its key's front exists.
-- - The front is a job like any other: fetched, it takes the key (no waiter is ahead of it: theirs are later
--   ids) and its release wakes the next, or it finds the key held or another line ahead and parks in its
--   place (its own id, ahead of the jobs parked behind it), then checks the key once its park committed
--   (wake_if_free). So a line that was already there, or a holder that released while this statement ran,
--   cannot leave the new waiters stranded: the front looks at the key after they are visible.
-- - Should the front never run (removed), the others are fetched by their safety net (all due at once: free
--   workers race for the key as first fetches do, and the rest park again in their places).

create function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[],
  p_park_keys bigint[], p_park_ms float8[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_specs :GWL_SCHEMA.unique_job_spec[];
  v_plain_ords int[];
  v_plain_parked boolean[];
  v_parked int := 0;
  v_plain_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_ids bigint[];
  v_keys text[];
  v_spec record;
  v_one record;
  v_added int := 0;
  v_done int[];
  v_done_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
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
  -- An item whose lock key is named, after the first of that key in the batch, is added waiting in line.
  select coalesce(array_agg(p.ord order by p.ord), '{}'), coalesce(array_agg(p.parked order by p.ord), '{}')
    into v_plain_ords, v_plain_parked
    from (
      select s.ordinality::int as ord,
        p_park_keys[s.ordinality::int] is not null
          and row_number() over (partition by p_park_keys[s.ordinality::int] order by s.ordinality) > 1 as parked
      from unnest(v_specs) with ordinality as s
      where s.unique_key is null
    ) p;
  if cardinality(v_plain_ords) > 0 then
    with inserted as (
      insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      select q.id, t.id, coalesce(f.payload, '{}'::json),
        case when v_plain_parked[f.n::int] then now() + p_park_ms[f.ordinality::int] * interval '1 millisecond'
             else coalesce(f.run_at, now()) end,
        coalesce(f.max_attempts, 25), null, coalesce(f.priority, 0), f.flags
      from (
        -- (n: the item's place among those without uniqueness, as in v_plain_ords and v_plain_parked)
        select s.*, row_number() over (order by s.ordinality) as n
        from unnest(v_specs) with ordinality as s
        where s.unique_key is null
      ) f
      join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = f.identifier
      left join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = f.queue_name
      order by f.ordinality
      returning j.*
    )
    select coalesce(array_agg(i), '{}') into v_plain_jobs from inserted i;
    -- each parked job waits at its own place: its id, the enqueue order
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      select p_park_keys[v_plain_ords[x.ordinality::int]], x.id, now(), x.id
      from unnest(v_plain_jobs) with ordinality as x
      where v_plain_parked[x.ordinality::int];
    get diagnostics v_parked = row_count;
    return query select v_plain_ords[n], 'added'::text, v_plain_jobs[n] from generate_subscripts(v_plain_jobs, 1) as n;
    v_added := v_added + cardinality(v_plain_jobs);
  end if;

  if v_added = p_count then
    if v_added > v_parked then
      perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
    end if;
    return;
  end if;
  if cardinality(v_ids) = p_first then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  -- Duplicates that only need answering, set-based: items with a scope that ask to be rejected, whose key
  -- is held by a job (an existing one, or one this batch just added) that refuses them by its own rules.
  -- Read without a row lock, as a single enqueue's answer would be the same a moment later; whatever is
  -- left (out-of-scope holders to take the key from, vanished ones, windows, replace, raise) goes one by
  -- one below.
  with answered as (
    select s.ordinality::int as ord, j as holder
    from unnest(v_specs) with ordinality as s
    join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.key = s.unique_key
    where s.unique_key is not null and s.scope is not null and s.on_duplicate = 'reject'
      and not (s.first and (v_keys is null or s.unique_key = any(v_keys)))
      and :GWL_SCHEMA.unique_job_blocks(j)
  )
  select coalesce(array_agg(a.ord), '{}'), coalesce(array_agg(a.holder), '{}')
    into v_done, v_done_jobs from answered a;
  return query select v_done[n], 'duplicate'::text, v_done_jobs[n] from generate_subscripts(v_done, 1) as n;

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
      and x.ord <> all(v_done)
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

  if v_added > v_parked then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
  end if;
end;
$$;

create or replace function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language sql volatile as $$
  select * from :GWL_SCHEMA.add_unique_jobs(p_specs, p_count, p_first, p_tasks, p_queues, null, null)
$$;
