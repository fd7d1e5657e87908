/**
 * Every SQL statement the library sends, built once per `Locks` instance from the two escaped schema names.
 */

/** Quotes a PostgreSQL identifier. */
export function escapeIdentifier(name: string): string {
  return `"${name.replaceAll('"', '""')}"`;
}

const THIS_DATABASE = "(select oid from pg_catalog.pg_database where datname = current_database())";

/**
 * How many of the given keys (as pg_locks shows them: classid, objid) some session holds. Reads the lock
 * table only: it never takes a lock, not even briefly.
 */
function heldCount(classids: string, objids: string): string {
  return `(select count(*) from pg_catalog.pg_locks l
      join unnest(${classids}::oid[], ${objids}::oid[]) as s(classid, objid)
        on l.classid = s.classid and l.objid = s.objid
      where l.locktype = 'advisory' and l.objsubid = 1 and l.granted
        and l.database = ${THIS_DATABASE})`;
}

/** The first branch of both lock batches: the unlocks of $1 that PostgreSQL answered false (op 0). */
const FAILED_UNLOCKS = `select 0 as op, t.i::int as i, null::text as key
        from unnest($1::bigint[]) with ordinality as t(k, i)
        where not pg_catalog.pg_advisory_unlock(t.k)`;

const ADD_JOB_ARGS = `identifier => $1::text,
    payload => $2::json,
    queue_name => $3::text,
    run_at => $4::timestamptz,
    max_attempts => $5::int,
    job_key => $6::text,
    priority => $7::int,
    flags => $8::text[],
    job_key_mode => $9::text`;

