-- graphile-worker-locks: the start of a job with a lock and a rate, counted in its lock statement.
--
-- Placeholders as in 000001.sql.
--
-- A job of a task with an execution lock and a rate (one slot, one limit) asks for both on the lock session,
-- in one call of lock_rated in its lock statement: it counts its start when rate_admit's first step would
-- (the key's log has room now, the key has no reservation and no key of the job is paused), and takes its
-- key. The start costs no round trip of its own, and a job that meets its key held counts nothing.
--
-- The rate is read first, as it is, without its row: where it would refuse the job (a pause, a reservation,
-- no room), nothing is taken and the job asks the rate on its own (rate_admit's probe), as a job with a lock
-- and a rate does without this function. So the rate still decides before the lock, a job over its rate goes
-- back to the queue rather than meet its key held, and a key is never taken and released in one call (its
-- line, if it has one, would miss that release's wake). Then the key is taken as the lock statement takes a
-- single key (a `reschedule` job, `p_job_id`, only if no parked job of the key is ahead of it: is_next), and
-- the start is counted under the key's row. (This version of the library sends only `drop` and `raise` jobs
-- this way, so `p_job_id` is null: src/exclusive/exclusive.ts says why `reschedule` jobs ask first. The
-- function takes them as the lock statement's single keys would, so that a later version can send them
-- without a new function.) Answers, as text:
--   null       the key was not taken (held elsewhere); nothing counted: the job meets its conflict strategy.
--   'w'        as null, for the `reschedule` job woken early for the key (WAIT_FOR_RELEASE in sql.ts).
--   '-'        nothing taken: the rate must decide first (it would refuse the job; or the key is held and
--              the job, a `reschedule` one, would park where rate_admit's probe would reserve its slot).
--   digits     the key taken and the start counted at that instant (microseconds since the epoch).
--   '~'        the key taken, the start not counted: the key's row was busy (another start holds it), or
--              changed since it was read; the job is admitted by rate_admit once it holds its key.
--   'L'        before digits or '~': others wait in line for the key (LOCKED_WITH_LINE in sql.ts).
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
    if p_job_id is not null and :GWL_SCHEMA.is_prewoken(p_key, p_job_id) then
      return 'w';
    end if;
    -- A `reschedule` job parks. Where its key is more than half used, or started a job in the last 100 ms,
    -- it asks the rate first instead, as rate_admit's probe would have it: it then parks holding a
    -- reservation, so that the jobs after it plan their slots after its own and go back to the queue
    -- rather than park behind the key as well.
    if p_job_id is not null and v_starts is not null and not (
      p_limit / 2 >= 1 and p_burst / 2 >= 1
      and (cardinality(v_starts) < p_limit / 2
        or v_starts[cardinality(v_starts) - p_limit / 2 + 1] + p_period <= clock_timestamp())
      and (cardinality(v_starts) < p_burst / 2
        or v_starts[cardinality(v_starts) - p_burst / 2 + 1] + p_period * p_burst / p_limit
          <= clock_timestamp())
      and (cardinality(v_starts) = 0
        or v_starts[cardinality(v_starts)] <= clock_timestamp() - interval '100 milliseconds')
    ) then
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
