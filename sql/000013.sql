-- graphile-worker-locks, migration 13: enqueues that never deadlock each other, and duplicates that lock
-- nothing.
--
-- - Two bulk enqueues with overlapping unique keys in different orders could deadlock (SQLSTATE 40P01, the
--   whole batch rejected): each inserted its keys in its items' order, and an insert of a key another
--   uncommitted batch had inserted waits for that batch. Now every step that can wait on another
--   enqueue goes by key: the batch's new tasks and queues by name, its insert by unique key (C collation),
--   and the items answered one by one by unique key too. Ids still follow the items' order: they are drawn
--   from the job table's sequence first, ascending, and given to the items in their order.
-- - A duplicate answered inside a caller's transaction held a `for update` lock on the existing job until
--   that transaction ended: the job could be neither fetched (graphile-worker skips locked rows) nor
--   completed. add_unique_job_one now reads the existing job without locking it, and only a job the enqueue
--   changes (its key given up, or its payload replaced) is locked, by the update that changes it.
-- - The sweep of expired windows skips windows an enqueue is claiming instead of waiting for them.
--
-- These functions write graphile-worker's private job table directly, as its own add_job does; the library
-- checks graphile-worker's migration level before it runs them (src/migrate.ts).

-- One enqueue (migration 2), holding no lock on a job it does not change. A duplicate is answered from the
-- existing job as last committed, without `for update`: inside a caller's open transaction, a lock taken
-- here would last until that transaction ends, and meanwhile graphile-worker could neither fetch the job
-- (its fetch skips locked rows) nor complete it (its completion would wait). A job that no longer refuses
-- the key gives it up in an update that checks again, on the row as it is then, that it still does not
-- refuse it. A window alone is read before it is claimed, so that an unexpired window is answered
-- without locking its row either.
create or replace function :GWL_SCHEMA.add_unique_job_one(s :GWL_SCHEMA.unique_job_spec, p_notify boolean,
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
        insert into :GRAPHILE_WORKER_SCHEMA._private_jobs
          (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
        values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
          coalesce(s.max_attempts, 25), null, coalesce(s.priority, 0), s.flags)
        returning * into job;
        update :GWL_SCHEMA.unique_windows set job_id = job.id where unique_key = s.unique_key;
        outcome := 'added';
        exit;
      end if;
      select * into job from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v_window_job;
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
    return;
  end loop;

  if p_notify then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":1}');
  end if;
end;
$$;

-- The bulk enqueue (migration 11), taking what it waits for in key order (see above).
create or replace function :GWL_SCHEMA.add_unique_jobs_flat(p_specs json, p_count int, p_first int, p_tasks text[],
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
  v_new_ids bigint[];
  v_seq regclass;
begin
  insert into :GRAPHILE_WORKER_SCHEMA._private_tasks (identifier)
    select t.identifier from unnest(p_tasks) as t(identifier)
    where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_tasks x where x.identifier = t.identifier)
    order by t.identifier collate "C"
    on conflict do nothing;
  v_task_ids := array(
    select t.id from unnest(p_tasks) with ordinality as u(identifier, n)
    join :GRAPHILE_WORKER_SCHEMA._private_tasks t on t.identifier = u.identifier
    order by u.n);
  if cardinality(p_queues) > 0 then
    insert into :GRAPHILE_WORKER_SCHEMA._private_job_queues (queue_name)
      select q.queue_name from unnest(p_queues) as q(queue_name)
      where not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_job_queues x where x.queue_name = q.queue_name)
      order by q.queue_name collate "C"
      on conflict do nothing;
    v_queue_ids := array(
      select q.id from unnest(p_queues) with ordinality as u(queue_name, n)
      join :GRAPHILE_WORKER_SCHEMA._private_job_queues q on q.queue_name = u.queue_name
      order by u.n);
  end if;
  -- The first scoped item of each key and every item without uniqueness, in one insert, ids following the
  -- items' order (migration 10): the rows without a key in id order are the items without a unique key in
  -- order. With two keys or more, the rows go in by key (C collation), as every other step of the batch
  -- does, so that two batches never wait for each other's keys in opposite orders; their ids are drawn
  -- first then, one per item, ascending, and item n takes the n-th.
  if p_first > 1 then
    -- (the table named by its row type, which the placeholder gives as an identifier, not as a literal)
    v_seq := pg_catalog.pg_get_serial_sequence(
      (select c.oid from pg_catalog.pg_class c
        where c.reltype = pg_catalog.pg_typeof(null:::GRAPHILE_WORKER_SCHEMA._private_jobs))::regclass::text,
      'id')::regclass;
    v_new_ids := array(select pg_catalog.nextval(v_seq) from generate_series(1, p_count) order by 1);
    with inserted as (
      insert into :GRAPHILE_WORKER_SCHEMA._private_jobs as j
        (id, job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      overriding system value
      select v_new_ids[f.ordinality], v_queue_ids[f.queue], v_task_ids[f.task], coalesce(f.payload, '{}'::json),
        case when f.park_ms is not null then now() + f.park_ms * interval '1 millisecond'
             else coalesce(f.run_at, now()) end,
        coalesce(f.max_attempts, 25), f.unique_key, coalesce(f.priority, 0),
        case when f.window_seconds is null then f.flags
             else :GWL_SCHEMA.unique_flags(f.flags, f.scope,
               coalesce(f.run_at, now()) + f.window_seconds * interval '1 second') end
      from json_populate_recordset(null:::GWL_SCHEMA.bulk_job_spec, p_specs) with ordinality as f
      where f.unique_key is null or f.first
      order by f.unique_key collate "C" nulls first, f.ordinality
      on conflict (key) do nothing
      returning j.id, j.key
    )
    select coalesce(array_agg(i.id order by i.id), '{}'),
      coalesce(array_agg(i.id order by i.id) filter (where i.key is null), '{}')
    into v_ids, v_plain_ids
    from inserted i;
  else
    -- (at most one key: no order of keys to keep, and ids drawn as the rows go in, in the items' order)
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
  end if;

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
    -- by key, as the insert above (the items of one key in their order: the first of a key wins)
    order by x.unique_key collate "C", x.ord
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

-- Removes expired windows; returns how many. A window an enqueue is claiming right now is left for the
-- next sweep (which it renews anyway), so that a sweep never waits for, or deadlocks with, an enqueue.
create or replace function :GWL_SCHEMA.sweep_unique_windows() returns bigint
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
