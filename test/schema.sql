-- The schema "graphile_worker_locks" after every migration in sql/ (see test/schema-dump.test.ts).

create unlogged table lock_holders (
  pid integer not null,
  lock_key bigint not null,
  task_identifier text not null,
  job_id bigint,
  since timestamp with time zone not null
);
alter table lock_holders add constraint lock_holders_pkey PRIMARY KEY (pid, lock_key);

create table migrations (
  id integer not null,
  applied_at timestamp with time zone not null default now()
);
alter table migrations add constraint migrations_pkey PRIMARY KEY (id);

create table parked_originals (
  job_id bigint not null,
  owner_pid integer,
  parked_at timestamp with time zone not null default now()
);
alter table parked_originals add constraint parked_originals_pkey PRIMARY KEY (job_id);

create table prewakes (
  lock_key bigint not null,
  job_id bigint not null,
  at timestamp with time zone not null
);
alter table prewakes add constraint prewakes_pkey PRIMARY KEY (lock_key);

create table unique_windows (
  unique_key text not null,
  job_id bigint,
  expires_at timestamp with time zone not null
);
alter table unique_windows add constraint unique_windows_pkey PRIMARY KEY (unique_key);
CREATE INDEX unique_windows_expires_at ON graphile_worker_locks.unique_windows USING btree (expires_at);

create table waiters (
  id bigint not null default nextval('graphile_worker_locks.waiters_id_seq'::regclass),
  lock_key bigint not null,
  job_id bigint not null,
  run_at timestamp with time zone,
  since timestamp with time zone not null default now(),
  pos bigint not null
);
alter table waiters add constraint waiters_pkey PRIMARY KEY (id);
CREATE INDEX waiters_job_id ON graphile_worker_locks.waiters USING btree (job_id);
CREATE INDEX waiters_lock_key_pos ON graphile_worker_locks.waiters USING btree (lock_key, pos);

create table wakes (
  lock_key bigint not null,
  at timestamp with time zone not null,
  job_id bigint,
  pos bigint
);
alter table wakes add constraint wakes_pkey PRIMARY KEY (lock_key);

create view held_locks as
 SELECT (l.classid::bigint << 32) | l.objid::bigint AS lock_key,
    h.task_identifier,
    h.job_id,
    l.pid,
    a.application_name,
    a.client_addr,
    h.since,
    a.backend_start AS session_started_at
   FROM pg_locks l
     JOIN pg_stat_activity a ON a.pid = l.pid
     LEFT JOIN graphile_worker_locks.lock_holders h ON h.pid = l.pid AND h.lock_key = ((l.classid::bigint << 32) | l.objid::bigint)
  WHERE l.locktype = 'advisory'::text AND l.objsubid = 1 AND l.granted AND l.database = (( SELECT pg_database.oid
           FROM pg_database
          WHERE pg_database.datname = current_database()));

create type job_spec (
  identifier text,
  payload json,
  queue_name text,
  run_at timestamp with time zone,
  max_attempts integer,
  priority integer,
  flags jsonb,
  unique_key text,
  scope text,
  window_seconds double precision,
  on_duplicate text,
  first boolean,
  task integer,
  queue integer,
  park_ms double precision
);

CREATE OR REPLACE FUNCTION graphile_worker_locks.clean_parked()
 RETURNS TABLE(job_id bigint)
 LANGUAGE plpgsql
AS $function$
begin
  delete from "graphile_worker_locks".parked_originals p
    where not exists (select 1 from "graphile_worker"._private_jobs j where j.id = p.job_id);
  return query
  with stale as (
    select j.id, j.job_queue_id, j.locked_by
    from "graphile_worker_locks".parked_originals p
    join "graphile_worker"._private_jobs j on j.id = p.job_id
    where j.key is null and j.attempts >= j.max_attempts
      and (
        j.locked_at is null
        or j.locked_at < now() - interval '1 minute'
        or (p.owner_pid is not null
            and not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = p.owner_pid))
      )
    for update of j skip locked
  ), unlocked_queues as (
    update "graphile_worker"._private_job_queues q set locked_at = null, locked_by = null
      from stale where q.id = stale.job_queue_id and q.locked_by = stale.locked_by
  ), removed as (
    delete from "graphile_worker"._private_jobs j using stale where j.id = stale.id
      returning j.id
  ), forgotten as (
    delete from "graphile_worker_locks".parked_originals p using removed where p.job_id = removed.id
  )
  select removed.id from removed;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.defer_job(p_job_id bigint, p_run_at timestamp with time zone, p_owner_pid integer)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
