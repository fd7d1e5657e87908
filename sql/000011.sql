-- graphile-worker-locks, migration 11: a bulk enqueue answers with graphile-worker's job rows as they are.
--
-- add_unique_jobs answers with (ord, outcome, job) triples, and the caller spreads each job into its columns
-- (`(r.job).*`). PostgreSQL takes that composite apart one column at a time: for 1,000 fresh items, about 2 ms
-- of a 25 ms statement, and three more columns per row for the caller to read. add_unique_jobs_flat does the
-- same work and answers with rows of graphile-worker's job table itself (`select * from` it, as
-- graphile-worker's own add_jobs is called):
--
-- - When every item was added (the common case), one row per item, in the items' order: ids are drawn in
--   that order, so the rows are read back ordered by id.
-- - Otherwise the rows of the outcomes come in the order the function found them, and a trailing row with a
--   null id (no job has one) carries, in its payload, what the caller needs to place them:
--   {"ord": [...], "outcome": [...], "task": [...]}, one entry per row before it. An ord is the item's place
--   (from 1), or null for an item added set-based as the first of its unique key (the caller knows it by its
--   key); a duplicate whose holder a `uniqueFor` window outlived comes as a row of nulls.
--
-- Its items waiting in line are named by the caller: p_park_keys has a lock key only for an item to add in
-- line, null for the others (a key's front included), and the window function that found them goes. The
-- seven-argument add_unique_jobs, which a process of the previous version calls, keeps its answers and its
-- meaning (every item of a line has its key there, the front included): it is now this function, its answer
-- turned back into triples, so that the live schema has one body. Its five-argument form (migration 8) calls
-- it, unchanged.

create function :GWL_SCHEMA.add_unique_jobs_flat(p_specs json, p_count int, p_first int, p_tasks text[],
  p_queues text[], p_park_keys bigint[], p_park_ms float8[])
returns setof :GRAPHILE_WORKER_SCHEMA._private_jobs
language plpgsql volatile as $$
declare
  v_specs :GWL_SCHEMA.unique_job_spec[];
  v_plain_ords int[];
  v_plain_parked boolean[];
  v_parked int := 0;
  v_plain_ids bigint[];
  v_ids bigint[];
  v_keys text[];
  v_spec record;
  v_one record;
  v_added int := 0;
  v_done int[];
  v_done_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  -- the answer when not every item was simply added: rows, and for each its ord and outcome
  v_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_ords int[];
  v_outcomes text[];
  v_trailer :GRAPHILE_WORKER_SCHEMA._private_jobs;
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
  -- The first scoped item of each key and every item without uniqueness, in one insert, in the items'
  -- order (migration 10): the plain items' rows in id order are the plain items in order.
  with items as materialized (
    select s.*, s.ordinality::int as ord,
      s.unique_key is null and p_park_keys[s.ordinality::int] is not null as parked
    from json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs) with ordinality as s
  ), inserted as (
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    select q.id, t.id, coalesce(f.payload, '{}'::json),
      -- an item waiting in line: its run_at is its safety net
      case when f.parked then now() + p_park_ms[f.ord] * interval '1 millisecond'
           else coalesce(f.run_at, now()) end,
      coalesce(f.max_attempts, 25), f.unique_key, coalesce(f.priority, 0),
      case when f.window_seconds is null then f.flags
           else :GWL_SCHEMA.unique_flags(f.flags, f.scope,
             coalesce(f.run_at, now()) + f.window_seconds * interval '1 second') end
    from items f
    join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = f.identifier
    left join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = f.queue_name
    where f.unique_key is null or f.first
    order by f.ord
    on conflict (key) do nothing
    returning j.id, j.key
  )
  select
    coalesce((select array_agg(i.id) from inserted i where i.key is not null), '{}'),
    coalesce((select array_agg(i.key) from inserted i where i.key is not null), '{}'),
    coalesce((select array_agg(i.id order by i.id) from inserted i where i.key is null), '{}'),
    coalesce((select array_agg(f.ord order by f.ord) from items f where f.unique_key is null), '{}'),
    coalesce((select array_agg(f.parked order by f.ord) from items f where f.unique_key is null), '{}')
  into v_ids, v_keys, v_plain_ids, v_plain_ords, v_plain_parked;

  if cardinality(v_plain_ids) > 0 then
    -- each parked job waits at its own place: its id, the enqueue order
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      select p_park_keys[v_plain_ords[n]], v_plain_ids[n], now(), v_plain_ids[n]
      from generate_subscripts(v_plain_ids, 1) as n
      where v_plain_parked[n];
    get diagnostics v_parked = row_count;
  end if;

  v_added := cardinality(v_ids) + cardinality(v_plain_ids);
  if v_added = p_count then
    -- The common case, every item a fresh key or none: its rows in its order, by primary key.
    return query select j.* from :GRAPHILE_WORKER_SCHEMA._private_jobs j
      where j.id = any(v_ids || v_plain_ids) order by j.id;
    if v_added > v_parked then
      perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
    end if;
    return;
  end if;

  -- The rows added set-based (found by their keys), then the plain ones (the n-th by id is the n-th plain item).
  v_jobs := array(select j from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids) order by j.id);
  v_ords := array_fill(null::int, array[cardinality(v_jobs)]) || v_plain_ords;
  v_jobs := v_jobs || array(select j from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_plain_ids) order by j.id);
  v_outcomes := array_fill('added'::text, array[cardinality(v_jobs)]);

  -- The rest needs the items again.
  v_specs := array(select json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs));
  if cardinality(v_ids) = p_first then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  -- Duplicates that only need answering, set-based (migration 10): items with a scope that ask to be
  -- rejected, whose key is held by a job that refuses them by its own rules; the rest goes one by one below.
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
  v_jobs := v_jobs || v_done_jobs;
  v_ords := v_ords || v_done;
  v_outcomes := v_outcomes || array_fill('duplicate'::text, array[cardinality(v_done)]);

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
    v_jobs := v_jobs || v_one.job;
    v_ords := v_ords || v_spec.ord;
    v_outcomes := v_outcomes || v_one.outcome;
  end loop;

  return query select * from unnest(v_jobs);
  -- (a row of graphile-worker's table whose id is null: the caller cannot take it for a job)
  v_trailer.payload := json_build_object('ord', v_ords, 'outcome', v_outcomes, 'task', array(
    select t.identifier from generate_subscripts(v_jobs, 1) as n
    left join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.id = (v_jobs[n]).task_id
    order by n));
  return next v_trailer;

  if v_added > v_parked then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
  end if;
end;
$$;

-- The previous version's call: every item of a line names its key (the front included), and the answer is
-- (ord, outcome, job) triples.
create or replace function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[],
  p_park_keys bigint[], p_park_ms float8[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_last int;
  v_trailer json;
begin
  v_jobs := array(select f from :GWL_SCHEMA.add_unique_jobs_flat(p_specs, p_count, p_first, p_tasks, p_queues,
    -- the front of each key (its first item) is not in line
    case when p_park_keys is not null then array(
      select case when row_number() over (partition by k order by n) > 1 then k end
      from unnest(p_park_keys) with ordinality as u(k, n)
      order by n) end,
    p_park_ms) f);
  v_last := cardinality(v_jobs);
  if v_last = 0 or (v_jobs[v_last]).id is not null then
    return query select n, 'added'::text, v_jobs[n] from generate_subscripts(v_jobs, 1) as n;
    return;
  end if;
  v_trailer := (v_jobs[v_last]).payload;
  return query
    select (v_trailer -> 'ord' ->> (n - 1))::int, v_trailer -> 'outcome' ->> (n - 1),
      case when (v_jobs[n]).id is null then null else v_jobs[n] end
    from generate_subscripts(v_jobs, 1) as n
    where n < v_last;
end;
$$;
