-- graphile-worker-locks: the sweep of throttled keys' logs and of ended pauses (see 000004.sql).
--
-- A throttled key's row (rates) means nothing once its newest start is a period old and no job of the key
-- holds a reservation: rate_start treats a missing row as an empty log, and such a log admits exactly what
-- an empty one does (every start in it left every window of `period`, and of period * burst / limit).
-- A pause whose end has passed means nothing either. Both are removed here, with the reservations of jobs
-- that no longer exist a period past their moment (rate_start removes those of a key only when the key
-- starts a job). Called by each worker about once a minute, and by `sweep()`. Rows a start holds right now
-- are left for the next sweep (skip locked): a sweep never waits for a start to end.

create function :GWL_SCHEMA.sweep_start_rates() returns bigint
language plpgsql volatile as $$
declare
  v_logs bigint;
  v_pauses bigint;
begin
  delete from :GWL_SCHEMA.rate_reservations v
    using :GWL_SCHEMA.rates r
    where r.rate_key = v.rate_key and v.at < clock_timestamp() - r.period
      and not exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = v.job_id);
  -- (the newest start is the log's last: it is kept in order)
  delete from :GWL_SCHEMA.rates r
    where r.rate_key in (
      select x.rate_key from :GWL_SCHEMA.rates x
      where coalesce(x.starts[cardinality(x.starts)] < clock_timestamp() - x.period, true)
        and not exists (select 1 from :GWL_SCHEMA.rate_reservations v where v.rate_key = x.rate_key)
      for update skip locked
    )
    and coalesce(r.starts[cardinality(r.starts)] < clock_timestamp() - r.period, true);
  get diagnostics v_logs = row_count;
  delete from :GWL_SCHEMA.pauses p
    where p.pause_key in (
      select x.pause_key from :GWL_SCHEMA.pauses x where x.until <= clock_timestamp()
      for update skip locked
    ) and p.until <= clock_timestamp();
  get diagnostics v_pauses = row_count;
  return v_logs + v_pauses;
end;
$$;