declare
  v_new_id bigint;
begin
  v_new_id := "graphile_worker_locks".reschedule_job(p_job_id, p_run_at);
  if v_new_id is not null then
    insert into "graphile_worker_locks".parked_originals (job_id, owner_pid) values (p_job_id, p_owner_pid)
      on conflict (job_id) do update set owner_pid = excluded.owner_pid, parked_at = now();
  end if;
  return v_new_id;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.enqueue_job(s graphile_worker_locks.job_spec, p_notify boolean, OUT outcome text, OUT job graphile_worker._private_jobs)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
declare
  v_ids record;
  v_until timestamptz;
  v_window_job bigint;
  v_claimed text;
  v_replaced "graphile_worker"._private_jobs;
  v_tries int := 0;
begin
  select * into v_ids from "graphile_worker_locks".task_and_queue_ids(s.identifier, s.queue_name);
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
      insert into "graphile_worker"._private_jobs
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
      select w.job_id into v_window_job from "graphile_worker_locks".unique_windows w
        where w.unique_key = s.unique_key and w.expires_at > now();
      if not found then
        insert into "graphile_worker_locks".unique_windows as w (unique_key, job_id, expires_at)
          values (s.unique_key, null, v_until)
          on conflict (unique_key) do update set job_id = null, expires_at = excluded.expires_at
            where w.expires_at <= now()
          returning w.unique_key into v_claimed;
        if not found then
          continue; -- claimed meanwhile: answer from that claim
        end if;
        insert into "graphile_worker"._private_jobs
          (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
        values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
          coalesce(s.max_attempts, 25), null, coalesce(s.priority, 0), s.flags)
        returning * into job;
        update "graphile_worker_locks".unique_windows set job_id = job.id where unique_key = s.unique_key;
        outcome := 'added';
        exit;
      end if;
      select * into job from "graphile_worker"._private_jobs j where j.id = v_window_job;
      if not found then
        job := null;
      end if;
    else
      insert into "graphile_worker"._private_jobs as j
        (job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
      values (v_ids.queue_id, v_ids.task_id, coalesce(s.payload, '{}'::json), coalesce(s.run_at, now()),
        coalesce(s.max_attempts, 25), s.unique_key, coalesce(s.priority, 0),
        "graphile_worker_locks".unique_flags(s.flags, s.scope, v_until))
      on conflict (key) do nothing
      returning * into job;
      if found then
        outcome := 'added';
        exit;
      end if;
      select * into job from "graphile_worker"._private_jobs j where j.key = s.unique_key;
      if not found then
        continue; -- it completed, or its inserter rolled back: try again
      end if;
      if not "graphile_worker_locks".unique_job_blocks(job) then
        -- Out of its scope: it keeps running or retrying, without the key (if it is still out of its scope
        -- as it is now; either way, try again).
        update "graphile_worker"._private_jobs j set key = null, updated_at = now()
          where j.id = job.id and j.key = s.unique_key and not "graphile_worker_locks".unique_job_blocks(j);
        continue;
      end if;
    end if;

    -- A duplicate.
    outcome := 'duplicate';
    if s.on_duplicate = 'replace' and job.id is not null then
      v_replaced := "graphile_worker_locks".replace_waiting_job(job.id, s.payload, s.run_at, s.priority);
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
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.enqueue_jobs(p_items json, p_count integer, p_first integer, p_tasks text[], p_queues text[], p_park_pos integer[], p_park_keys bigint[])
 RETURNS SETOF graphile_worker._private_jobs
 LANGUAGE plpgsql
AS $function$
declare
  v_task_ids int[];
  v_queue_ids int[];
  v_items "graphile_worker_locks".job_spec[];
  v_ids bigint[];
  v_plain_ids bigint[];
  v_keys text[];
  v_parked int := 0;
  v_added int := 0;
  v_spec record;
  v_one record;
  v_done int[];
  v_done_jobs "graphile_worker"._private_jobs[];
  -- the answer when not every item was simply added: rows, and for each its item's place and outcome
  v_jobs "graphile_worker"._private_jobs[];
  v_ords int[];
  v_outcomes text[];
  v_trailer "graphile_worker"._private_jobs;
  v_new_ids bigint[];
  v_seq regclass;
begin
  v_task_ids := "graphile_worker_locks".name_ids(null::"graphile_worker"._private_tasks, 'identifier', p_tasks);
  if cardinality(p_queues) > 0 then
    v_queue_ids := "graphile_worker_locks".name_ids(null::"graphile_worker"._private_job_queues, 'queue_name', p_queues);
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
      where c.reltype = pg_catalog.pg_typeof(null::"graphile_worker"._private_jobs))::regclass::text,
    'id')::regclass;
  if p_first > 1 then
    v_new_ids := array(select pg_catalog.nextval(v_seq) from generate_series(1, p_count) order by 1);
  end if;
  with inserted as (
    insert into "graphile_worker"._private_jobs as j
      (id, job_queue_id, task_id, payload, run_at, max_attempts, key, priority, flags)
    overriding system value
    select coalesce(v_new_ids[f.ordinality], pg_catalog.nextval(v_seq)), v_queue_ids[f.queue],
      v_task_ids[f.task], coalesce(f.payload, '{}'::json),
      case when f.park_ms is not null then now() + f.park_ms * interval '1 millisecond'
           else coalesce(f.run_at, now()) end,
      coalesce(f.max_attempts, 25), f.unique_key, coalesce(f.priority, 0),
      case when f.window_seconds is null then f.flags
           else "graphile_worker_locks".unique_flags(f.flags, f.scope,
             coalesce(f.run_at, now()) + f.window_seconds * interval '1 second') end
    from json_populate_recordset(null::"graphile_worker_locks".job_spec, p_items) with ordinality as f
    where f.unique_key is null or f.first
    order by case when p_first > 1 then f.unique_key end collate "C" nulls first, f.ordinality
    on conflict (key) do nothing
    returning j.id, j.key
  )
  select coalesce(array_agg(i.id order by i.id), '{}'),
    coalesce(array_agg(i.id order by i.id) filter (where i.key is null), '{}')
  into v_ids, v_plain_ids
  from inserted i;

  if p_park_pos is not null then
    insert into "graphile_worker_locks".waiters (lock_key, job_id, run_at, pos)
      select u.k, v_plain_ids[u.p], now(), v_plain_ids[u.p]
      from unnest(p_park_pos, p_park_keys) as u(p, k);
    get diagnostics v_parked = row_count;
  end if;

  v_added := cardinality(v_ids);
  if v_added = p_count then
    -- The common case, every item a fresh key or none: its rows in its order, by primary key.
    return query select j.* from "graphile_worker"._private_jobs j where j.id = any(v_ids) order by j.id;
    if v_added > v_parked then
      perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
    end if;
    return;
  end if;

  -- The rest needs the items again.
  v_items := array(select json_populate_recordset(null::"graphile_worker_locks".job_spec, p_items));
  -- The rows added so far, in id order: the items' order among those added, which are the items without a
  -- unique key and the first of each key that was free.
  v_jobs := array(select j from "graphile_worker"._private_jobs j where j.id = any(v_ids) order by j.id);
  v_keys := array(select x.key from unnest(v_jobs) as x where x.key is not null);
  v_ords := array(
    select s.ordinality::int from unnest(v_items) with ordinality as s
    where s.unique_key is null or (s.first and s.unique_key in (select unnest(v_keys)))
    order by s.ordinality);
  v_outcomes := array_fill('added'::text, array[cardinality(v_jobs)]);
  if cardinality(v_keys) = p_first then
    v_keys := null; -- every first-of-key item was inserted
  end if;

  -- Duplicates that only need answering, set-based: items with a scope that ask to be rejected, whose key is
  -- held by a job that refuses them by its own rules; the rest goes one by one below.
  with answered as (
    select s.ordinality::int as ord, j as holder
    from unnest(v_items) with ordinality as s
    join "graphile_worker"._private_jobs j on j.key = s.unique_key
    where s.unique_key is not null and s.scope is not null and coalesce(s.on_duplicate, 'reject') = 'reject'
      and not (coalesce(s.first, false) and (v_keys is null or s.unique_key in (select unnest(v_keys))))
      and "graphile_worker_locks".unique_job_blocks(j)
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
          coalesce(s.first, false), null, null, null)::"graphile_worker_locks".job_spec as spec,
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
    select * into v_one from "graphile_worker_locks".enqueue_job(v_spec.spec, false);
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
    left join "graphile_worker"._private_tasks t on t.id = (v_jobs[n]).task_id
    order by n));
  return next v_trailer;

  if v_added > v_parked then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || (v_added - v_parked)::text || '}');
  end if;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.is_next(p_key bigint, p_job_id bigint)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
  with me as (select "graphile_worker_locks".line_position(p_key, p_job_id) as pos)
  select not exists (
    select 1
    from (
      select w.job_id from "graphile_worker_locks".waiters w
      where w.lock_key = p_key and w.pos < (select pos from me)
      offset 0
    ) w
    cross join lateral (
      select 1 from "graphile_worker"._private_jobs j
      where j.id = w.job_id and (j.locked_at is null or j.locked_at > now() - interval '2 seconds')
      limit 1
    ) j
  ) and not exists (
    select 1 from "graphile_worker_locks".wakes k
    where k.lock_key = p_key and k.job_id is distinct from p_job_id
      and k.pos < (select pos from me)
      and "graphile_worker_locks".wake_on_its_way(k.at, k.job_id)
  )
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.is_prewoken(p_key bigint, p_job_id bigint)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
  select exists (select 1 from "graphile_worker_locks".prewakes p where p.lock_key = p_key and p.job_id = p_job_id)
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.line_position(p_key bigint, p_job_id bigint)
 RETURNS bigint
 LANGUAGE sql
 STABLE
