-- graphile-worker-locks, migration 11: a bulk enqueue answers with graphile-worker's job rows as they are,
-- from a batch that names its tasks and queues by their place.
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
--   {"ord": [...], "outcome": [...], "task": [...]}, one entry per row before it: the item's place (from 1),
--   its outcome, and the task of the row's job (a duplicate's holder may be another task's). A duplicate
--   whose holder a `uniqueFor` window outlived comes as a row of nulls.
--
-- Its items (bulk_job_spec) are lighter to write and to parse: an item names its task and queue by their
-- place in p_tasks and p_queues (the batch's distinct names, which the caller sends anyway), so the insert
-- reads their ids from two small arrays instead of joining the batch to both tables and sorting it again;
-- `on_duplicate` and `first` may be left out (reject, false). An item the caller adds waiting in line names
-- its safety net (`park_ms`), and p_park_pos / p_park_keys name, for each such item, its place among the
-- batch's items without a unique key and its lock key: the function no longer finds the lines itself, and
-- needs no second pass over the items when every item was added.
--
-- A batch of duplicates is answered faster too: unique_job_blocks, the check of each holder, is written without
-- a subquery so that PostgreSQL inlines it (it ran a function executor per row), and the items left for one
-- by one are found with a join on what was answered instead of comparing each item with every answer.
--
-- The seven-argument add_unique_jobs, which a process of the previous version calls, keeps its arguments,
-- its answers and its meaning: it is now this function, its items turned into this form and its answer
-- turned back into triples, so that the live schema has one body. Its five-argument form (migration 8)
-- calls it, unchanged.

create type :GWL_SCHEMA.bulk_job_spec as (
  -- its task and queue: their places in p_tasks and p_queues (from 1); no queue: null
  task int,
  queue int,
  payload json,
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
  -- whether this is the batch's first scoped item of its key; null: false
  first boolean,
  -- an item added waiting in line: its run_at, in milliseconds from now (its safety net)
  park_ms float8
);

-- Whether an existing job still refuses a duplicate (migration 2), now without a subquery: PostgreSQL inlines
-- a SQL function only if its body has none, and called once per row (a bulk enqueue's duplicates are answered
-- in one join) the function's own executor cost more than the check. The window's end is found with a
-- JSON path instead of a scan of the flags' keys; the answer is the same.
create or replace function :GWL_SCHEMA.unique_job_blocks(j :GRAPHILE_WORKER_SCHEMA._private_jobs) returns boolean
language sql stable as $$
  select
    case
      when j.flags ? 'gwl:unique:queued' then j.locked_at is null and j.attempts = 0
      when j.flags ? 'gwl:unique:exists' then true
      -- active (also the rule for a keyed row without our flags): queued, running or waiting to retry
      else j.locked_at is not null or j.attempts < j.max_attempts
    end
    and coalesce(to_timestamp(substr(pg_catalog.jsonb_path_query_first(j.flags,
      '$.keyvalue() ? (@.key starts with "gwl:unique-until:").key') #>> '{}', 18)::float8) > now(), true)
$$;

create function :GWL_SCHEMA.add_unique_jobs_flat(p_specs json, p_count int, p_first int, p_tasks text[],
  p_queues text[], p_park_pos int[], p_park_keys bigint[])
returns setof :GRAPHILE_WORKER_SCHEMA._private_jobs
language plpgsql volatile as $$
declare
  v_task_ids int[];
  v_queue_ids int[];
  v_specs :GWL_SCHEMA.bulk_job_spec[];
  v_ids bigint[];
  v_plain_ids bigint[];
  v_keys text[];
  v_parked int := 0;
  v_added int := 0;
  v_spec record;
  v_one record;
  v_done int[];
  v_done_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  -- the answer when not every item was simply added: rows, and for each its item's place and outcome
  v_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_ords int[];
  v_outcomes text[];
  v_trailer :GRAPHILE_WORKER_SCHEMA._private_jobs;
begin
  insert into :GRAPHILE_WORKER_SCHEMA._private_tasks (identifier)
    select t.identifier from unnest(p_tasks) as t(identifier)
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_tasks x where x.identifier = t.identifier)
    on conflict do nothing;
  v_task_ids := array(
    select t.id from unnest(p_tasks) with ordinality as u(identifier, n)
    join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = u.identifier
    order by u.n);
  if cardinality(p_queues) > 0 then
    insert into :GRAPHILE_WORKER_SCHEMA._private_job_queues (queue_name)
      select q.queue_name from unnest(p_queues) as q(queue_name)
      where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_job_queues x where x.queue_name = q.queue_name)
      on conflict do nothing;
    v_queue_ids := array(
      select q.id from unnest(p_queues) with ordinality as u(queue_name, n)
      join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = u.queue_name
      order by u.n);
  end if;
  -- The first scoped item of each key and every item without uniqueness, in one insert, in the items'
  -- order (migration 10): ids follow the batch, and the rows without a key in id order are the items
  -- without a unique key in order.
  with inserted as (
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    select v_queue_ids[f.queue], v_task_ids[f.task], coalesce(f.payload, '{}'::json),
      case when f.park_ms is not null then now() + f.park_ms * interval '1 millisecond'
           else coalesce(f.run_at, now()) end,
      coalesce(f.max_attempts, 25), f.unique_key, coalesce(f.priority, 0),
      case when f.window_seconds is null then f.flags
           else :GWL_SCHEMA.unique_flags(f.flags, f.scope,
             coalesce(f.run_at, now()) + f.window_seconds * interval '1 second') end
    from json_populate_recordset(null:::GWL_SCHEMA.bulk_job_spec, p_specs) with ordinality as f
    where f.unique_key is null or f.first
    order by f.ordinality
    on conflict (key) do nothing
    returning j.id, j.key
  )
  select coalesce(array_agg(i.id order by i.id), '{}'),
    coalesce(array_agg(i.id order by i.id) filter (where i.key is null), '{}')
  into v_ids, v_plain_ids
  from inserted i;

  if p_park_pos is not null then
    -- each job added in line waits at its own place: its id, the enqueue order (migration 8)
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      select u.k, v_plain_ids[u.p], now(), v_plain_ids[u.p]
      from unnest(p_park_pos, p_park_keys) as u(p, k);
    get diagnostics v_parked = row_count;
  end if;

  v_added := cardinality(v_ids);
  if v_added = p_count then
    -- The common case, every item a fresh key or none: its rows in its order, by primary key.
    return query select j.* from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids) order by j.id;
    if v_added > v_parked then
      perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
    end if;
    return;
  end if;

  -- The rest needs the items again.
  v_specs := array(select json_populate_recordset(null:::GWL_SCHEMA.bulk_job_spec, p_specs));
  -- The rows added so far, in id order: the items' order among those added, which are the items without a
  -- unique key and the first of each key that was free.
  v_jobs := array(select j from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids) order by j.id);
  v_keys := array(select x.key from unnest(v_jobs) as x where x.key is not null);
  v_ords := array(
    select s.ordinality::int from unnest(v_specs) with ordinality as s
    where s.unique_key is null or (s.first and s.unique_key in (select unnest(v_keys)))
    order by s.ordinality);
  v_outcomes := array_fill('added'::text, array[cardinality(v_jobs)]);
  if cardinality(v_keys) = p_first then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  -- Duplicates that only need answering, set-based (migration 10): items with a scope that ask to be
  -- rejected, whose key is held by a job that refuses them by its own rules; the rest goes one by one below.
  with answered as (
    select s.ordinality::int as ord, j as holder
    from unnest(v_specs) with ordinality as s
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
          coalesce(s.first, false)):::GWL_SCHEMA.unique_job_spec as spec,
        s.ordinality::int as ord, s.unique_key, coalesce(s.first, false) as first
      from unnest(v_specs) with ordinality as s
    ) x
    -- every first-of-key item was inserted unless fewer rows came back than there are of them
    where x.unique_key is not null
      and not (x.first and (v_keys is null or x.unique_key in (select unnest(v_keys))))
      and not exists (select from unnest(v_done) as d(ord) where d.ord = x.ord)
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

