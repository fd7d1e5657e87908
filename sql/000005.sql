-- graphile-worker-locks, migration 5: a bulk enqueue answers its plain duplicates set-based.
--
-- add_unique_jobs (migration 2) inserted fresh keys set-based but answered every duplicate one by one, in
-- a loop of add_unique_job_one: a batch of duplicates ran about a quarter as fast as a batch of new jobs.
-- Now the duplicates that need nothing but an answer (a scope, `reject`, and a holder that refuses them)
-- are found in one join on the job key; the loop keeps the rest.

create or replace function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[])
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

  if v_added > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_added::text || '}');
  end if;
end;
$$;
