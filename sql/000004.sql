-- graphile-worker-locks: rates (throttle per key) and pauses.
--
-- Contents, in order:
--   1. The data model: each throttled key's log of starts, the reservations of jobs over the rate, pauses.
--   2. The start of a throttled or pausable job (rate_start), in one statement.
--   3. Snooze and pause from inside a task.
--
-- What "at most `limit` starts in any `period`" means: for every instant t, the half-open window
-- [t, t + period) holds at most `limit` starts of the key, a start being the instant (the database's
-- clock_timestamp()) at which rate_start admitted the job. With `burst` (1 to `limit`), every window of
-- period * burst / limit also holds at most `burst` starts. A sliding log of each key's last `limit` starts
-- checks both exactly: a start at t is admitted when the limit-th latest start s has t >= s + period (and
-- the burst-th latest s' has t >= s' + period * burst / limit). rate_start serializes the starts of a key
-- on the key's row (for update), and reads the clock after taking it, so the log is in order.
--
-- A job over the rate is not run: it is given back to the queue (give_back_job, no attempt counted) to run
-- at the moment its slot frees, and reserves that moment (a reservation). Its copy's run_at is a little
-- ahead of the slot (`p_lead`), and a job whose slot is that near (within `p_wait`) keeps its reservation and
-- waits for the slot in its worker instead of being given back: so a job starts at its slot, not one fetch
-- after it. A job that comes for its reserved slot waits longer (`p_wait_reserved`): when the jobs before it
-- started late (a busy server, busy workers), its slot is later than planned, and giving it back again would
-- cost a fetch and add to the load that made them late. Reservations count as starts when
-- the next one is planned, so each job of a backlog is fetched about twice (once to reserve, once to run)
-- rather than once per freed slot. When a job is about to start, it is admitted only if its start fits the
-- actual starts (exactness rests on them alone) and also fits the plan of the reservations ahead of it: a
-- fresh job does not take a slot reserved for a job ahead of it, and so keeps its order behind them. A job
-- refused at its reserved moment (the jobs before it started later than planned) reserves again, keeping
-- its place in line (`pos`). A reservation counts only while its job exists: one whose job was deleted or
-- completed elsewhere stalls nobody, and is removed once it is older than a period.

-- 1. The data model ---------------------------------------------------------------------------------------

-- One row per throttled key: its readable name (gwl:v1:rate:<group>:<canonical JSON>), the limit and period
-- (and burst) of the last start (what `status` shows), and its last `lim` starts, ascending. The row is also the lock
-- that serializes the key's starts.
create table :GWL_SCHEMA.rates (
  rate_key bigint primary key,
  label text not null,
  lim int not null,
  burst int not null,
  period interval not null,
  starts timestamptz[] not null default '{}'
);

-- A job given back over the rate, to run at `at`: one per job (the copy that waits), in line by `pos`.
-- `run_at` is the job's run_at when it first met the rate: when its slot comes, its copy gets it back (less a
-- millisecond, wake_reserved), so that graphile-worker fetches it ahead of the jobs queued after it.
create table :GWL_SCHEMA.rate_reservations (
  job_id bigint primary key,
  rate_key bigint not null,
  at timestamptz not null,
  run_at timestamptz not null,
  pos bigint generated always as identity
);
create index on :GWL_SCHEMA.rate_reservations (rate_key, pos);
create index on :GWL_SCHEMA.rate_reservations (rate_key, at);

-- Paused keys (a rate's key, or a task's lock key): no job of the key starts before `until`. A row whose
-- `until` has passed means nothing; it is removed by the next pause.
create table :GWL_SCHEMA.pauses (
  pause_key bigint primary key,
  label text not null,
  until timestamptz not null
);

-- 2. The start of a throttled or pausable job ------------------------------------------------------------

-- The earliest instant >= p_now at which one more start fits a log (any order) under limit and burst: the
-- limit-th latest plus the period, the burst-th latest plus period * burst / limit.
create function :GWL_SCHEMA.rate_next(
  p_log timestamptz[],
  p_limit int,
  p_period interval,
  p_burst int,
  p_now timestamptz
) returns timestamptz
language sql immutable as $$
  select greatest(
    p_now,
    (select t from unnest(p_log) t order by t desc offset p_limit - 1 limit 1) + p_period,
    (select t from unnest(p_log) t order by t desc offset p_burst - 1 limit 1)
      + p_period * p_burst / p_limit
  )
$$;

