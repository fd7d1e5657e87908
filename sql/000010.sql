-- graphile-worker-locks: a copy given back over its rate is woken at its slot as planned now, not as planned
-- when it was given back.
--
-- Placeholders as in 000001.sql.
--
-- A copy's slot is planned when it is given back, from the key's starts and the slots reserved ahead of it
-- (sql/000004.sql). Jobs ahead of it may start later than planned: a job whose start waits for its key's
-- lock, held by the job before it, starts when that one ends. The slots behind them then come later too, and
-- a copy woken at its old slot would find its slot gone, be given back again and be fetched a third time.
-- wake_reserved_planned plans each copy again when its process wakes it (a little ahead of its slot): a
-- copy whose slot is still near is woken as wake_reserved wakes it; one whose slot moved further than
-- `p_defer` keeps its reservation, moved to the new slot, its run_at moves with it (less `p_lead`, as
-- rate_start gives it), and it is answered so that its process wakes it then. wake_reserved stays for
-- processes of an earlier version.

-- Wakes the copies `p_job_ids`, given back over their rate, whose slot, planned again now, is at most
-- `p_defer` away; moves the others' reservations and run_at to their new slots and answers them (the copy,
-- its slot, the clock). Each key's copies are planned in their order in line, under the key's row (as
-- rate_start plans), keys in order. Announces the woken ones to every worker.
create function :GWL_SCHEMA.wake_reserved_planned(p_job_ids bigint[], p_defer interval, p_lead interval)
returns table (copy_id bigint, at timestamptz, now timestamptz)
language plpgsql volatile as $$
declare
  v_key bigint;
  v_rate :GWL_SCHEMA.rates;
  v_res record;
  v_now timestamptz;
  v_n int;
  v_actual timestamptz;
  v_plan timestamptz;
  v_ahead timestamptz[];
  v_woken int := 0;
begin
  for v_key in
    select distinct r.rate_key from :GWL_SCHEMA.rate_reservations r where r.job_id = any(p_job_ids)
    order by 1
  loop
    select * into v_rate from :GWL_SCHEMA.rates r where r.rate_key = v_key for update;
    v_now := clock_timestamp();
    for v_res in
      select r.job_id, r.pos, r.run_at from :GWL_SCHEMA.rate_reservations r
      where r.rate_key = v_key and r.job_id = any(p_job_ids)
      order by r.pos
    loop
      v_plan := v_now;
      if v_rate.rate_key is not null then
        v_n := cardinality(v_rate.starts);
        v_actual := greatest(
          v_now,
          case when v_n >= v_rate.lim then v_rate.starts[v_n - v_rate.lim + 1] + v_rate.period end,
          case when v_n >= v_rate.burst
            then v_rate.starts[v_n - v_rate.burst + 1] + v_rate.period * v_rate.burst / v_rate.lim end);
        v_ahead := array(
          select r.at from :GWL_SCHEMA.rate_reservations r
          where r.rate_key = v_key and r.pos < v_res.pos
            and exists (select 1 from :GRAPHILE_WORKER_SCHEMA._private_jobs j where j.id = r.job_id)
          order by r.pos desc
          limit v_rate.lim);
        v_plan := case when cardinality(v_ahead) = 0 then v_actual
          else greatest(v_actual, :GWL_SCHEMA.rate_next(v_rate.starts || v_ahead, v_rate.lim,
            v_rate.period, v_rate.burst, v_now)) end;
      end if;
      if v_plan > v_now + p_defer then
        update :GRAPHILE_WORKER_SCHEMA._private_jobs j set run_at = v_plan - p_lead
          where j.id = v_res.job_id and j.locked_at is null;
        if found then
          update :GWL_SCHEMA.rate_reservations r set at = v_plan where r.job_id = v_res.job_id;
          copy_id := v_res.job_id;
          at := v_plan;
          now := v_now;
          return next;
        end if;
      else
        update :GRAPHILE_WORKER_SCHEMA._private_jobs j
          set run_at = least(j.run_at, v_res.run_at - interval '1 millisecond')
          where j.id = v_res.job_id and j.locked_at is null;
        if found then
          v_woken := v_woken + 1;
        end if;
      end if;
    end loop;
  end loop;
  perform :GWL_SCHEMA.announce_jobs(v_woken);
end;
$$;
