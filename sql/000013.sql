-- graphile-worker-locks: a `reschedule` job's rate asked in its lock statement too.
--
-- Placeholders as in 000001.sql.
--
-- lock_rated (sql/000012.sql) as there, but for a `reschedule` job (`p_job_id`), which this version of the
-- library sends too. Such a job rides only where its key is free:
-- - It takes its rate's row (`for update skip locked`) before it reads the rate and takes its key. A row
--   another start holds answers '-', nothing taken: the job asks the rate first, as a job with a lock and a
--   rate does without this function, and never holds its key while its rate decides it with no reservation
--   of its own (the copies whose slot came meanwhile would park behind it). The row stays taken to the end
--   of the statement, so the start counted is read under it: such a job's answer is '~' only for a row made
--   since it was read.
-- - Where it meets its key held (or a parked job of the key ahead of it), it answers '-', woken early for
--   the key or not: the job asks the rate first and parks, or waits for the release, as it would without
--   this function, holding its start or a reservation (rate_admit's probe, sql/000011.sql), so that the jobs
--   after it plan their slots after its own. (A job parked with nothing counted would come back to a period
--   whose slots the jobs behind it had taken meanwhile; one that waited for the release with its rate
--   undecided would hold the key while the rate decided it, and the key's line would wait behind it.)
--   So the answer 'w' is never given to such a job.
-- A `drop` or `raise` job reads the rate as before.

create or replace function :GWL_SCHEMA.lock_rated(
  p_key bigint,
  p_job_id bigint,
  p_rate_key bigint,
  p_label text,
  p_limit int,
  p_period interval,
  p_burst int,
  p_pause_keys bigint[]
) returns text
language plpgsql volatile as $$
declare
  v_at timestamptz;
  -- (the key's log and whether the rate, read as it is, refuses the job; null: the key has no row)
  v_starts timestamptz[];
  v_refused boolean;
  v_line text := '';
begin
  if cardinality(p_pause_keys) > 0 then
    perform from :GWL_SCHEMA.pauses p
      where p.pause_key = any(p_pause_keys) and p.until > clock_timestamp();
    if found then
      return '-';
    end if;
  end if;
  if p_job_id is not null then
    -- A `reschedule` job takes its rate's row before its key, skipping a row another start holds: it asks
    -- the rate first then ('-'), rather than hold its key while the rate decides it with no reservation
    -- of its own.
    perform from :GWL_SCHEMA.rates r where r.rate_key = p_rate_key for update skip locked;
    if not found then
      perform from :GWL_SCHEMA.rates r where r.rate_key = p_rate_key;
      if found then
        return '-';
      end if;
    end if;
  end if;
  select r.starts, r.reserved
      or (cardinality(r.starts) >= p_limit
        and r.starts[cardinality(r.starts) - p_limit + 1] + p_period > clock_timestamp())
      or (cardinality(r.starts) >= p_burst
        and r.starts[cardinality(r.starts) - p_burst + 1] + p_period * p_burst / p_limit
          > clock_timestamp())
    into v_starts, v_refused
    from :GWL_SCHEMA.rates r where r.rate_key = p_rate_key;
  if v_refused then
    return '-';
  end if;
  if not ((p_job_id is null or :GWL_SCHEMA.is_next(p_key, p_job_id))
      and pg_catalog.pg_try_advisory_lock(p_key)) then
    -- A `reschedule` job that meets its key held asks the rate first, as it would without this function
    -- (rate_admit's probe, sql/000011.sql): it then parks, or waits for the key's release if it was woken
    -- early for it, with its start counted or its slot reserved, never holding its key while the rate
    -- decides it.
    if p_job_id is not null then
      return '-';
    end if;
    return null;
  end if;
  if p_job_id is not null then
    -- (the first in line by the (lock_key, pos) index, as the lock statement's single keys read it)
    perform from :GWL_SCHEMA.waiters w where w.lock_key = p_key order by w.pos limit 1;
    if found then
      v_line := 'L';
    end if;
  end if;
  if v_refused is not null then
    -- (as rate_admit's first step: the log is in order, and the clock is read under the row)
    update :GWL_SCHEMA.rates r
      set starts = (r.starts || clock_timestamp())[greatest(1, cardinality(r.starts) + 2 - p_limit):],
        lim = p_limit, burst = p_burst, period = p_period, label = p_label
      from (
        select x.rate_key from :GWL_SCHEMA.rates x where x.rate_key = p_rate_key
        for update skip locked
      ) x
      where r.rate_key = x.rate_key and not r.reserved
        and (cardinality(r.starts) < p_limit
          or r.starts[cardinality(r.starts) - p_limit + 1] + p_period <= clock_timestamp())
        and (cardinality(r.starts) < p_burst
          or r.starts[cardinality(r.starts) - p_burst + 1] + p_period * p_burst / p_limit
            <= clock_timestamp())
      returning r.starts[cardinality(r.starts)] into v_at;
  else
    -- A key without a row has an empty log (sql/000006.sql), unless a job holds a reservation of it (one
    -- may outlive its key's row): its row is made then with the reservation's flag and no start, and the
    -- rate decides once the job holds its key ('~'). A row made since it was read makes nothing.
    insert into :GWL_SCHEMA.rates as r (rate_key, label, lim, burst, period, starts, reserved)
      select p_rate_key, p_label, p_limit, p_burst, p_period,
        case when v.reserved then '{}'::timestamptz[] else array[clock_timestamp()] end, v.reserved
      from (
        select exists (
          select from :GWL_SCHEMA.rate_reservations x where x.rate_key = p_rate_key
        ) as reserved
      ) v
      on conflict do nothing
      returning r.starts[1] into v_at;
  end if;
  if v_at is null then
    return v_line || '~';
  end if;
  return v_line || (extract(epoch from v_at) * 1000000)::bigint::text;
end;
$$;