-- Decides whether job p_job_id starts now, in one transaction: when a key of p_pause_keys is paused, it
-- goes back to the queue until the pause ends; else, with a rate (p_rate_key not null), it starts if it
-- fits the rate (see the top of this file), otherwise it waits for a near slot ('wait': `at` is the slot) or
-- goes back to the queue with a reservation of its slot ('rate'). Returns whether it was admitted, the
-- instant of its start or of its copy's run_at, the copy's id, why it was refused ('paused', 'rate' or
-- 'wait'), and the clock when it was decided.
--
-- A probe (`p_probe`) is the same decision for a job that has not taken its execution lock yet: it is
-- given back or told to wait as above, but where it would start it is answered 'free': no start is
-- counted, and the job reserves that moment. It takes its lock and then asks again for real (its
-- reservation lets it start). So a job the rate refuses never holds its key's lock, and the job whose slot
-- has come does not meet that lock held by one the rate refuses. A job that meets its lock held after all
-- is parked, and its copy keeps the reservation (give_back_job) and its place. `p_probed`: the start of a
-- job that probed and holds its lock.
create function :GWL_SCHEMA.rate_start(
  p_job_id bigint,
  p_rate_key bigint,
  p_label text,
  p_limit int,
  p_period interval,
  p_burst int,
  p_pause_keys bigint[],
  p_owner_pid int,
  p_wait interval,
  p_wait_reserved interval,
  p_lead interval,
  p_hold interval default interval '0',
  p_probe boolean default false,
  p_probed boolean default false
) returns table (admitted boolean, at timestamptz, copy_id bigint, reason text, now timestamptz)
language plpgsql volatile as $$
declare
  v_starts timestamptz[];
  v_now timestamptz;
  v_until timestamptz;
  v_pos bigint;
  v_actual timestamptz;
  v_plan timestamptz;
  v_copy bigint;
  v_run_at timestamptz;
  v_n int;
  v_ahead timestamptz[];
  v_at timestamptz;
begin
  -- A job that comes for its reserved slot at most `p_hold` ahead of it waits for it here, before it takes
  -- the key's row (so it holds up no other start): it is decided at its slot, however long the statement
  -- took to get here.
  if p_rate_key is not null and p_hold > interval '0' then
    select r.at into v_at from :GWL_SCHEMA.rate_reservations r
      where r.job_id = p_job_id and r.rate_key = p_rate_key;
    if v_at is not null and v_at > clock_timestamp() and v_at - clock_timestamp() <= p_hold then
      perform pg_sleep(extract(epoch from v_at - clock_timestamp()));
    end if;
  end if;
  if p_rate_key is not null then
    loop
      select r.starts into v_starts from :GWL_SCHEMA.rates r where r.rate_key = p_rate_key for update;
      exit when found;
      insert into :GWL_SCHEMA.rates (rate_key, label, lim, burst, period)
        values (p_rate_key, p_label, p_limit, p_burst, p_period) on conflict do nothing;
    end loop;
  end if;
  v_now := clock_timestamp();
  select max(p.until) into v_until from :GWL_SCHEMA.pauses p
    where p.pause_key = any(p_pause_keys) and p.until > v_now;
  if v_until is not null then
    v_copy := :GWL_SCHEMA.give_back_job(p_job_id, v_until, p_owner_pid);
    -- (a job with a reservation keeps its place in line: give_back_job passed it to the copy)
    update :GWL_SCHEMA.rate_reservations r set at = greatest(r.at, v_until)
      where r.job_id = v_copy;
    return query select false, v_until, v_copy, 'paused'::text, v_now;
    return;
  end if;
  if p_rate_key is null then
    return query select true, v_now, null::bigint, null::text, v_now;
    return;
  end if;

  select r.pos, r.at into v_pos, v_at from :GWL_SCHEMA.rate_reservations r
    where r.job_id = p_job_id and r.rate_key = p_rate_key;
  -- (the log is in order: its limit-th and burst-th latest are read by place)
  v_n := cardinality(v_starts);
  v_actual := greatest(
    v_now,
    case when v_n >= p_limit then v_starts[v_n - p_limit + 1] + p_period end,
    case when v_n >= p_burst then v_starts[v_n - p_burst + 1] + p_period * p_burst / p_limit end);
  -- The plan: the actual starts and the slots reserved by the live jobs ahead of this one (all, for a job
  -- that has none), the latest `limit` of them by place in line.
  v_ahead := array(
    select r.at from :GWL_SCHEMA.rate_reservations r
    where r.rate_key = p_rate_key and (v_pos is null or r.pos < v_pos)
      and exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = r.job_id)
    order by r.pos desc
    limit p_limit);
  v_plan := case when cardinality(v_ahead) = 0 then v_actual
    else :GWL_SCHEMA.rate_next(v_starts || v_ahead, p_limit, p_period, p_burst, v_now) end;
  -- A job that probed (its moment had come), then took its lock, is decided on the actual starts alone:
  -- a job ahead of it in the plan may be parked in its key's line (its reservation stands for a start not
  -- made yet), and refusing this one now would keep the lock held while it waits, or give it back twice.
  if p_probed and v_at is not null and v_at <= v_now then
    v_plan := v_actual;
  end if;

  if v_actual <= v_now and v_plan <= v_now and p_probe then
    -- A probe counts no start, but the job reserves this moment (or keeps its reservation, now), so that
    -- the probes after it plan their slots after it rather than all finding this one free.
    insert into :GWL_SCHEMA.rate_reservations as r (job_id, rate_key, at, run_at)
      select p_job_id, p_rate_key, v_now, j.run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j
      where j.id = p_job_id
      on conflict (job_id) do update set at = excluded.at;
    return query select false, v_now, null::bigint, 'free'::text, v_now;
    return;
  end if;
  if v_actual <= v_now and v_plan <= v_now then
    update :GWL_SCHEMA.rates r
      set starts = (v_starts || v_now)[greatest(1, cardinality(v_starts) + 2 - p_limit):],
        lim = p_limit, burst = p_burst, period = p_period, label = p_label
      where r.rate_key = p_rate_key;
    if v_pos is not null then
      delete from :GWL_SCHEMA.rate_reservations r where r.job_id = p_job_id;
    end if;
    -- Reservations of jobs that no longer exist, a period past their moment.
    delete from :GWL_SCHEMA.rate_reservations r
      where r.rate_key = p_rate_key and r.at < v_now - p_period
        and not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = r.job_id);
    return query select true, v_now, null::bigint, null::text, v_now;
    return;
  end if;

  v_plan := greatest(v_actual, v_plan);
  if v_plan - v_now <= (case when v_pos is null then p_wait else p_wait_reserved end) then
    -- Its slot is near: the job keeps it under its own id and waits for it where it is (no give-back).
    insert into :GWL_SCHEMA.rate_reservations as r (job_id, rate_key, at, run_at)
      select p_job_id, p_rate_key, v_plan, j.run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j
      where j.id = p_job_id
      on conflict (job_id) do update set at = excluded.at;
    return query select false, v_plan, null::bigint, 'wait'::text, v_now;
    return;
  end if;
  -- The copy is fetched a little ahead of its slot (p_lead), and waits for it as above.
  select j.run_at into v_run_at from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = p_job_id;
  v_copy := :GWL_SCHEMA.give_back_job(p_job_id, v_plan - p_lead, p_owner_pid);
  if v_copy is not null then
    -- (the flag tells the worker that fetches the copy that it comes for a reserved slot)
    update :GRAPHILE_WORKER_SCHEMA._private_jobs j
      set flags = coalesce(j.flags, '{}'::jsonb) || '{"gwl:rate": true}'::jsonb
      where j.id = v_copy;
    if v_pos is null then
      insert into :GWL_SCHEMA.rate_reservations (job_id, rate_key, at, run_at)
        values (v_copy, p_rate_key, v_plan, v_run_at);
    else
      update :GWL_SCHEMA.rate_reservations r set at = v_plan where r.job_id = v_copy;
    end if;
  end if;
  return query select false, v_plan - p_lead, v_copy, 'rate'::text, v_now;
