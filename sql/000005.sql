-- graphile-worker-locks: rate-limited enqueues and debounced enqueues.
--
-- Placeholders as in 000001.sql. Contents, in order:
--   1. The data model: each key's recent enqueues (enqueue_rates) and each key's burst (debounces).
--   2. Rate-limited enqueue: the window, a key's ring of stamps, locking keys in order.
--   3. Debounce.
--   4. Enqueueing with either, one job or in a batch.
--   5. Sweep.
--
-- Both are serialized per key by the key's row, locked `for update` until the enqueuing transaction ends (the
-- caller's, inside `pgClient`): two enqueuers of one key take turns, and what a rolled-back transaction did
-- to the row is rolled back with it. Every stamp and burst time is the database's clock at the moment the
-- enqueue holds the key's row (clock_timestamp(), not the transaction's start), so that the stamps of a key follow the order
-- in which its enqueues took turns. A rate-limited key whose window is full as last committed is refused
-- without locking anything. Where more than one kind of row is locked, the order is: rate rows, then
-- debounce rows, then unique keys (000001.sql), each kind in key order.


-- 1. The data model ---------------------------------------------------------------------------------------

-- A rate-limited key's last `limit` enqueues that added a job: their stamps, as a ring (`stamps` in the order
-- they were written; once it holds `lim` of them, the oldest is at `pos`, and the next stamp replaces it).
-- `lim` is the limit the ring was written under; a ring met under another limit is rebuilt first. Removed
-- once its newest stamp is older than the period (`expires_at`), by sweep_enqueue_limits; a missing row is
-- an empty log.
create table :GWL_SCHEMA.enqueue_rates (
  rate_key text primary key,
  stamps timestamptz[] not null,
  pos int not null,
  lim int,
  expires_at timestamptz not null
);

-- A debounced key's burst: its pending run (the job the key's next enqueues collapse into, while it has not
-- started), when the burst began (`first_at`, from which `maxWait` counts), when its last enqueue came
-- (`last_at`) and when the key goes quiet (`quiet_at`: the last enqueue plus `delay`). `trailing_run` is false
-- while the pending run is a leading one (it runs at once). A row whose key is quiet and whose run started is
-- the same as no row, and is removed by sweep_enqueue_limits.
create table :GWL_SCHEMA.debounces (
  debounce_key text primary key,
  job_id bigint,
  first_at timestamptz not null,
  last_at timestamptz not null,
  quiet_at timestamptz not null,
  trailing_run boolean not null
);


-- 2. Rate-limited enqueue ---------------------------------------------------------------------------------
--
-- The window slides: at most `limit` jobs of a key are added in any `period`. Precisely, each enqueue that
-- adds a job is stamped with the database's clock when it holds the key's row; an enqueue at t is admitted
-- only if fewer than `limit` stamps are later than t - period, that is, if the key has fewer than `limit`
-- stamps or the oldest of its last `limit` is at most t - period (the stamps of a key grow with the order in
-- which its enqueues held the row). So for every instant t, the stamps in (t - period, t] number at most
-- `limit`. A refused enqueue is not stamped, nor is one that added no job (a duplicate of a unique job, a
-- replacement, a collapsed debounce). A key's log is its last `limit` stamps only: an admission reads one
-- of them and writes one.

-- A key's log (`p_rate`, its row) under `p_limit`: its stamps in the ring's order, and its oldest's place
-- (`pos`), the ring rebuilt (its last `p_limit` stamps, oldest first) if it was written under another limit.
create function :GWL_SCHEMA.rate_ring(p_rate :GWL_SCHEMA.enqueue_rates, p_limit int,
  out stamps timestamptz[], out pos int)
language plpgsql immutable as $$
begin
  if p_rate.lim is not distinct from p_limit then
    stamps := p_rate.stamps;
    pos := p_rate.pos;
  else
    stamps := array(select x.t from (select u.t from unnest(p_rate.stamps) as u(t) order by u.t desc
      limit p_limit) x order by x.t);
    pos := 1;
  end if;
end;
$$;

-- Locks the rate rows of `p_keys`, in key order (C collation), making the missing ones (empty logs).
create function :GWL_SCHEMA.lock_rates(p_keys text[]) returns void
language plpgsql volatile as $$
declare
  v_key text;
