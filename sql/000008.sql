-- graphile-worker-locks: a release with nobody in line reads its lines once; try_lock_all reads no table
-- for a job that does not wait in line.
--
-- Placeholders as in 000001.sql.
--
-- release_waiters ran, for each key, a statement per step of the hand-off (the releasing job's own place in
-- line, an early wake, the first waiter, the last wake) even when the key had no line at all, which is the
-- common case of a key in a lock group or of each limit of a job with several. It now looks at all its keys
-- in one statement first and returns when none has a waiter, an early wake or a wake. The caller holds the
-- keys' lines (lock_lines, before its unlocks), so a job that parks does so before that look or after this
-- release: the look never misses a parked job that the full pass would have woken. Otherwise the full pass
-- runs, unchanged.

create or replace function :GWL_SCHEMA.release_waiters(p_keys bigint[], p_job_ids bigint[]) returns int
language plpgsql volatile as $$
declare
  v_i int;
  v_key bigint;
  v_early bigint;
  v_unfetched boolean;
  v_announce int := 0;
  v_wake bigint[] := '{}';
begin
  if not exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = any(p_keys))
    and not exists (select 1 from :GWL_SCHEMA.prewakes p where p.lock_key = any(p_keys))
    and not exists (select 1 from :GWL_SCHEMA.wakes k where k.lock_key = any(p_keys)) then
    return 0;
  end if;
  for v_i in 1 .. coalesce(cardinality(p_keys), 0) loop
    v_key := p_keys[v_i];
    if p_job_ids[v_i] is not null then
      delete from :GWL_SCHEMA.waiters w where w.job_id = p_job_ids[v_i] and w.lock_key = v_key;
    end if;
    v_unfetched := null;
    delete from :GWL_SCHEMA.prewakes p where p.lock_key = v_key returning p.job_id into v_early;
    if v_early is not null and v_early is distinct from p_job_ids[v_i] then
      select j.locked_at is null into v_unfetched
        from :GWL_SCHEMA.wakes k
        join :GRAPHILE_WORKER_SCHEMA._private_jobs j on j.id = k.job_id
        where k.lock_key = v_key and k.job_id = v_early
          and k.at > clock_timestamp() - interval '2 seconds'
          -- parked again, it waits under a new job id in its old place
          and not exists (select 1 from :GWL_SCHEMA.waiters w where w.lock_key = v_key and w.pos = k.pos);
    end if;
    if v_unfetched is not null then
      update :GWL_SCHEMA.wakes k set at = clock_timestamp() where k.lock_key = v_key;
      perform pg_notify('gwl_release', v_key::text);
      if v_unfetched then
        v_announce := v_announce + 1;
      end if;
    else
      v_wake := v_wake || v_key;
    end if;
  end loop;
  perform :GWL_SCHEMA.announce_jobs(v_announce);
  return :GWL_SCHEMA.wake_waiters(v_wake, true);
end;
$$;

-- As in 000002.sql, with the line keys read from `p_limits` only for a `reschedule` job (`p_job_id`), the
-- only caller that orders by them, and without a statement: a job that does not wait in line runs no query
-- here, only its try-locks.
create or replace function :GWL_SCHEMA.try_lock_all(p_limits text, p_job_id bigint) returns text
language plpgsql volatile as $$
declare
  v_limits text[] := string_to_array(p_limits, ';');
  v_lines bigint[] := '{}';
  v_in_line bigint[] := '{}';
  v_i int;
  v_k bigint;
  v_got bigint;
  v_taken bigint[] := '{}';
begin
  if p_job_id is not null then
    for v_i in 1 .. cardinality(v_limits) loop
      v_lines := v_lines || nullif(split_part(v_limits[v_i], ':', 1), '')::bigint;
    end loop;
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