end;
$$;

-- Makes the copies `p_job_ids`, given back over their rate, runnable now with the run_at their jobs had when
-- they first met the rate, less a millisecond (as a woken parked job gets back its own): graphile-worker
-- fetches by priority, then run_at, so they go ahead of the jobs queued after them, which would otherwise
-- all be fetched (each only to reserve a later slot) before a copy whose slot has come. Called by the process
-- that gave them back, a little ahead of their slots; a copy nobody wakes runs at its own run_at. Announces
-- them to every worker; returns how many were woken.
create function :GWL_SCHEMA.wake_reserved(p_job_ids bigint[]) returns int
language plpgsql volatile as $$
declare
  v_woken int;
begin
  update :GRAPHILE_WORKER_SCHEMA._private_jobs j
    set run_at = least(j.run_at, r.run_at - interval '1 millisecond')
    from :GWL_SCHEMA.rate_reservations r
    where r.job_id = j.id and j.id = any(p_job_ids) and j.locked_at is null;
  get diagnostics v_woken = row_count;
  perform :GWL_SCHEMA.announce_jobs(v_woken);
  return v_woken;
end;
$$;

-- 3. Snooze and pause from inside a task -------------------------------------------------------------------

-- Gives running job p_job_id back to the queue to run `p_delay` from now (the database's clock), without
-- counting its attempt. Returns the copy's id and its run_at.
create function :GWL_SCHEMA.snooze_job(p_job_id bigint, p_delay interval, p_owner_pid int)
returns table (copy_id bigint, run_at timestamptz)
language plpgsql volatile as $$
declare
  v_at timestamptz := clock_timestamp() + p_delay;
begin
  return query select :GWL_SCHEMA.give_back_job(p_job_id, v_at, p_owner_pid), v_at;
end;
$$;

-- Pauses key p_pause_key for `p_delay` from now (a longer pause already there stays), and gives running
-- job p_job_id back to the queue to run when the pause ends, without counting its attempt. Returns the
-- copy's id and the pause's end.
create function :GWL_SCHEMA.pause_key(
  p_job_id bigint,
  p_pause_key bigint,
  p_label text,
  p_delay interval,
  p_owner_pid int
) returns table (copy_id bigint, until timestamptz)
language plpgsql volatile as $$
declare
  v_now timestamptz := clock_timestamp();
  v_until timestamptz;
begin
  delete from :GWL_SCHEMA.pauses p where p.until <= v_now;
  insert into :GWL_SCHEMA.pauses as p (pause_key, label, until)
    values (p_pause_key, p_label, v_now + p_delay)
    on conflict (pause_key) do update set until = greatest(p.until, excluded.until), label = excluded.label
    returning p.until into v_until;
  return query select :GWL_SCHEMA.give_back_job(p_job_id, v_until, p_owner_pid), v_until;
end;
$$;
