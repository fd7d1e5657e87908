-- graphile-worker-locks: a batch's rate-limited items are admitted set-based, key by key.
--
-- Placeholders as in 000001.sql.
--
-- enqueue_jobs_limited (000005.sql) took every rate-limited or debounced item of a batch through
-- enqueue_job_limited, one by one: several statements and a row update per item. Now the items of a rate
-- key that meets, in the batch, only plain rate-limited items under one limit and period (no unique key, no
-- debounce: each of them adds a job when admitted) go together. Under the key's row, which the batch holds
-- (lock_rates), the key has room for `limit` less its stamps later than t - period, t being the clock once
-- every row is held; the first that many of the key's items, in the batch's order, are admitted and stamped
-- t, the ring written once, and the admitted jobs added in one insert. That is what the one-by-one pass
-- decides for them, all stamped at one instant (the rule at the top of 000005.sql holds for equal stamps).
-- Every other item goes one by one, as before, after them; the rows of the batch's other items come first,
-- as before. So the jobs of those keys get ids before the one-by-one items' jobs, in the batch's order.

-- Locks the rate rows of `p_keys`, making the missing ones (empty logs), in key order (C collation), in one
-- statement: each key's row is inserted or, when it exists, locked by the conflict (`do update ... where
-- false` locks the row and changes nothing). The rows go in the statement's order, so two callers never
-- wait for each other's keys in opposite orders; a row being removed (the sweep) is waited for and then
-- inserted again.
create or replace function :GWL_SCHEMA.lock_rates(p_keys text[]) returns void
language sql volatile as $$
  insert into :GWL_SCHEMA.enqueue_rates as r (rate_key, stamps, pos, lim, expires_at)
    select distinct u.k collate "C", '{}'::timestamptz[], 1, null::int, '-infinity'::timestamptz
    from unnest(p_keys) as u(k)
    order by 1
  on conflict (rate_key) do update set lim = r.lim where false
$$;

create or replace function :GWL_SCHEMA.enqueue_jobs_limited(p_items json, p_count int,
  p_scoped_key_count int, p_tasks text[], p_queues text[], p_park_pos int[], p_park_keys bigint[],
  p_limited json)
returns table (ord int, outcome text, task_identifier text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_item record;
  v_one record;
  v_due int := 0;
  v_at timestamptz;
  -- the items admitted set-based, in the batch's order: their places and columns
  v_n int[];
  v_identifier text[];
  v_queue_name text[];
  v_payload json[];
  v_run_at timestamptz[];
  v_max_attempts int[];
  v_priority int[];
  v_flags jsonb[];
  -- the items refused set-based
  v_refused int[];
  v_refused_identifier text[];
  -- every item decided set-based
  v_decided int[];
  v_tasks text[];
  v_task_ids int[];
  v_queues text[];
  v_queue_ids int[];
  v_ids bigint[];
  v_seq regclass;
  v_rate_keys text[];
  v_debounce_keys text[];
  v_count int;
begin
  select array_agg(x.rate_key) filter (where x.rate_key is not null),
    array_agg(x.debounce_key) filter (where x.debounce_key is not null), count(*)::int
  into v_rate_keys, v_debounce_keys, v_count
  from json_to_recordset(p_limited) as x(rate_key text, debounce_key text);
  if v_rate_keys is not null then
    perform :GWL_SCHEMA.lock_rates(v_rate_keys);
  end if;
  if v_debounce_keys is not null then
    perform :GWL_SCHEMA.lock_debounces(v_debounce_keys);
  end if;
  if p_count > 0 then
    return query select * from :GWL_SCHEMA.enqueue_jobs(p_items, p_count, p_scoped_key_count, p_tasks,
      p_queues, p_park_pos, p_park_keys);
  end if;

  -- Set-based: each plain rate key's room, its items ranked in the batch's order, its ring written.
  v_at := clock_timestamp();
  with items as (
    select e.n::int as n, x.*
    from json_array_elements(p_limited) with ordinality as e(item, n)
    cross join lateral json_to_record(e.item) as x(identifier text, payload json, queue_name text,
      run_at timestamptz, max_attempts int, priority int, flags jsonb, unique_key text, rate_key text,
      rate_limit int, rate_period_ms float8, debounce_key text)
  ), plain_keys as (
    select i.rate_key, min(i.rate_limit) as lim, min(i.rate_period_ms) * interval '1 millisecond' as period,
      count(*)::int as items
    from items i
    where i.rate_key is not null
    group by i.rate_key
    having bool_and(i.unique_key is null and i.debounce_key is null)
      and min(i.rate_limit) = max(i.rate_limit) and min(i.rate_period_ms) = max(i.rate_period_ms)
  ), logs as (
    -- Each key's log, ascending: its ring read from the oldest stamp, or its last `lim` stamps when it was
    -- written under another limit (as rate_ring rebuilds it).
    select k.rate_key, k.lim, k.period, k.items,
      case when r.lim is not distinct from k.lim then r.stamps[r.pos:] || r.stamps[:r.pos - 1]
        else array(select x.t from (select u.t from unnest(r.stamps) as u(t) order by u.t desc
          limit k.lim) x order by x.t) end as stamps
    from plain_keys k
    join :GWL_SCHEMA.enqueue_rates r on r.rate_key = k.rate_key
  ), rooms as (
    select l.*, least(l.items,
      l.lim - (select count(*)::int from unnest(l.stamps) as u(t) where u.t > v_at - l.period)) as k
    from logs l
  ), ranked as (
    select i.*, row_number() over (partition by i.rate_key order by i.n) <= m.k as admitted
    from items i join rooms m on m.rate_key = i.rate_key
  ), ring as (
    -- (a data-modifying WITH runs whether or not the query reads it)
    update :GWL_SCHEMA.enqueue_rates r
      set stamps = (m.stamps || array_fill(v_at, array[m.k]))
          [greatest(1, cardinality(m.stamps) + m.k - m.lim + 1):],
        pos = 1, lim = m.lim, expires_at = v_at + m.period
      from rooms m
      where r.rate_key = m.rate_key and m.k > 0
    returning 1
  )
  select
    coalesce(array_agg(x.n order by x.n) filter (where x.admitted), '{}'),
    array_agg(x.identifier order by x.n) filter (where x.admitted),
    array_agg(x.queue_name order by x.n) filter (where x.admitted),
    array_agg(x.payload order by x.n) filter (where x.admitted),
    array_agg(x.run_at order by x.n) filter (where x.admitted),
    array_agg(x.max_attempts order by x.n) filter (where x.admitted),
    array_agg(x.priority order by x.n) filter (where x.admitted),
    array_agg(x.flags order by x.n) filter (where x.admitted),
    coalesce(array_agg(x.n order by x.n) filter (where not x.admitted), '{}'),
    array_agg(x.identifier order by x.n) filter (where not x.admitted),
    coalesce(array_agg(x.n), '{}')
  into v_n, v_identifier, v_queue_name, v_payload, v_run_at, v_max_attempts, v_priority, v_flags,
    v_refused, v_refused_identifier, v_decided
  from ranked x;

  if cardinality(v_n) > 0 then
    v_tasks := array(select distinct u.t from unnest(v_identifier) as u(t));
    v_task_ids := :GWL_SCHEMA.name_ids(null:::GRAPHILE_WORKER_SCHEMA._private_tasks, 'identifier', v_tasks);
    v_queues := array(select distinct u.q from unnest(v_queue_name) as u(q) where u.q is not null);
    if cardinality(v_queues) > 0 then
      v_queue_ids := :GWL_SCHEMA.name_ids(null:::GRAPHILE_WORKER_SCHEMA._private_job_queues, 'queue_name',
        v_queues);
    end if;
    -- Ids drawn first, ascending, one per item: the jobs' ids follow the batch's order.
    v_seq := pg_catalog.pg_get_serial_sequence(
      (select c.oid from pg_catalog.pg_class c
        where c.reltype = pg_catalog.pg_typeof(null:::GRAPHILE_WORKER_SCHEMA._private_jobs))::regclass::text,
      'id')::regclass;
    v_ids := array(select pg_catalog.nextval(v_seq) from generate_series(1, cardinality(v_n)) order by 1);
    insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
      (id, job_queue_id, task_id, payload, run_at, max_attempts, priority, flags)
    overriding system value
    select v_ids[u.i], v_queue_ids[array_position(v_queues, u.queue_name)],
      v_task_ids[array_position(v_tasks, u.identifier)], d.payload, d.run_at, d.max_attempts, d.priority,
      u.flags
    from unnest(v_identifier, v_queue_name, v_payload, v_run_at, v_max_attempts, v_priority, v_flags)
      with ordinality as u(identifier, queue_name, payload, run_at, max_attempts, priority, flags, i)
    cross join lateral :GWL_SCHEMA.job_defaults(u.payload, u.run_at, u.max_attempts, u.priority) d;
    return query select p_count + u.n, 'added'::text, u.t, j
      from unnest(v_ids, v_n, v_identifier) as u(id, n, t)
      join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = u.id;
    select count(*)::int into v_due from unnest(v_run_at) as u(t) where coalesce(u.t, now()) <= now();
  end if;
  return query select p_count + u.n, 'rateLimited'::text, u.t, null:::GRAPHILE_WORKER_SCHEMA._private_jobs
    from unnest(v_refused, v_refused_identifier) as u(n, t);

  if cardinality(v_decided) = v_count then
    perform :GWL_SCHEMA.announce_jobs(v_due);
    return;
  end if;
  -- One by one: every other item, in its order.
  for v_item in
    select x.*, e.n::int as n
    from json_array_elements(p_limited) with ordinality as e(item, n)
    cross join lateral json_to_record(e.item) as x(identifier text, payload json, queue_name text,
      run_at timestamptz, max_attempts int, priority int, flags jsonb, unique_key text, scope text,
      window_seconds float8, on_duplicate text, rate_key text, rate_limit int, rate_period_ms float8,
      debounce_key text, delay_ms float8, max_wait_ms float8, leading_edge boolean)
    where e.n::int <> all(v_decided)
    order by e.n
  loop
    select * into v_one from :GWL_SCHEMA.enqueue_job_limited(
      row(v_item.identifier, v_item.payload, v_item.queue_name, v_item.run_at, v_item.max_attempts,
        v_item.priority, v_item.flags, v_item.unique_key, v_item.scope, v_item.window_seconds,
        coalesce(v_item.on_duplicate, 'reject'), null, null, null, null):::GWL_SCHEMA.job_spec, false,
      v_item.rate_key, v_item.rate_limit, v_item.rate_period_ms,
      v_item.debounce_key, v_item.delay_ms, v_item.max_wait_ms, coalesce(v_item.leading_edge, false));
    if v_one.outcome = 'duplicate' and v_item.on_duplicate = 'raise' then
      raise exception 'graphile-worker-locks: item % of the batch duplicates job %', p_count + v_item.n,
        (v_one.job).id
        using errcode = 'GWLUQ', detail = coalesce((v_one.job).id::text, ''),
          hint = (p_count + v_item.n)::text;
    end if;
    if v_one.outcome = 'added' and (v_one.job).run_at <= now() then
      v_due := v_due + 1;
    end if;
    ord := p_count + v_item.n;
    outcome := v_one.outcome;
    task_identifier := v_one.task_identifier;
    job := v_one.job;
    return next;
  end loop;
  perform :GWL_SCHEMA.announce_jobs(v_due);
end;
$$;