begin
  for v_key in select distinct u.k collate "C" from unnest(p_keys) as u(k) order by 1 loop
    loop
      perform 1 from :GWL_SCHEMA.enqueue_rates r where r.rate_key = v_key for update;
      exit when found;
      insert into :GWL_SCHEMA.enqueue_rates (rate_key, stamps, pos, lim, expires_at)
        values (v_key, '{}', 1, null, '-infinity') on conflict do nothing;
    end loop;
  end loop;
end;
$$;


-- 3. Debounce ---------------------------------------------------------------------------------------------
--
-- An enqueue at t of a key whose pending run has not started (not locked by a worker, no attempt) collapses
-- into it: the job becomes this enqueue's (task, queue, payload, priority, max attempts, flags; graphile-
-- worker's `replace` job key mode does the same), its run_at becomes least(t + delay, first_at + maxWait) (a
-- leading run keeps its run_at), and the answer is 'debounced' with the job. Otherwise the enqueue adds a new
-- job ('added'), which becomes the key's pending run:
--   - leading mode, key quiet (no enqueue in the last `delay`): a leading run, due now; a new burst;
--   - leading mode, the burst's leading run started and the key is not quiet: the burst's trailing run, at
--     least(t + delay, first_at + maxWait);
--   - otherwise: a new burst, its run at t + delay.
-- A worker that locks the pending run ends the burst: the collapsing update skips a row locked_at is set on
-- (it waits for a fetch that is locking it, then sees it), and the fetch skips the row while an enqueue is
-- updating it (graphile-worker fetches `for update skip locked`).

