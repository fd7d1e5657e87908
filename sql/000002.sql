-- graphile-worker-locks: several limits per job.
--
-- Placeholders as in 000001.sql.
--
-- A job with several limits (`limits`) runs only with one slot of each: try_lock_all takes them all or none,
-- in one call of the lock statement. Try-locks never wait, so two jobs that take the same keys in other
-- orders cannot deadlock; and what a call took is released in that call as soon as one limit has no free
-- slot, so a job that waits holds none of its slots.

-- `p_limits`: the job's limits in order, separated by ';', each its line key (slot 0) then ':' then the slots
-- to try, separated by ','. `p_job_id`: a `reschedule` job, which counts a limit as full while a job of that
-- limit's line is ahead of it (is_next), or null. Answers the slots taken, one per limit in order, separated
-- by ','; or, when a limit had no free slot, '!' and that limit's place (from 1), having released what it
-- took. Callers never pass a slot this session already holds (session locks are re-entrant, so that would
-- "succeed").
create function :GWL_SCHEMA.try_lock_all(p_limits text, p_job_id bigint) returns text
language plpgsql volatile as $$
declare
  v_limit text;
  v_i int := 0;
  v_k bigint;
  v_got bigint;
  v_taken bigint[] := '{}';
begin
  foreach v_limit in array string_to_array(p_limits, ';') loop
    v_i := v_i + 1;
    v_got := null;
    if p_job_id is null
      or :GWL_SCHEMA.is_next(split_part(v_limit, ':', 1)::bigint, p_job_id) then
      foreach v_k in array string_to_array(split_part(v_limit, ':', 2), ',')::bigint[] loop
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
