-- graphile-worker-locks: several limits per job.
--
-- Placeholders as in 000001.sql.
--
-- A job with several limits (`limits`) runs only with one slot of each: try_lock_all takes them all or none,
-- in one call of the lock statement. Try-locks never wait, so two jobs that take the same keys in other
-- orders cannot deadlock; and what a call took is released in that call as soon as one limit has no free
-- slot, so a job that waits holds none of its slots.

-- `p_limits`: the job's limits in order, separated by ';', each its line key (slot 0; empty for a limit of
-- several slots) then ':' then the slots to try, separated by ','. `p_job_id`: a `reschedule` job, or null. Answers the slots taken, one per limit
-- in order, separated by ','; or, when a limit had no free slot, '!' and that limit's place (from 1), having
-- released what it took. Callers never pass a slot this session already holds (session locks are
-- re-entrant, so that would "succeed").
--
-- A `reschedule` job counts a limit of one slot as full while a job of that limit's line is ahead of it
-- (is_next): a job fetched for the first time parks behind the jobs waiting for any such limit. A limit of
-- several slots takes any free slot, as a task's own semaphore does: its line keeps one wake on its way at
-- a time, so ordered by it, jobs woken together by releases of different slots would turn each other away. A job that waits in
-- the line of one of its limits (woken from it, or fetched by its safety net) is ordered by that line only:
-- were it also ordered by its other limits' lines, the first job of one line could wait behind the first
-- of another that waits behind it, and both lines would stop.
create function :GWL_SCHEMA.try_lock_all(p_limits text, p_job_id bigint) returns text
language plpgsql volatile as $$
declare
  v_limits text[] := string_to_array(p_limits, ';');
  v_lines bigint[];
  v_in_line bigint[] := '{}';
  v_i int;
  v_k bigint;
  v_got bigint;
  v_taken bigint[] := '{}';
begin
  select array_agg(nullif(split_part(l, ':', 1), '')::bigint order by o) into v_lines
    from unnest(v_limits) with ordinality as u(l, o);
  if p_job_id is not null then
    select coalesce(array_agg(k), '{}') into v_in_line from unnest(v_lines) as u(k)
      where k is not null and (exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = u.k and w.job_id = p_job_id)
         or exists (select 1 from :GWL_SCHEMA.wakes k where k.lock_key = u.k and k.job_id = p_job_id));
  end if;
  for v_i in 1 .. cardinality(v_limits) loop
    v_got := null;
    if p_job_id is null or v_lines[v_i] is null
      or (cardinality(v_in_line) > 0 and not (v_lines[v_i] = any(v_in_line)))
      or :GWL_SCHEMA.is_next(v_lines[v_i], p_job_id) then
      foreach v_k in array string_to_array(split_part(v_limits[v_i], ':', 2), ',')::bigint[] loop
        if pg_catalog.pg_try_advisory_lock(v_k) then
          v_got := v_k;
          exit;
        end if;
      end loop;
    end if;
    if v_got is null then
      foreach v_k in array v_taken loop
        perform pg_catalog.pg_advisory_unlock(v_k);
      end loop;
      return '!' || v_i;
    end if;
    v_taken := v_taken || v_got;
  end loop;
  return array_to_string(v_taken, ',');
end;
$$;