export function makeSql(schema: string, workerSchema: string, preparedStatements = true) {
  const s = escapeIdentifier(schema);
  const w = escapeIdentifier(workerSchema);
  return {
    escapedSchema: s,
    escapedWorkerSchema: w,

    /**
     * A query config, named (so PostgreSQL parses and plans it once per connection) unless prepared
     * statements are off. Names include both schemas: one pool may serve several `Locks` instances.
     */
    statement(
      name: string,
      text: string,
      values: unknown[],
    ): { name?: string; text: string; values: unknown[] } {
      return preparedStatements
        ? { name: `gwl_${name}/${schema}/${workerSchema}`, text, values }
        : { text, values };
    },

    /**
     * One round trip for every lock and unlock request that queued up while the previous one was in
     * flight. $1: keys to unlock; $2: single keys to try; $3: semaphore requests, each a comma-separated
     * list of slot keys tried in order; $4: keys whose waiters to wake (see sql/000003.sql), with $7 the
     * job ids that released them (sql/000006.sql), which runs after the unlocks; $5: for each single key
     * of $2, the job id of a `reschedule` job, which takes the key only if no parked job of that key is
     * ahead of it (sql/000004.sql), or null; $6: held keys whose first waiter to wake early (prewake), with
     * $8 whether to announce those wakes to every worker (false when a worker of this process will fetch them,
     * sql/000007.sql).
     */
    lockBatch: {
      name: `gwl_lock_batch_v7`,
      // Only failures come back for unlocks and single keys (rows are the costly part of a busy batch):
      // every request without a row succeeded, except that a \`reschedule\` job's success comes back (op 5)
      // when others wait in line for the key, and its failure says (op 4) whether it was woken early and
      // should wait for the release. Semaphore requests answer with the slot they took; op 6 names the
      // job each early wake woke.
      text: `${FAILED_UNLOCKS}
      union all
      select case
          when r.got then 5
          when r.job is not null and ${s}.is_prewoken(r.k, r.job) then 4
          else 1
        end, r.i::int, null
        from (
          select t.k, t.job, t.i, case
              when t.job is null or ${s}.is_next(t.k, t.job) then pg_catalog.pg_try_advisory_lock(t.k)
              else false
            end as got
          from unnest($2::bigint[], $5::bigint[]) with ordinality as t(k, job, i)
          offset 0
        ) r
        where not r.got or (r.job is not null and (
          -- (the first in line by the (lock_key, pos) index: a plain exists() here turns into a scan of the whole
          -- table once statistics were taken with a long line in it)
          select w.pos from ${s}.waiters w where w.lock_key = r.k order by w.pos limit 1
        ) is not null)
      union all
      select 2, t.i::int, ${s}.try_lock_first(string_to_array(t.slots, ',')::bigint[])::text
        from unnest($3::text[]) with ordinality as t(slots, i)
      union all
      select 3, ${s}.release_waiters($4::bigint[], $7::bigint[]), null where cardinality($4::bigint[]) > 0
      union all
      select 6, p.i, p.job_id::text from ${s}.prewake($6::bigint[], $8::boolean) p where cardinality($6::bigint[]) > 0`,
    },

    /**
     * `lockBatch` for the common batch: unlocks of holds without a line and single keys without a job
     * waiting its turn, nothing else. The same answers (op 0, op 1), from a statement PostgreSQL runs in about
     * two thirds of the time: no semaphore, wake or early-wake branch to start up and skip.
     */
    lockBatchPlain: {
      name: `gwl_lock_plain_v1`,
      text: `${FAILED_UNLOCKS}
      union all
      select 1, t.i::int, null
        from unnest($2::bigint[]) with ordinality as t(k, i)
        where not pg_catalog.pg_try_advisory_lock(t.k)`,
    },

    /** The channel on which a release tells the session of a job woken early that its key is free. */
    releaseChannel: "gwl_release",

    /** Replaces this session's rows in the holder registry with the locks it holds now. */
    writeHolders: `with gone as (
        delete from ${s}.lock_holders
        where pid = pg_backend_pid() and not (lock_key = any($1::bigint[]))
      )
      insert into ${s}.lock_holders (pid, lock_key, task_identifier, job_id, since)
      select pg_backend_pid(), u.k, u.t, u.j, u.s
      from unnest($1::bigint[], $2::text[], $3::bigint[], $4::timestamptz[]) as u(k, t, j, s)
      on conflict (pid, lock_key) do update
        set task_identifier = excluded.task_identifier, job_id = excluded.job_id, since = excluded.since`,

    /** Drops registry rows of this backend (a reused pid) and of sessions that no longer exist. */
    cleanHolders: `delete from ${s}.lock_holders h
      where h.pid = pg_backend_pid()
         or not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = h.pid)`,

    heartbeat: "select 1",

    /** $1, $2: classids and objids of the keys; $3: how many of them must be held to call it unavailable. */
    lockAvailable: `select ${heldCount("$1", "$2")} < $3::int as available`,

    addJob: `select * from ${w}.add_job(
    ${ADD_JOB_ARGS}
  )`,

    /**
     * add_job, gated by the preemptive check: the condition does not depend on the function's output, so
     * PostgreSQL evaluates it once, before calling add_job at all (a one-time filter). $10, $11, $12 as
     * $1, $2, $3 of `lockAvailable`.
     */
    addJobIfAvailable: `select * from ${w}.add_job(
    ${ADD_JOB_ARGS}
  ) where ${heldCount("$10", "$11")} < $12::int`,

    /**
     * One unique enqueue (see sql/000002.sql), optionally gated by the preemptive check ($12-$14 as $1-$3
     * of `lockAvailable`). The job's columns are expanded from the function's result, so a new column of
     * graphile-worker's table comes along without a change here.
     */
    addUniqueJob: (gated: boolean) => `select r.outcome, t.identifier as task_identifier, (r.job).*
      from ${s}.add_unique_job(row($1::text, $2::json, $3::text, $4::timestamptz, $5::int, $6::int, $7::jsonb,
        $8::text, $9::text, $10::float8, $11::text, null)::${s}.unique_job_spec) r
      left join ${w}._private_tasks t on t.id = (r.job).task_id
      ${gated ? `where ${heldCount("$12", "$13")} < $14::int` : ""}`,

    /**
     * A batch of enqueues in one statement (sql/000011.sql): $1 a JSON array of bulk_job_spec, $2 its length,
     * $3 how many are `first`, $4 and $5 the batch's distinct task identifiers and queue names (which the items
     * name by place), $6 and $7 for each item added waiting in line its place among the items without a
     * unique key and its lock key, or nulls. Answers with rows of graphile-worker's job table, one per item
     * in order, or (when not every item was added) with a trailing row that places them.
     */
    addUniqueJobs: `select * from ${s}.add_unique_jobs_flat($1::json, $2::int, $3::int, $4::text[], $5::text[],
      $6::int[], $7::bigint[])`,

    sweepUniqueWindows: `select ${s}.sweep_unique_windows()::int as removed`,

    jobById: `select j.*, t.identifier as task_identifier from ${w}._private_jobs j
      join ${w}._private_tasks t on t.id = j.task_id where j.id = $1::bigint`,

    /** The `reschedule` strategy: park the job as a waiter of its key, then wake it if the key is already free. */
    parkJob: `with p as (
        select * from ${s}.park_job($1::bigint, $2::timestamptz, $3::bigint,
          $4::float8 * interval '1 millisecond', $5::timestamptz)
      ), marked as (
        insert into ${s}.parked_originals (job_id, owner_pid) select $1::bigint, $6::int from p
          on conflict (job_id) do update set owner_pid = excluded.owner_pid, parked_at = now()
      )
      select p.id::text as id, p.run_at from p`,
    /** Gives a job back to the queue without counting its attempt (sql/000014.sql): its copy's id. */
    deferJob: `select ${s}.defer_job($1::bigint, $2::timestamptz, $3::int)::text as id`,
    /** Makes deferred copies runnable now (the lock session is back). */
    runDeferred: `update ${w}._private_jobs set run_at = now()
      where id = any($1::bigint[]) and locked_at is null and run_at > now()`,
    /** Removes given-up rows of jobs that parked or were deferred and were never completed. */
    cleanParked: `select job_id::text as job_id from ${s}.clean_parked()`,
    wakeIfFree: `select ${s}.wake_if_free($1::bigint[], $2::bigint, $3::bigint) as woken`,
    sweepWaiters: `select ${s}.sweep_waiters()::int + ${s}.sweep_prewakes()::int as removed`,

    heldLocks: `select lock_key::text as lock_key, task_identifier, job_id::text as job_id, pid,
        application_name, since, session_started_at
      from ${s}.held_locks order by since nulls last, lock_key`,
  };
}

export type Sql = ReturnType<typeof makeSql>;
