-- graphile-worker-locks, migration 10: a bulk enqueue inserts its items in the order given, in one insert.
--
-- Until now add_unique_jobs (migration 8) inserted the first scoped item of each key first, then every item
-- without uniqueness in a second insert, from a second parse of the batch. So in a batch that mixed them a
-- unique item got a smaller id than the plain items before it: graphile-worker runs jobs of equal priority
-- and run_at by id, so the batch did not run in the order given. Now both kinds go in one insert, ordered by
-- their place in the batch, from one parse: ids follow the batch, and a batch of plain items costs one insert
-- (the rows are read back by id, which is cheaper than keeping whole rows in an array).
--
-- Which rows are whose: a plain item has no key, so it never conflicts, and the plain items' rows, in id
-- order, are the plain items in batch order (ids are drawn as the rows are inserted, in the insert's order);
-- a first-of-key item's row is found by its key, as before. The items after the first of a named lock key
-- still go in waiting in line (migration 8), and everything after the first insert is unchanged.
--
-- (graphile-worker's own add_jobs has no order in its insert: with a small batch PostgreSQL may hash-join
-- the items to the tasks and insert them last first. This function always orders.)

create or replace function :GWL_SCHEMA.add_unique_jobs(p_specs json, p_count int, p_first int, p_tasks text[], p_queues text[],
  p_park_keys bigint[], p_park_ms float8[])
returns table (ord int, outcome text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
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
  -- order: ids follow the batch (a unique item does not jump ahead of the plain items before it), and the
  -- items are parsed once for both. Plain items never conflict (no key); the rows of those that came back
  -- are read in id order, which is the order they were inserted in, so the n-th is the n-th plain item.
  with items as materialized (
    select s.*, s.ordinality::int as ord,
      s.unique_key is null and p_park_keys[s.ordinality::int] is not null
        and row_number() over (
          partition by case when s.unique_key is null then p_park_keys[s.ordinality::int] end
          order by s.ordinality) > 1 as parked
    from json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs) with ordinality as s
  ), inserted as (
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    select q.id, t.id, coalesce(f.payload, '{}'::json),
      -- an item after the first of its named lock key waits in line: its run_at is its safety net
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

  -- (ids only: arrays of whole rows cost more than reading them back by primary key)
  return query select null::int, 'added'::text, j
    from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_ids);
  if cardinality(v_plain_ids) > 0 then
    -- each parked job waits at its own place: its id, the enqueue order
    insert into :GWL_SCHEMA.waiters (lock_key, job_id, run_at, pos)
      select p_park_keys[v_plain_ords[n]], v_plain_ids[n], now(), v_plain_ids[n]
      from generate_subscripts(v_plain_ids, 1) as n
      where v_plain_parked[n];
    get diagnostics v_parked = row_count;
    -- Read back by primary key, as the first-of-key rows are; the n-th by id is the n-th plain item. (A join
    -- of the ids with the table, even written as a lateral lookup, is flattened into a join that PostgreSQL
    -- may plan as a hash of the whole job table once it has statistics: 10 ms per 1,000 items instead of
    -- half a millisecond, measured in the enqueue benchmark.)
    return query select v_plain_ords[x.n::int], 'added'::text, x.j
      from (
        select j, row_number() over (order by j.id) as n
        from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = any(v_plain_ids)
      ) x;
  end if;

  v_added := cardinality(v_ids) + cardinality(v_plain_ids);
  if v_added = p_count then
    -- the common case: every item was a fresh key or had none
    if v_added > v_parked then
      perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
    end if;
    return;
  end if;
  -- The rest needs the items again.
  v_specs := array(select json_populate_recordset(null:::GWL_SCHEMA.unique_job_spec, p_specs));

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

