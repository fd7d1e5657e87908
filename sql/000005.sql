-- graphile-worker-locks, migration 5: a cheaper bulk enqueue. The caller passes the batch's distinct task
-- identifiers and queue names, the specs are parsed from JSON once instead of three times, and items without
-- uniqueness are inserted set-based as well.

drop function :GWL_SCHEMA.add_unique_jobs(json, int, int);

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


-- A woken waiter goes ahead of the jobs that were queued with it: graphile-worker fetches by priority, then
-- run_at, then id, so a copy (a newer id) woken back to its old run_at would still lose every tie against
-- jobs inserted in the same batch, which then meet the key first and park in turn.
create or replace function :GWL_SCHEMA.wake_waiters(p_keys bigint[]) returns int
language plpgsql volatile as $$
declare
  v_key bigint;
  v_waiter record;
  v_woken int := 0;
begin
  if p_keys is null or cardinality(p_keys) = 0 then
    return 0;
  end if;
  foreach v_key in array p_keys loop
    loop
      delete from :GWL_SCHEMA.waiters w
        where w.id = (
          select x.id from :GWL_SCHEMA.waiters x
          where x.lock_key = v_key
          order by x.id
          limit 1
          for update skip locked
        )
        returning w.job_id, w.run_at into v_waiter;
      exit when not found;
      update :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now()) - interval '1 millisecond'
        where j.id = v_waiter.job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
        exit;
      end if;
      -- that job is gone or already running: try the next waiter
    end loop;
  end loop;
  if v_woken > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_woken::text || '}');
  end if;
  return v_woken;
end;
$$;