AS $function$
  select coalesce(
    (select w.pos from "graphile_worker_locks".waiters w where w.job_id = p_job_id and w.lock_key = p_key limit 1),
    (select k.pos from "graphile_worker_locks".wakes k where k.lock_key = p_key and k.job_id = p_job_id),
    p_job_id
  )
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.name_ids(p_row anyelement, p_column text, p_names text[])
 RETURNS integer[]
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.park_job(p_job_id bigint, p_run_at timestamp with time zone, p_lock_key bigint, p_per_position interval, p_latest timestamp with time zone, p_owner_pid integer)
 RETURNS TABLE(id bigint, run_at timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
declare
  v_run_at timestamptz;
  v_pos bigint;
  v_ahead bigint;
  v_safety_net timestamptz;
  v_new_id bigint;
begin
  select j.run_at into v_run_at from "graphile_worker"._private_jobs j where j.id = p_job_id;
  v_pos := "graphile_worker_locks".line_position(p_lock_key, p_job_id);
  select count(*) into v_ahead from "graphile_worker_locks".waiters w
    where w.lock_key = p_lock_key and w.pos < v_pos;
  v_safety_net := greatest(p_run_at, least(p_run_at + v_ahead * p_per_position, p_latest));
  v_new_id := "graphile_worker_locks".reschedule_job(p_job_id, v_safety_net);
  if v_new_id is null then
    return;
  end if;
  insert into "graphile_worker_locks".parked_originals (job_id, owner_pid) values (p_job_id, p_owner_pid)
    on conflict (job_id) do update set owner_pid = excluded.owner_pid, parked_at = now();
  -- A waiter fetched by its safety net parks again in its own row; anyone else gets a row at its place.
  update "graphile_worker_locks".waiters w set job_id = v_new_id
    where w.job_id = p_job_id and w.lock_key = p_lock_key;
  if not found then
    insert into "graphile_worker_locks".waiters (lock_key, job_id, run_at, pos)
      values (p_lock_key, v_new_id, v_run_at, v_pos);
  end if;
  return query select v_new_id, v_safety_net;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.prewake(p_keys bigint[], p_notify boolean)
 RETURNS TABLE(i integer, job_id bigint)
 LANGUAGE plpgsql
AS $function$
declare
  v_i int;
  v_job bigint;
begin
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    if "graphile_worker_locks".wake_waiters(array[p_keys[v_i]], p_notify) > 0 then
      select k.job_id into v_job from "graphile_worker_locks".wakes k where k.lock_key = p_keys[v_i];
      insert into "graphile_worker_locks".prewakes (lock_key, job_id, at)
        values (p_keys[v_i], v_job, clock_timestamp())
        on conflict (lock_key) do update set job_id = excluded.job_id, at = excluded.at;
      return query select v_i, v_job;
    end if;
  end loop;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.release_waiters(p_keys bigint[], p_job_ids bigint[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
      delete from "graphile_worker_locks".waiters w where w.job_id = p_job_ids[v_i] and w.lock_key = v_key;
    end if;
    v_unfetched := null;
    delete from "graphile_worker_locks".prewakes p where p.lock_key = v_key returning p.job_id into v_early;
    if v_early is not null and v_early is distinct from p_job_ids[v_i] then
      select j.locked_at is null into v_unfetched
        from "graphile_worker_locks".wakes k
        join "graphile_worker"._private_jobs j on j.id = k.job_id
        where k.lock_key = v_key and k.job_id = v_early
          and k.at > clock_timestamp() - interval '2 seconds'
          -- parked again, it waits under a new job id in its old place
          and not exists (select 1 from "graphile_worker_locks".waiters w where w.lock_key = v_key and w.pos = k.pos);
    end if;
    if v_unfetched is not null then
      update "graphile_worker_locks".wakes k set at = clock_timestamp() where k.lock_key = v_key;
      perform pg_notify('gwl_release', v_key::text);
      if v_unfetched then
        v_announce := v_announce + 1;
      end if;
    else
      v_wake := v_wake || v_key;
    end if;
  end loop;
  if v_announce > 0 then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_announce::text || '}');
  end if;
  return "graphile_worker_locks".wake_waiters(v_wake, true);
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.replace_waiting_job(p_job_id bigint, p_payload json, p_run_at timestamp with time zone, p_priority integer)
 RETURNS graphile_worker._private_jobs
 LANGUAGE plpgsql
AS $function$
declare
  v_job "graphile_worker"._private_jobs;
begin
  update "graphile_worker"._private_jobs as j
    set payload = coalesce(p_payload, j.payload),
        run_at = coalesce(p_run_at, j.run_at),
        priority = coalesce(p_priority::smallint, j.priority),
        revision = j.revision + 1,
        updated_at = now()
    where j.id = p_job_id and j.locked_at is null and j.attempts = 0
    returning * into v_job;
  return v_job;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.reschedule_job(p_job_id bigint, p_run_at timestamp with time zone)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
declare
  v_old "graphile_worker"._private_jobs;
  v_new_id bigint;
begin
  select * into v_old from "graphile_worker"._private_jobs j where j.id = p_job_id for update;
  if not found then
    return null;
  end if;
  update "graphile_worker"._private_jobs j
    set key = null, attempts = j.max_attempts, updated_at = now()
    where j.id = p_job_id;
  insert into "graphile_worker"._private_jobs
    (job_queue_id, task_id, payload, run_at, attempts, max_attempts, last_error, key, priority, flags)
  values (v_old.job_queue_id, v_old.task_id, v_old.payload, p_run_at, greatest(v_old.attempts - 1, 0),
    v_old.max_attempts, v_old.last_error, v_old.key, v_old.priority, v_old.flags)
  returning id into v_new_id;
  return v_new_id;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.sweep_prewakes()
 RETURNS bigint
 LANGUAGE sql
AS $function$
  with gone as (
    delete from "graphile_worker_locks".prewakes where at < now() - interval '1 minute' returning 1
  )
  select count(*) from gone
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.sweep_unique_windows()
 RETURNS bigint
 LANGUAGE sql
AS $function$
  with gone as (
    delete from "graphile_worker_locks".unique_windows w
    where w.unique_key in (
      select x.unique_key from "graphile_worker_locks".unique_windows x
      where x.expires_at <= now()
      for update skip locked
    ) and w.expires_at <= now()
    returning 1
  )
  select count(*) from gone
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.sweep_waiters()
 RETURNS bigint
 LANGUAGE sql
AS $function$
  with gone as (
    delete from "graphile_worker_locks".waiters w
    where not exists (select 1 from "graphile_worker"._private_jobs j where j.id = w.job_id)
    returning 1
  ), stale as (
    delete from "graphile_worker_locks".wakes where at < now() - interval '1 minute'
  )
  select count(*) from gone
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.task_and_queue_ids(p_identifier text, p_queue_name text, OUT task_id integer, OUT queue_id integer)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
begin
  select t.id into task_id from "graphile_worker"._private_tasks t where t.identifier = p_identifier;
  if task_id is null then
    insert into "graphile_worker"._private_tasks (identifier) values (p_identifier) on conflict do nothing;
    select t.id into task_id from "graphile_worker"._private_tasks t where t.identifier = p_identifier;
  end if;
  if p_queue_name is not null then
    select q.id into queue_id from "graphile_worker"._private_job_queues q where q.queue_name = p_queue_name;
    if queue_id is null then
      insert into "graphile_worker"._private_job_queues (queue_name) values (p_queue_name) on conflict do nothing;
      select q.id into queue_id from "graphile_worker"._private_job_queues q where q.queue_name = p_queue_name;
    end if;
  end if;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.try_lock_first(keys bigint[])
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.unique_flags(p_flags jsonb, p_scope text, p_until timestamp with time zone)
 RETURNS jsonb
 LANGUAGE sql
 IMMUTABLE
AS $function$
  select case when p_scope is null or p_until is null then p_flags
    else coalesce(p_flags, '{}'::jsonb)
      || jsonb_build_object('gwl:unique-until:' || extract(epoch from p_until)::text, true) end
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.unique_job_blocks(j graphile_worker._private_jobs)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
  select
    case
      when j.flags ? 'gwl:unique:queued' then j.locked_at is null and j.attempts = 0
      when j.flags ? 'gwl:unique:exists' then true
      -- active (also the rule for a keyed row without our flags): queued, running or waiting to retry
      else j.locked_at is not null or j.attempts < j.max_attempts
    end
    and coalesce(to_timestamp(substr(pg_catalog.jsonb_path_query_first(j.flags,
      '$.keyvalue() ? (@.key starts with "gwl:unique-until:").key') #>> '{}', 18)::float8) > now(), true)
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.wake_if_free(p_slots bigint[], p_key bigint, p_job_id bigint)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
begin
  if exists (
    select 1 from "graphile_worker_locks".wakes w
    where w.lock_key = p_key and w.job_id is distinct from p_job_id
      and "graphile_worker_locks".wake_on_its_way(w.at, w.job_id)
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
    return "graphile_worker_locks".wake_waiters(array[p_key], true);
  end if;
  return 0;
end;
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.wake_on_its_way(p_at timestamp with time zone, p_job_id bigint)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
  select p_at > clock_timestamp() - interval '2 seconds' and (
    p_at > clock_timestamp() - interval '100 milliseconds'
    or exists (select 1 from "graphile_worker"._private_jobs j where j.id = p_job_id)
  )
$function$;

CREATE OR REPLACE FUNCTION graphile_worker_locks.wake_waiters(p_keys bigint[], p_notify boolean)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
      delete from "graphile_worker_locks".waiters w
        where w.id = (
          select x.id from "graphile_worker_locks".waiters x
          where x.lock_key = v_key
          order by x.pos, x.id
          limit 1
          for update skip locked
        )
        returning w.job_id, w.run_at, w.pos into v_waiter;
      exit when not found;
      update "graphile_worker"._private_jobs as j
        set run_at = least(j.run_at, coalesce(v_waiter.run_at, now()), now()) - interval '1 millisecond'
        where j.id = v_waiter.job_id and j.locked_at is null;
      if found then
        v_woken := v_woken + 1;
      elsif not exists (
        select 1 from "graphile_worker"._private_jobs j where j.id = v_waiter.job_id
      ) then
        continue; -- that job is gone: the next in line
      end if;
      -- Woken, or already running (fetched by its safety net): either way it is on its way to the key, with
      -- its place kept here should it have to park again.
      insert into "graphile_worker_locks".wakes (lock_key, at, job_id, pos)
        values (v_key, clock_timestamp(), v_waiter.job_id, v_waiter.pos)
        on conflict (lock_key) do update
          set at = excluded.at, job_id = excluded.job_id, pos = excluded.pos;
      v_on_its_way := true;
      exit;
    end loop;
    if not v_on_its_way then
      -- Nobody waits: whoever was woken last has come and gone. Its wake must not keep counting as one on its
      -- way, or a job that parks a moment later would wait for it (wake_if_free) instead of being woken.
      delete from "graphile_worker_locks".wakes k where k.lock_key = v_key;
    end if;
  end loop;
  if v_woken > 0 and p_notify then
    perform pg_notify('jobs:insert', '{"r":' || random()::text || ',"count":' || v_woken::text || '}');
  end if;
  return v_woken;
end;
$function$;