-- One debounced enqueue (`s` without a unique key), under its key's row, which it locks.
create function :GWL_SCHEMA.debounce_job(s :GWL_SCHEMA.job_spec, p_key text, p_delay_ms float8,
  p_max_wait_ms float8, p_leading boolean,
  out outcome text, out task_identifier text, out job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_row :GWL_SCHEMA.debounces;
  v_ids record;
  v_at timestamptz;
  v_delay interval := p_delay_ms * interval '1 millisecond';
  v_max_wait interval := p_max_wait_ms * interval '1 millisecond';
  v_first timestamptz;
  v_trailing boolean := true;
begin
  loop
    select * into v_row from :GWL_SCHEMA.debounces d where d.debounce_key = p_key for update;
    exit when found;
    insert into :GWL_SCHEMA.debounces (debounce_key, job_id, first_at, last_at, quiet_at, trailing_run)
      values (p_key, null, '-infinity', '-infinity', '-infinity', true) on conflict do nothing;
  end loop;
  v_at := clock_timestamp();
  select * into v_ids from :GWL_SCHEMA.task_and_queue_ids(s.identifier, s.queue_name);
  task_identifier := s.identifier;

  if v_row.job_id is not null then
    update :GRAPHILE_WORKER_SCHEMA._private_jobs j
      set task_id = v_ids.task_id,
          job_queue_id = v_ids.queue_id,
          payload = coalesce(s.payload, '{}'::json),
          priority = coalesce(s.priority, 0),
          max_attempts = coalesce(s.max_attempts, 25),
          flags = s.flags,
          run_at = case when v_row.trailing_run then least(v_at + v_delay, v_row.first_at + v_max_wait)
            else j.run_at end,
          revision = j.revision + 1,
          updated_at = now()
      where j.id = v_row.job_id and j.locked_at is null and j.attempts = 0
      returning * into job;
    if found then
      update :GWL_SCHEMA.debounces d set last_at = v_at, quiet_at = v_at + v_delay
        where d.debounce_key = p_key;
      outcome := 'debounced';
      return;
    end if;
  end if;

  if p_leading and v_at >= v_row.quiet_at then
    v_first := v_at;
    v_trailing := false;
    s.run_at := null;
  elsif p_leading and not v_row.trailing_run then
    v_first := v_row.first_at;
    s.run_at := least(v_at + v_delay, v_row.first_at + v_max_wait);
  else
    v_first := v_at;
    s.run_at := v_at + v_delay;
  end if;
  job := :GWL_SCHEMA.insert_job(s, v_ids.task_id, v_ids.queue_id, null, s.flags);
  update :GWL_SCHEMA.debounces d
    set job_id = job.id, first_at = v_first, last_at = v_at, quiet_at = v_at + v_delay,
      trailing_run = v_trailing
    where d.debounce_key = p_key;
  outcome := 'added';
end;
$$;

-- Locks the debounce rows of `p_keys`, in key order (C collation), making the missing ones.
create function :GWL_SCHEMA.lock_debounces(p_keys text[]) returns void
language plpgsql volatile as $$
declare
  v_key text;
begin
  for v_key in select distinct u.k collate "C" from unnest(p_keys) as u(k) order by 1 loop
    loop
      perform 1 from :GWL_SCHEMA.debounces d where d.debounce_key = v_key for update;
      exit when found;
      insert into :GWL_SCHEMA.debounces (debounce_key, job_id, first_at, last_at, quiet_at, trailing_run)
        values (v_key, null, '-infinity', '-infinity', '-infinity', true) on conflict do nothing;
    end loop;
  end loop;
end;
$$;


-- 4. Enqueueing with a rate or a debounce -----------------------------------------------------------------

-- One enqueue under a rate (p_rate_key not null) and/or a debounce (p_debounce_key not null), answered as
-- enqueue_job answers, with the outcome 'rateLimited' (no job) for an enqueue the rate refused. Announced to
-- the workers when `p_notify` and the job is due now.
--
-- The rate: a key whose window is full as last committed is refused without locking anything (its count
-- only grows until a stamp ages out), so that refusals inside a caller's open transaction hold up nobody.
-- A key without a row gets one with this enqueue's stamp (the insert locks it); if the enqueue then adds no
-- job, the row is removed again. Otherwise the row is locked, the room checked again, and the stamp written
-- once the job is added.
create function :GWL_SCHEMA.enqueue_job_limited(s :GWL_SCHEMA.job_spec, p_notify boolean,
  p_rate_key text, p_rate_limit int, p_rate_period_ms float8,
  p_debounce_key text, p_delay_ms float8, p_max_wait_ms float8, p_leading boolean,
  out outcome text, out task_identifier text, out job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_one record;
  v_rate :GWL_SCHEMA.enqueue_rates;
  v_stamps timestamptz[];
  v_pos int;
  v_at timestamptz;
  v_period interval := p_rate_period_ms * interval '1 millisecond';
  v_fresh boolean := false;
begin
  if p_rate_key is not null then
    loop
      v_at := clock_timestamp();
      select * into v_rate from :GWL_SCHEMA.enqueue_rates r where r.rate_key = p_rate_key;
      if not found then
        insert into :GWL_SCHEMA.enqueue_rates (rate_key, stamps, pos, lim, expires_at)
          values (p_rate_key, array[v_at], 1, p_rate_limit, v_at + v_period) on conflict do nothing;
        v_fresh := found;
        exit when v_fresh;
      end if;
      select r.stamps, r.pos into v_stamps, v_pos from :GWL_SCHEMA.rate_ring(v_rate, p_rate_limit) r;
      if v_rate.rate_key is not null and cardinality(v_stamps) >= p_rate_limit
        and v_stamps[v_pos] > v_at - v_period then
        outcome := 'rateLimited';
        task_identifier := s.identifier;
        return;
      end if;
      select * into v_rate from :GWL_SCHEMA.enqueue_rates r where r.rate_key = p_rate_key for update;
      -- (not found: its inserter rolled back; try again)
      exit when found;
    end loop;
    if not v_fresh then
      v_at := clock_timestamp();
      select r.stamps, r.pos into v_stamps, v_pos from :GWL_SCHEMA.rate_ring(v_rate, p_rate_limit) r;
      if cardinality(v_stamps) >= p_rate_limit and v_stamps[v_pos] > v_at - v_period then
        outcome := 'rateLimited';
        task_identifier := s.identifier;
        return;
      end if;
    end if;
  end if;
  if p_debounce_key is null then
    select * into v_one from :GWL_SCHEMA.enqueue_job(s, false);
  else
    select * into v_one from :GWL_SCHEMA.debounce_job(s, p_debounce_key, p_delay_ms, p_max_wait_ms,
      p_leading);
  end if;
  outcome := v_one.outcome;
  task_identifier := v_one.task_identifier;
  job := v_one.job;
  if p_rate_key is not null and outcome <> 'added' and v_fresh then
    delete from :GWL_SCHEMA.enqueue_rates r where r.rate_key = p_rate_key;
  elsif p_rate_key is not null and outcome = 'added' and not v_fresh then
    if cardinality(v_stamps) < p_rate_limit then
      v_stamps := v_stamps || v_at;
    else
      v_stamps[v_pos] := v_at;
      v_pos := v_pos % p_rate_limit + 1;
    end if;
    update :GWL_SCHEMA.enqueue_rates r
      set stamps = v_stamps, pos = v_pos, lim = p_rate_limit, expires_at = v_at + v_period
      where r.rate_key = p_rate_key;
  end if;
  if p_notify and outcome = 'added' and job.run_at <= now() then
    perform :GWL_SCHEMA.announce_jobs(1);
  end if;
end;
$$;

-- A batch with items under a rate or a debounce: the others (p_items and the next six parameters, as
-- enqueue_jobs takes them) go through enqueue_jobs first; then each item of `p_limited` (a JSON array of
-- job_spec fields plus rate_key, rate_limit, rate_period_ms, debounce_key, delay_ms, max_wait_ms and
-- leading_edge), in its order, through enqueue_job_limited. The rate and debounce rows of the whole batch are
-- locked first, in key order, so that two batches never wait for each other's keys in opposite orders.
-- Answers as enqueue_jobs does, the items of `p_limited` placed after the others (p_count + their place);
-- a duplicate whose on_duplicate is 'raise' aborts the batch with SQLSTATE GWLUQ as enqueue_jobs does.
create function :GWL_SCHEMA.enqueue_jobs_limited(p_items json, p_count int, p_scoped_key_count int,
  p_tasks text[], p_queues text[], p_park_pos int[], p_park_keys bigint[], p_limited json)
returns table (ord int, outcome text, task_identifier text, job :GRAPHILE_WORKER_SCHEMA._private_jobs)
language plpgsql volatile as $$
declare
  v_item record;
  v_one record;
  v_due int := 0;
begin
  perform :GWL_SCHEMA.lock_rates(array(
    select x.rate_key from json_to_recordset(p_limited) as x(rate_key text) where x.rate_key is not null));
  perform :GWL_SCHEMA.lock_debounces(array(
    select x.debounce_key from json_to_recordset(p_limited) as x(debounce_key text)
    where x.debounce_key is not null));
  if p_count > 0 then
    return query select * from :GWL_SCHEMA.enqueue_jobs(p_items, p_count, p_scoped_key_count, p_tasks,
      p_queues, p_park_pos, p_park_keys);
  end if;
  for v_item in
    select x.*, e.n::int as n
    from json_array_elements(p_limited) with ordinality as e(item, n)
    cross join lateral json_to_record(e.item) as x(identifier text, payload json, queue_name text,
      run_at timestamptz, max_attempts int, priority int, flags jsonb, unique_key text, scope text,
      window_seconds float8, on_duplicate text, rate_key text, rate_limit int, rate_period_ms float8,
      debounce_key text, delay_ms float8, max_wait_ms float8, leading_edge boolean)
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


-- 5. Sweep ------------------------------------------------------------------------------------------------
--
-- Neither table has an index on its time column: every admission or collapse changes that column, and an
-- index on it would make each of those updates write new index entries instead of a heap-only (HOT) update.
-- The sweep, at most once a minute per enqueuing process, reads the table instead.

-- Removes rate logs whose every stamp left the window and debounce rows whose key is quiet and whose run
-- started (or is gone); returns how many. Rows an enqueue holds right now are left for the next sweep.
create function :GWL_SCHEMA.sweep_enqueue_limits() returns bigint
language sql volatile as $$
  with rates as (
    delete from :GWL_SCHEMA.enqueue_rates r
    where r.rate_key in (
      select x.rate_key from :GWL_SCHEMA.enqueue_rates x where x.expires_at <= now()
      for update skip locked
    ) and r.expires_at <= now()
    returning 1
  ), debounces as (
    delete from :GWL_SCHEMA.debounces d
    where d.debounce_key in (
      select x.debounce_key from :GWL_SCHEMA.debounces x where x.quiet_at <= now()
      for update skip locked
    ) and d.quiet_at <= now()
      and not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j
        where j.id = d.job_id and j.locked_at is null and j.attempts = 0)
    returning 1
  )
  select (select count(*) from rates) + (select count(*) from debounces)
$$;
