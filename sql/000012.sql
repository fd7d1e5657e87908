-- graphile-worker-locks: the start of a job with a lock and a rate, counted in its lock statement.
--
-- Placeholders as in 000001.sql.
--
-- A job of a task with an execution lock and a rate (`drop` or `raise`, one slot, no line) asks for both on
-- the lock session, in one call of lock_rated in its lock statement: it takes the key, then counts its
-- start when rate_admit's first step would (the key's log has room now, the key has no reservation and no
-- key of the job is paused). The start costs no round trip of its own, and a job that meets its key held
-- counts nothing. Answers, as text:
--   null       the key was not taken (held elsewhere), and the rate would let the job start: nothing
--              counted, and the job meets its conflict strategy.
--   digits     the key is held and the start counted at that instant (microseconds since the epoch).
--   '-'        the key has a pause, a reservation or no room: the key was not taken, or released again in
--              this call, and the job asks the rate on its own (rate_admit's probe), as every job with a
--              lock and a rate did before this function: so the rate still decides first, and a job over
--              its rate goes back to the queue rather than meet its key held.
--   '~'        the key is held, and the key's row was busy (another start holds it) or was being made by
--              another start: nothing counted; the job is admitted by rate_admit while it holds its key.
--
-- The lock session never waits for a row another start holds (skip locked). The one wait left is an insert
-- that meets a row another start is making, for the rest of that start's own statement: no statement that
-- makes a key's row holds it longer (rate_start sleeps, when it does, before it takes the row).
--
-- The statement runs in its own transaction: a start counted by a lock statement that then fails rolls back
-- with it. A start counted by a statement whose answer is lost with the connection stays counted, as the
-- start of a job that then loses its key does (the key admits one start fewer in that period).

create function :GWL_SCHEMA.lock_rated(
  p_key bigint,
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
begin
  if not pg_catalog.pg_try_advisory_lock(p_key) then
    -- (the rate's row read as it is: a start that holds it decides later, as the probe's does)
    if cardinality(p_pause_keys) > 0 then
      perform from :GWL_SCHEMA.pauses p
        where p.pause_key = any(p_pause_keys) and p.until > clock_timestamp();
      if found then
        return '-';
      end if;
    end if;
    perform from :GWL_SCHEMA.rates r
      where r.rate_key = p_rate_key and (r.reserved
        or (cardinality(r.starts) >= p_limit
          and r.starts[cardinality(r.starts) - p_limit + 1] + p_period > clock_timestamp())
        or (cardinality(r.starts) >= p_burst
          and r.starts[cardinality(r.starts) - p_burst + 1] + p_period * p_burst / p_limit
            > clock_timestamp()));
    if found then
      return '-';
    end if;
    return null;
  end if;
  if cardinality(p_pause_keys) > 0 then
    perform from :GWL_SCHEMA.pauses p
      where p.pause_key = any(p_pause_keys) and p.until > clock_timestamp();
    if found then
      perform pg_catalog.pg_advisory_unlock(p_key);
      return '-';
    end if;
  end if;
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
  if v_at is null then
    perform from :GWL_SCHEMA.rates x where x.rate_key = p_rate_key for update skip locked;
    if found then
      -- (its row, now held by this call: a reservation, or no room)
      perform pg_catalog.pg_advisory_unlock(p_key);
      return '-';
    end if;
    perform from :GWL_SCHEMA.rates x where x.rate_key = p_rate_key;
    if found then
      return '~';
    end if;
    -- A key without a row has an empty log (sql/000006.sql); a reservation may outlive its key's row.
    perform from :GWL_SCHEMA.rate_reservations v where v.rate_key = p_rate_key limit 1;
    if found then
      perform pg_catalog.pg_advisory_unlock(p_key);
      return '-';
    end if;
    insert into :GWL_SCHEMA.rates (rate_key, label, lim, burst, period, starts)
      values (p_rate_key, p_label, p_limit, p_burst, p_period, array[clock_timestamp()])
      on conflict do nothing
      returning starts[1] into v_at;
    if v_at is null then
      return '~';
    end if;
  end if;
  return (extract(epoch from v_at) * 1000000)::bigint::text;
end;
$$;
