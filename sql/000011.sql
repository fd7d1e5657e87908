-- graphile-worker-locks: the start of a job whose key is below its rate, in two short statements; and a
-- probe that counts its job's start when its key is at most half used.
--
-- Placeholders as in 000001.sql.
--
-- rate_start (sql/000004.sql) decides every start in full: its key's row, the pauses, the job's reservation,
-- the slots reserved ahead of it, the plan. Most starts of a throttled task meet a key with room and no job
-- waiting for a slot, and that decision needs only the key's row. rate_admit tries it first, in one update
-- of the row: it appends the start when the log has room now, the key has no reservation (`reserved`) and
-- no key of the job is paused; else it decides as rate_start does.
--
-- `reserved` is true while a job of the key may hold a reservation: set by a trigger whenever one is made
-- (always under the key's row, which the trigger updates), cleared by rate_admit when it finds none, under
-- the row. An update that waited for the row re-reads the row's latest version, `reserved` included, so a
-- reservation made by the start that held the row is never missed.
--
-- A probe (the job of a task with a lock and a rate, before it takes its lock) counts its start there when
-- the key is at most half used with it (`limit / 2` starts in the last period, and `burst / 2` in the last
-- period * burst / limit) and its latest start is at least 100 ms old: then the job takes its lock, and if
-- it meets its lock held, it does not start and its start is taken back (rate_refund). Such a start stands
-- for a lock statement's time, and the probes after it count nothing for 100 ms: so a key has at most one
-- at a time, and it refuses a job only if the key fills up to its limit meanwhile. (Without the 100 ms, the
-- probes of a burst of one key's jobs with a lock all counted starts, whose jobs then met the lock held by
-- the first: the jobs refused meanwhile planned their slots after starts that were then taken back, and a
-- period went under-used.) Otherwise a probe counts nothing and reserves its moment, as rate_start's probe
-- does, and the job is admitted once it holds its lock.
-- rate_start stays for processes of an earlier version.

alter table :GWL_SCHEMA.rates add column reserved boolean not null default false;
update :GWL_SCHEMA.rates r set reserved = true
  where exists (select from :GWL_SCHEMA.rate_reservations v where v.rate_key = r.rate_key);

create function :GWL_SCHEMA.rate_reserved() returns trigger
language plpgsql volatile as $$
begin
  update :GWL_SCHEMA.rates r set reserved = true where r.rate_key = new.rate_key and not r.reserved;
  return null;
end;
$$;
create trigger rate_reserved after insert on :GWL_SCHEMA.rate_reservations
  for each row execute function :GWL_SCHEMA.rate_reserved();

-- Decides whether job p_job_id starts now: the arguments and answer of rate_start. A probe that counted its
-- job's start answers admitted (its `at`: the start), where rate_start's answers 'free'.
create function :GWL_SCHEMA.rate_admit(
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
  p_hold interval,
  p_probe boolean,
  p_probed boolean
) returns table (admitted boolean, at timestamptz, copy_id bigint, reason text, now timestamptz)
language plpgsql volatile as $$
declare
  -- (the starts the key may have had in its last period, and in its last burst window, for this one to fit)
  v_room int := case when p_probe then p_limit / 2 else p_limit end;
  v_burst_room int := case when p_probe then p_burst / 2 else p_burst end;
  v_at timestamptz;
  v_paused boolean := false;
begin
  -- A job that comes for its reserved slot (p_hold), or that probed and holds its lock, has a reservation:
  -- its key does not qualify. (Each check is a statement of its own: a subquery in the update would cost
  -- more than the check, for every start.)
  if p_rate_key is not null and p_hold = interval '0' and not p_probed and v_burst_room >= 1 then
    if cardinality(p_pause_keys) > 0 then
      perform from :GWL_SCHEMA.pauses p
        where p.pause_key = any(p_pause_keys) and p.until > clock_timestamp();
      v_paused := found;
    end if;
    if not v_paused then
      -- (the log is in order: the latest starts are read by place; the clock is read under the row)
      update :GWL_SCHEMA.rates r
        set starts = (r.starts || clock_timestamp())[greatest(1, cardinality(r.starts) + 2 - p_limit):],
          lim = p_limit, burst = p_burst, period = p_period, label = p_label
        where r.rate_key = p_rate_key and not r.reserved
          and (cardinality(r.starts) < v_room
            or r.starts[cardinality(r.starts) - v_room + 1] + p_period <= clock_timestamp())
          and (cardinality(r.starts) < v_burst_room
            or r.starts[cardinality(r.starts) - v_burst_room + 1] + p_period * p_burst / p_limit
              <= clock_timestamp())
          and (not p_probe or cardinality(r.starts) = 0
            or r.starts[cardinality(r.starts)] <= clock_timestamp() - interval '100 milliseconds')
        returning r.starts[cardinality(r.starts)] into v_at;
      if not found then
        -- A key without a row has an empty log (sql/000006.sql); a reservation may outlive its key's row.
        perform from :GWL_SCHEMA.rate_reservations v where v.rate_key = p_rate_key limit 1;
        if not found then
          insert into :GWL_SCHEMA.rates (rate_key, label, lim, burst, period, starts)
            values (p_rate_key, p_label, p_limit, p_burst, p_period, array[clock_timestamp()])
            on conflict do nothing
            returning starts[1] into v_at;
        end if;
      end if;
      if v_at is not null then
        return query select true, v_at, null::bigint, null::text, v_at;
        return;
      end if;
    end if;
  end if;
  return query select * from :GWL_SCHEMA.rate_start(p_job_id, p_rate_key, p_label, p_limit, p_period,
    p_burst, p_pause_keys, p_owner_pid, p_wait, p_wait_reserved, p_lead, p_hold, p_probe, p_probed);
  -- (rate_start took the key's row: whether a reservation is left is read under it)
  if p_rate_key is not null then
    update :GWL_SCHEMA.rates r set reserved = false
      where r.rate_key = p_rate_key and r.reserved
        and not exists (select from :GWL_SCHEMA.rate_reservations v where v.rate_key = p_rate_key);
  end if;
end;
$$;

-- Takes back the start at `p_at_us` (microseconds since the epoch) of key p_rate_key, counted by the probe
-- of a job that then met its lock held and did not start. Returns whether it was still in the log.
create function :GWL_SCHEMA.rate_refund(p_rate_key bigint, p_at_us bigint) returns boolean
language plpgsql volatile as $$
declare
  v_at timestamptz := timestamptz 'epoch' + p_at_us * interval '1 microsecond';
begin
  -- (an update reads the row's latest version once it holds it, so the place is that of the latest log)
  update :GWL_SCHEMA.rates r
    set starts = r.starts[:array_position(r.starts, v_at) - 1]
      || r.starts[array_position(r.starts, v_at) + 1:]
    where r.rate_key = p_rate_key and array_position(r.starts, v_at) is not null;
  return found;
end;
$$;