-- The previous version's call: items name their task and queue, every item of a line names its key (the
-- front included), and the answer is (ord, outcome, job) triples.
create or replace function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[],
  p_park_keys bigint[], p_park_ms float8[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_specs json;
  v_park_pos int[];
  v_park_keys bigint[];
  v_jobs :GRAPHILE_WORKER_SCHEMA._private_jobs[];
  v_last int;
  v_trailer json;
begin
  with s as (
    select s.*, s.ordinality::int as n,
      -- in line: an item without a unique key after the first of its key (migration 10)
      s.unique_key is null and p_park_keys[s.ordinality::int] is not null
        and row_number() over (
          partition by case when s.unique_key is null then p_park_keys[s.ordinality::int] end
          order by s.ordinality) > 1 as parked
    from json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs) with ordinality as s
  ), p as (
    select s.*, row_number() over (partition by s.unique_key is null order by s.n)::int as plain_pos from s
  )
  select json_agg(json_build_object('task', array_position(p_tasks, p.identifier),
        'queue', array_position(p_queues, p.queue_name), 'payload', p.payload, 'run_at', p.run_at,
        'max_attempts', p.max_attempts, 'priority', p.priority, 'flags', p.flags, 'unique_key', p.unique_key,
        'scope', p.scope, 'window_seconds', p.window_seconds, 'on_duplicate', p.on_duplicate, 'first', p.first,
        'park_ms', case when p.parked then p_park_ms[p.n] end) order by p.n),
    array_agg(p.plain_pos order by p.n) filter (where p.parked),
    array_agg(p_park_keys[p.n] order by p.n) filter (where p.parked)
  into v_specs, v_park_pos, v_park_keys
  from p;
  v_jobs := array(select f from :GWL_SCHEMA.add_unique_jobs_flat(coalesce(v_specs, '[]'), p_count, p_first,
    p_tasks, p_queues, v_park_pos, v_park_keys) f);
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
