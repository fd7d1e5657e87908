/**
 * Every SQL statement the library sends, built once per `Locks` instance from the two escaped schema names.
 */
import { createHash } from "node:crypto";
import { InvalidArgumentError } from "./errors.js";
import { rateStatements } from "./rates/statements.js";

/** Quotes a PostgreSQL identifier. */
export function escapeIdentifier(name: string): string {
  return `"${name.replaceAll('"', '""')}"`;
}

/** PostgreSQL's longest identifier, in bytes (a longer one is cut short, silently naming another schema). */
const MAX_IDENTIFIER_BYTES = 63;

/**
 * Checks a schema name option: any characters PostgreSQL can hold in a quoted identifier (so not NUL),
 * 1 to 63 bytes. The name is then used exactly as given, quoted.
 */
export function assertSchemaName(option: string, name: unknown): asserts name is string {
  if (typeof name !== "string" || name.length === 0) {
    throw new InvalidArgumentError(
      `\`${option}\` must be a non-empty string, got ${typeof name === "string" ? '""' : String(name)}`,
    );
  }
  if (name.includes("\0")) {
    throw new InvalidArgumentError(`\`${option}\` must not contain a NUL character`);
  }
  const bytes = Buffer.byteLength(name, "utf8");
  if (bytes > MAX_IDENTIFIER_BYTES) {
    throw new InvalidArgumentError(
      `\`${option}\` is ${bytes} bytes long; PostgreSQL names are at most ${MAX_IDENTIFIER_BYTES} bytes (a longer one would be cut short)`,
    );
  }
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

/**
 * What each row of a lock statement's answer says (its `op` column), with `i` the request's place (from 1)
 * among the statement's unlocks, single keys, semaphore requests or early wakes.
 */
export const BatchOp = {
  /**
   * The backend that ran the statement: its pid is `i` (the session checks it is the one it connected to),
   * and `key` is 'reset' when it no longer carries the session's mark.
   */
  BACKEND: 7,
  /** The unlock of $1[i] returned false. */
  UNLOCK_FAILED: 0,
  /** The single key $2[i] was not taken. */
  LOCK_FAILED: 1,
  /** Semaphore request $3[i] took the slot `key` (null: none). */
  SLOT: 2,
  /** How many parked jobs the releases woke (`i`); nothing to decode. */
  WOKEN: 3,
  /** The single key $2[i] was not taken, and its `reschedule` job is the one woken early: it waits for the release. */
  WAIT_FOR_RELEASE: 4,
  /** The single key $2[i] was taken by a `reschedule` job, and others wait in line for it. */
  LOCKED_WITH_LINE: 5,
  /** The early wake of $6[i]'s line woke job `key`. */
  PREWOKEN: 6,
  /**
   * Request $11[i] of a job with several limits took the slots `key` (comma-separated, one per limit), or
   * none: `key` is '!' and the place (from 1) of the limit that was full.
   */
  STACKED: 8,
  /**
   * Request i of a job with a lock and a rate (`ratedBranch`): `key` is lock_rated's answer (sql/000013.sql):
   * null, the key not taken (as LOCK_FAILED); '-', nothing taken (the rate must decide first; a `reschedule`
   * job's answer wherever its key was not taken); digits, the key taken and the start counted at that instant (µs since the epoch); '~',
   * the key taken, the start not counted; 'L' before digits or '~', others wait in line for the key.
   */
  RATED: 9,
} as const;

/**
 * The custom setting a lock session marks its backend with (claimBackend, connection.ts), for the life of
 * the backend or until something resets it. PostgreSQL takes any two-part name as a placeholder setting.
 */
export const CLAIM_SETTING = "graphile_worker_locks.session";

/** The session's mark on the backend running the statement. */
const MARK = `pg_catalog.current_setting('${CLAIM_SETTING}', true)`;

/**
 * Marks the backend with $1 unless a mark is there already, in one statement (claimBackend, connection.ts):
 * its pid, and whether the mark is now $1.
 */
export const CLAIM_BACKEND = `select pg_catalog.pg_backend_pid() as pid,
       pg_catalog.set_config('${CLAIM_SETTING}',
         case when coalesce(${MARK}, '') = '' then $1::text else ${MARK} end,
         false) = $1::text as claimed`;

/**
 * The first branch of both lock statements: the backend that ran the statement, and (`key` not null)
 * whether that backend lost the session's mark, `$t` (it was reset, which also ends its session locks).
 */
function backendRow(t: number): string {
  return `select ${BatchOp.BACKEND} as op, pg_catalog.pg_backend_pid() as i,
        case when ${MARK} is distinct from $${t}::text then 'reset' end as key`;
}

/**
 * The condition every other branch of a lock statement runs under: the statement runs on the session's own
 * backend, whose pid is the parameter `$n`, still carrying the session's mark, `$n+1`. It does not depend on
 * any row, so PostgreSQL tests it once, before the branch reads its first row (a one-time filter): a
 * statement that a pooler sent to another backend, or that found its backend reset, takes and releases
 * nothing, and answers only with the backend's pid and whether it was reset.
 */
function onOwnBackend(n: number): string {
  return `pg_catalog.pg_backend_pid() = $${n}::int and ${MARK} = $${n + 1}::text`;
}

/** The unlocks of $1 that PostgreSQL answered false, under `onOwnBackend(pidParam)`. */
function failedUnlocks(pidParam: number): string {
  return `select ${BatchOp.UNLOCK_FAILED}, t.i::int, null
        from unnest($1::bigint[]) with ordinality as t(k, i)
        where ${onOwnBackend(pidParam)} and not pg_catalog.pg_advisory_unlock(t.k)`;
}

/**
 * The branch of a lock statement for requests of jobs with a lock and a rate (lock_rated, sql/000012.sql),
 * from parameter `$first`: their keys, `reschedule` jobs' ids (null for the others),
 * rate keys, labels, limits, periods (ms), bursts and pause keys (each request's, comma-separated). Under
 * `onOwnBackend(pidParam)`.
 */
function ratedBranch(s: string, first: number, pidParam: number): string {
  const p = (n: number) => `$${first + n}`;
  return `
      union all
      select ${BatchOp.RATED}, t.i::int, ${s}.lock_rated(t.k, t.job, t.rk, t.label, t.lim,
          t.per * interval '1 millisecond', t.burst, string_to_array(t.pause, ',')::bigint[])
        from unnest(${p(0)}::bigint[], ${p(1)}::bigint[], ${p(2)}::bigint[], ${p(3)}::text[],
          ${p(4)}::int[], ${p(5)}::float8[], ${p(6)}::int[], ${p(7)}::text[])
          with ordinality as t(k, job, rk, label, lim, per, burst, pause, i)
        where ${onOwnBackend(pidParam)}`;
}

/**
 * Which branches a lock statement carries besides its unlocks ($1) and single keys ($2), each present only
 * when its batch has requests for it. A branch that a statement carries costs PostgreSQL its executor
 * set-up on every call even when its parameters are empty (see bench/README.md, section "A lock statement
 * of the branches its batch uses").
 */
export interface LockShape {
  /** Single keys of `reschedule` jobs, which take a free key only when no parked job is ahead (is_next). */
  lines: boolean;
  /** Semaphore requests: several slots, the first free one taken. */
  slots: boolean;
  /** Requests of jobs with several limits through try_lock_all (a line, or a limit of several slots). */
  stacked: boolean;
  /**
   * Requests of jobs with several limits, each limit one key and no line: the most limits of any (0: none
   * such), taken all or nothing by one expression (`fastStackedBranch`).
   */
  fastLimits: number;
  /** Single keys asked with their job's rate (`ratedBranch`). */
  rated: boolean;
  /** Lines to lock before the unlocks and wake after them (release_waiters). */
  wakes: boolean;
  /** Early wakes of the next job in line of held keys (prewake). */
  prewakes: boolean;
  /**
   * The wakes and early wakes go in a second statement of the same transaction (`wakeStatementText`), sent
   * in the same write behind a Flush (two-part.ts): the lock statement then carries only the line locks of
   * the keys to wake, and its answer comes back before the wakes run.
   */
  split?: boolean;
}

/** A shape's name: `plain`, or its branches joined by `_` (`_rated` last). */
export function lockShapeId(shape: LockShape): string {
  const parts: string[] = [];
  if (shape.lines) parts.push("lines");
  if (shape.slots) parts.push("slots");
  if (shape.stacked) parts.push("stacked");
  if (shape.fastLimits > 0) parts.push(`limits${shape.fastLimits}`);
  if (shape.split) {
    if (shape.wakes) parts.push("linelocks");
  } else {
    if (shape.wakes) parts.push("wakes");
    if (shape.prewakes) parts.push("prewakes");
  }
  if (parts.length === 0) parts.push("plain");
  if (shape.rated) parts.push("rated");
  return parts.join("_");
}

/**
 * The parameters of a lock statement of `shape`, numbered in this order (`batchQuery`, batch.ts, gives the
 * values in the same order): $1 keys to unlock; $2 single keys to try; $3, $4 the pid of the session's
 * backend and the session's mark on it (`onOwnBackend`); then, for each branch present, `lines`: each
 * single key's `reschedule` job id or null; `slots`: each semaphore request's slot keys, comma-separated,
 * tried in order; `stacked`: each request's limits (`line:slot,slot;...`, try_lock_all in sql/000002.sql)
 * and its `reschedule` job's id or null; `fastLimits` arrays of keys, the n-th holding each request's n-th
 * limit's key (null past its last limit); `rated`: the eight arrays of `ratedBranch`; `wakes`: the line keys
 * to wake and the job that released each; `prewakes`: the held keys whose first waiter to wake early, and
 * whether to announce those wakes to every worker (false when a worker of this process will fetch them).
 */
export function lockStatementParams(shape: LockShape) {
  let next = 5;
  const take = (n: number) => {
    const first = next;
    next += n;
    return first;
  };
  return {
    lines: shape.lines ? take(1) : 0,
    slots: shape.slots ? take(1) : 0,
    stacked: shape.stacked ? take(2) : 0,
    fastLimits: shape.fastLimits > 0 ? take(shape.fastLimits) : 0,
    rated: shape.rated ? take(8) : 0,
    // (split: only the keys, for their line locks)
    wakes: shape.wakes ? take(shape.split ? 1 : 2) : 0,
    prewakes: shape.prewakes && !shape.split ? take(3) : 0,
  };
}

/** The name of the wake statement of `shape` (split): `wakes`, `prewakes` or both. */
function wakeShapeId(shape: LockShape): string {
  return [shape.wakes ? "wakes" : "", shape.prewakes ? "prewakes" : ""].filter(Boolean).join("_");
}

/**
 * The wakes of a split lock statement (`LockShape.split`), run in its transaction right after it: $1, $2 the
 * session's backend and mark (`onOwnBackend`); then, for `wakes`, the line keys to wake and the job that
 * released each (release_waiters; the lock statement locked their lines before its unlocks); for
 * `prewakes`, the held keys whose first waiter to wake early and whether to announce those wakes. Answers
 * PREWOKEN rows as the lock statement would.
 */
export function wakeStatementText(s: string, shape: LockShape): string {
  const wakes = shape.wakes ? 3 : 0;
  const prewakes = shape.prewakes ? (shape.wakes ? 5 : 3) : 0;
  return wakeBranches(s, wakes, prewakes, onOwnBackend(1)).join(`
      union all`);
}

/**
 * The wakes of a lock statement, as branches of a union under `own`: release_waiters of the line keys at
 * parameter `$wakes` and the jobs that released them (the next parameter), and prewake of the held keys at
 * `$prewakes` and whether to announce them (the next); 0 leaves a branch out.
 */
function wakeBranches(s: string, wakes: number, prewakes: number, own: string): string[] {
  const branches: string[] = [];
  if (wakes > 0) {
    branches.push(`
      select ${BatchOp.WOKEN}, ${s}.release_waiters($${wakes}::bigint[], $${wakes + 1}::bigint[]), null
        where ${own}`);
  }
  if (prewakes > 0) {
    branches.push(`
      select ${BatchOp.PREWOKEN}, p.i, p.job_id from ${s}.prewake_line($${prewakes}::bigint[], $${prewakes + 1}::boolean, $${prewakes + 2}::bigint[]) p
        where ${own}`);
  }
  return branches;
}

/**
 * All or nothing, for each request of several limits of one key each, in one expression: each key is tried
 * in order and, at the first one not taken, the keys taken before it are unlocked and the answer is '!' and
 * that limit's place (from 1); else the keys taken, comma-separated. PostgreSQL evaluates a CASE's branches
 * only as reached, in order.
 */
function allOrNothing(keys: string[], place = 0): string {
  if (place === keys.length) return `concat_ws(',', ${keys.join(", ")})`;
  const undo = keys
    .slice(0, place)
    .reverse()
    .map((k) => `pg_catalog.pg_advisory_unlock(${k})`);
  const failed =
    undo.length === 0
      ? `'!${place + 1}'`
      : `'!${place + 1}' || left(concat(${undo.join(", ")}), 0)`;
  const tried = `pg_catalog.pg_try_advisory_lock(${keys[place]})`;
  // (a request with fewer limits than the statement's has nulls after its last)
  const taken = place === 0 ? tried : `${keys[place]} is null or ${tried}`;
  return `case when ${taken} then ${allOrNothing(keys, place + 1)} else ${failed} end`;
}

/**
 * The text of a lock statement of `shape` (parameters: `lockStatementParams`). PostgreSQL runs its branches
 * in order: the lines of the keys whose waiters to wake are locked before the unlocks, so that a job parking
 * meanwhile sees this statement's wake; requests are tried after the unlocks, so that a key freed by the
 * statement passes on in it; the wakes and early wakes come last (`split`: in a second statement of its
 * transaction, `wakeStatementText`). Besides the backend's pid, only failures
 * come back for unlocks and single keys (rows are the costly part of a busy batch): every request without a
 * row succeeded, except that a `reschedule` job's success comes back (LOCKED_WITH_LINE) when others wait in
 * line for the key, and its failure says (WAIT_FOR_RELEASE) whether it was woken early and should wait for
 * the release. Semaphore requests answer with the slot they took, each request of several limits with the
 * slots it took or the limit that was full (STACKED), and PREWOKEN names the job each early wake woke.
 */
export function lockStatementText(s: string, shape: LockShape): string {
  const p = lockStatementParams(shape);
  const own = onOwnBackend(3);
  let text = backendRow(4);
  if (shape.wakes) {
    // (the line locks of sql/000007.sql, in key order; count() is never below 0, so no row comes back)
    text += `
      union all
      select ${BatchOp.WOKEN}, 0, null
        where (select count(pg_catalog.pg_advisory_xact_lock(${s}.line_lock_high(u.k), ${s}.line_lock_low(u.k)))
          from (select distinct d.k from unnest($${p.wakes}::bigint[]) as d(k) where ${own} order by d.k) u) < 0`;
  }
  text += `
      union all
      ${failedUnlocks(3)}`;
  if (shape.lines) {
    text += `
      union all
      select case
          when r.got then ${BatchOp.LOCKED_WITH_LINE}
          when r.job is not null and ${s}.is_prewoken(r.k, r.job) then ${BatchOp.WAIT_FOR_RELEASE}
          else ${BatchOp.LOCK_FAILED}
        end, r.i::int, null
        from (
          select t.k, t.job, t.i, case
              when t.job is null or ${s}.is_next(t.k, t.job) then pg_catalog.pg_try_advisory_lock(t.k)
              else false
            end as got
          from unnest($2::bigint[], $${p.lines}::bigint[]) with ordinality as t(k, job, i)
          where ${own}
          offset 0
        ) r
        where not r.got or (r.job is not null and (
          -- (the first in line by the (lock_key, pos) index: a plain exists() here turns into a scan of the whole
          -- table once statistics were taken with a long line in it)
          select w.pos from ${s}.waiters w where w.lock_key = r.k order by w.pos limit 1
        ) is not null)`;
  } else {
    text += `
      union all
      select ${BatchOp.LOCK_FAILED}, t.i::int, null
        from unnest($2::bigint[]) with ordinality as t(k, i)
        where ${own} and not pg_catalog.pg_try_advisory_lock(t.k)`;
  }
  if (shape.slots) {
    text += `
      union all
      select ${BatchOp.SLOT}, t.i::int, ${s}.try_lock_first(string_to_array(t.slots, ',')::bigint[])::text
        from unnest($${p.slots}::text[]) with ordinality as t(slots, i)
        where ${own}`;
  }
  if (shape.stacked) {
    text += `
      union all
      select ${BatchOp.STACKED}, t.i::int, ${s}.try_lock_all(t.limits, t.job)
        from unnest($${p.stacked}::text[], $${p.stacked + 1}::bigint[]) with ordinality as t(limits, job, i)
        where ${own}`;
  }
  if (shape.fastLimits > 0) {
    const keys = Array.from({ length: shape.fastLimits }, (_, n) => `t.k${n + 1}`);
    const params = keys.map((_, n) => `$${p.fastLimits + n}::bigint[]`);
    text += `
      union all
      select ${BatchOp.STACKED}, t.i::int, ${allOrNothing(keys)}
        from unnest(${params.join(", ")}) with ordinality as t(${keys.map((k) => k.slice(2)).join(", ")}, i)
        where ${own}`;
  }
  if (shape.rated) text += ratedBranch(s, p.rated, 3);
  // (split: the wakes go in the wake statement; its line locks above stay here)
  if (shape.split) return text;
  for (const branch of wakeBranches(s, p.wakes, p.prewakes, own))
    text += `
      union all${branch}`;
  return text;
}

const ADD_JOB_ARGS = `identifier => $1::text,
    payload => $2::json,
    queue_name => $3::text,
    run_at => $4::timestamptz,
    max_attempts => $5::int,
    priority => $6::int,
    flags => $7::text[],
    job_key => $8::text,
    job_key_mode => $9::text`;

export function makeSql(schema: string, workerSchema: string, preparedStatements = true) {
  const s = escapeIdentifier(schema);
  const w = escapeIdentifier(workerSchema);
  // Prepared statement names are cut at 63 bytes by PostgreSQL: the schemas go in as a short digest.
  const schemas = createHash("sha256")
    .update(`${schema}\0${workerSchema}`)
    .digest("hex")
    .slice(0, 16);
  /**
   * The answer of an enqueue function `call` (one answering `outcome`, `task_identifier` and `job`):
   * `columns` first, then `outcome`, the job's task identifier and the job's columns, expanded from the
   * function's result so that a new column of graphile-worker's table comes along without a change here.
   */
  const enqueueAnswer = (columns: string, call: string, after = "") =>
    `select ${columns}r.outcome, r.task_identifier, (r.job).*${after} from ${call} r`;
  /**
   * A bulk answer's `superseded` column: for an item added whose key (`$n`, a bigint array by `ord`) is not
   * null, the jobs that `supersede` (sql/000003.sql) removed. Evaluated row by row in the caller's
   * transaction, after every item of the batch is in: a later item of a key removes an earlier one of the
   * batch that waits.
   */
  const supersedeColumn = (n: number) =>
    `, case when r.outcome = 'added' and ($${n}::bigint[])[r.ord] is not null
        then ${s}.supersede(($${n}::bigint[])[r.ord], (r.job).id) end as superseded`;
  const lockStatements = new Map<string, { name: string; text: string }>();
  /** The statement named `gwl_<id>`, its text made once per `Locks` instance. */
  const shaped = (id: string, text: () => string) => {
    let statement = lockStatements.get(id);
    if (!statement) {
      statement = { name: `gwl_${id}`, text: text() };
      lockStatements.set(id, statement);
    }
    return statement;
  };
  return {
    /** Rates, snooze and pause (rates/statements.ts). */
    rates: rateStatements(s, w),
    /**
     * A query config, named (so PostgreSQL parses and plans it once per connection) unless prepared
     * statements are off. Names include both schemas (as a digest): one pool may serve several `Locks`
     * instances.
     */
    statement(
      name: string,
      text: string,
      values: unknown[],
    ): { name?: string; text: string; values: unknown[] } {
      return preparedStatements
        ? { name: `gwl_${name}_${schemas}`, text, values }
        : { text, values };
    },

    /**
     * The lock statement of a batch of this `shape` (see `lockStatementText`), named by its shape: each shape
     * is prepared once per session, and carries only the branches its batch uses.
     */
    lockStatement(shape: LockShape): { name: string; text: string } {
      return shaped(`lock_${lockShapeId(shape)}`, () => lockStatementText(s, shape));
    },

    /** The wake statement of a split lock statement of `shape` (`wakeStatementText`), named by its branches. */
    wakeStatement(shape: LockShape): { name: string; text: string } {
      return shaped(`wake_${wakeShapeId(shape)}`, () => wakeStatementText(s, shape));
    },

    /**
     * After a lock statement failed for want of resources (SQLSTATE class 53, `isOutOfResources`): releases the
     * keys of $1 (the keys it was to lock or unlock) that the backend still holds, under `onOwnBackend(2)`.
     * Session locks outlive the failed statement's transaction, so what it took before it failed, and what it
     * had not yet released, is still held: after this, none of $1 is. It needs no entry of the full lock table:
     * pg_locks is read under a fast-path relation lock, and an unlock frees an entry. Also answers the
     * backend's pid and mark (`checkBackend`) and the settings that size the lock table, for the warning.
     */
    reconcileLocks: {
      name: `gwl_lock_reconcile`,
      text: `select pg_catalog.pg_backend_pid() as pid, ${MARK} is not distinct from $3::text as marked,
        (select count(*)::int from unnest($1::bigint[]) as u(k)
          where ${onOwnBackend(2)} and case when exists (
              select 1 from pg_catalog.pg_locks l
              where l.pid = pg_catalog.pg_backend_pid() and l.locktype = 'advisory' and l.objsubid = 1
                and l.granted and l.classid = ((u.k >> 32) & 4294967295)::oid
                and l.objid = (u.k & 4294967295)::oid
            ) then pg_catalog.pg_advisory_unlock(u.k) else false end) as released,
        pg_catalog.current_setting('max_locks_per_transaction')::int as max_locks_per_transaction,
        pg_catalog.current_setting('max_connections')::int as max_connections,
        pg_catalog.current_setting('max_prepared_transactions')::int as max_prepared_transactions`,
    },

    /** Wakes the lines of released keys ($1, released by the jobs $2), as a lock statement does after its unlocks. */
    releaseWaiters: `select ${s}.release_waiters($1::bigint[], $2::bigint[]) as woken`,

    /** The channel on which a release tells the session of a job woken early that its key is free. */
    releaseChannel: "gwl_release",

    /**
     * The channel on which a superseding enqueue tells every lock session that the jobs of a key older than
     * the new one are superseded (payload `<key>:<new job id>`; `supersede` in sql/000003.sql).
     */
    supersedeChannel: "gwl_supersede",

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

    /**
     * At connect: drops registry rows of this backend (a reused pid) and of sessions that no longer exist, and
     * registers this session's process ($1, its pid) and host ($2) in `lock_sessions`.
     */
    registerSession: `with gone_holders as (
        delete from ${s}.lock_holders h
        where h.pid = pg_backend_pid()
           or not exists (select 1 from pg_catalog.pg_stat_activity a where a.pid = h.pid)
      ), gone_sessions as (
        delete from ${s}.lock_sessions g
        where g.pid <> pg_backend_pid()
          and not exists (select 1 from pg_catalog.pg_stat_activity a
            where a.pid = g.pid and a.backend_start = g.backend_start)
      )
      insert into ${s}.lock_sessions (pid, backend_start, process_id, host)
      select a.pid, a.backend_start, $1::int, $2::text
      from pg_catalog.pg_stat_activity a where a.pid = pg_backend_pid()
      on conflict (pid) do update
        set backend_start = excluded.backend_start, process_id = excluded.process_id, host = excluded.host`,

    /**
     * Answers with the backend's pid, which the session checks is the one it connected to, and whether the
     * backend still carries the session's mark ($1).
     */
    heartbeat: `select pg_catalog.pg_backend_pid() as pid, ${MARK} is not distinct from $1::text as marked`,

    /**
     * How many slots of each limit some session holds: $1, $2 the classids and objids of every limit's
     * slots, $3 the limit (from 0) of each; one row per limit with a slot held.
     */
    limitsHeld: `select s.i, count(*)::int as held
      from unnest($1::oid[], $2::oid[], $3::int[]) as s(classid, objid, i)
      join pg_catalog.pg_locks l on l.classid = s.classid and l.objid = s.objid
      where l.locktype = 'advisory' and l.objsubid = 1 and l.granted and l.database = ${THIS_DATABASE}
      group by s.i`,

    /** $1, $2: classids and objids of the keys; $3: how many of them must be held to call it unavailable. */
    lockAvailable: `select ${heldCount("$1", "$2")} < $3::int as available`,

    /** A job with a job key of the caller's, through graphile-worker's add_job (which owns job keys). */
    addJobWithJobKey: `select * from ${w}.add_job(
    ${ADD_JOB_ARGS}
  )`,

    /**
     * `addJobWithJobKey`, gated by the preemptive check: the condition does not depend on the function's
     * output, so PostgreSQL evaluates it once, before calling add_job at all (a one-time filter). $10, $11,
     * $12 as $1, $2, $3 of `lockAvailable`.
     */
    addJobWithJobKeyIfAvailable: `select * from ${w}.add_job(
    ${ADD_JOB_ARGS}
  ) where ${heldCount("$10", "$11")} < $12::int`,

    /**
     * One enqueue (enqueue_job in sql/000001.sql), optionally gated by the preemptive check ($12-$14 as $1-$3
     * of `lockAvailable`), or superseding (`supersede` in sql/000003.sql, for a job added: $12 its key; the
     * answer's `superseded` column lists the waiting jobs it removed, each `{ id, task }`). Answers as
     * `enqueueJobs` does, without `ord`.
     */
    enqueueJob: (gated: boolean, superseding = false) => `${enqueueAnswer(
      "",
      `${s}.enqueue_job(row($1::text, $2::json, $3::text, $4::timestamptz, $5::int, $6::int, $7::jsonb,
        $8::text, $9::text, $10::float8, $11::text, null, null, null, null)::${s}.job_spec, true)`,
      superseding
        ? `, case when r.outcome = 'added' then ${s}.supersede($12::bigint, (r.job).id) end as superseded`
        : "",
    )}
      ${gated ? `where ${heldCount("$12", "$13")} < $14::int` : ""}`,

    /**
     * A batch of enqueues in one statement (enqueue_jobs in sql/000001.sql): $1 a JSON array of job_spec,
     * $2 its length, $3 how many of its keys are scoped (each one's first item is marked `first`), $4 and
     * $5 the batch's distinct task identifiers and queue names (which the items name by place), $6 and $7
     * for each item added waiting in line its place among the items without a unique key and its lock key,
     * or nulls. Answers one row per item: `ord` (its place, from 1), `outcome`, `task_identifier` and the
     * job's columns (all null for no job). `superseding`: $8 the key each item supersedes (by `ord`; null for
     * an item that does not), and the answer's `superseded` column as `enqueueJob`'s, per item added.
     */
    enqueueJobs: (superseding: boolean) =>
      enqueueAnswer(
        "r.ord, ",
        `${s}.enqueue_jobs($1::json, $2::int, $3::int, $4::text[], $5::text[], $6::int[], $7::bigint[])`,
        superseding ? supersedeColumn(8) : "",
      ),

    /**
     * One enqueue under a rate and/or a debounce (enqueue_job_limited in sql/000005.sql): $1-$11 as
     * `enqueueJob`, then the rate ($12 key, $13 limit, $14 period in ms) and the debounce ($15 key, $16
     * delay and $17 maxWait in ms, $18 leading), nulls for none; optionally gated by the preemptive check
     * ($19-$21 as $1-$3 of `lockAvailable`). Answers as `enqueueJob` does.
     */
    enqueueJobLimited: (gated: boolean) => `${enqueueAnswer(
      "",
      `${s}.enqueue_job_limited(row($1::text, $2::json, $3::text, $4::timestamptz, $5::int, $6::int, $7::jsonb,
        $8::text, $9::text, $10::float8, $11::text, null, null, null, null)::${s}.job_spec, true,
        $12::text, $13::int, $14::float8, $15::text, $16::float8, $17::float8, $18::boolean)`,
    )}
      ${gated ? `where ${heldCount("$19", "$20")} < $21::int` : ""}`,

    /**
     * `enqueueJobs` for a batch with rate-limited or debounced items (enqueue_jobs_limited in
     * sql/000005.sql): $1-$7 as `enqueueJobs` for the other items, $8 a JSON array of the limited ones.
     * Answers as `enqueueJobs` does, the limited items placed after the others; `superseding`: $9 as $8 of
     * `enqueueJobs`.
     */
    enqueueJobsLimited: (superseding: boolean) =>
      enqueueAnswer(
        "r.ord, ",
        `${s}.enqueue_jobs_limited($1::json, $2::int, $3::int, $4::text[], $5::text[], $6::int[], $7::bigint[],
        $8::json)`,
        superseding ? supersedeColumn(9) : "",
      ),

    sweepUniqueWindows: `select ${s}.sweep_unique_windows()::int as removed`,

    /** Removes rate logs and debounce rows that no longer count (sweep_enqueue_limits in sql/000005.sql). */
    sweepEnqueueLimits: `select ${s}.sweep_enqueue_limits()::int as removed`,
    /** Removes throttled keys' logs that no longer count and ended pauses (sql/000006.sql). */
    sweepStartRates: `select ${s}.sweep_start_rates()::int as removed`,

    jobById: `select j.*, t.identifier as task_identifier from ${w}._private_jobs j
      join ${w}._private_tasks t on t.id = j.task_id where j.id = $1::bigint`,

    /** The `reschedule` strategy: park the job as a waiter of its key, then wake it if the key is already free. */
    parkJob: `select p.id::text as id, p.run_at from ${s}.park_job($1::bigint, $2::timestamptz, $3::bigint,
      $4::float8 * interval '1 millisecond', $5::timestamptz, $6::int) p`,
    /** Gives a job back to the queue without counting its attempt: its copy's id. */
    deferJob: `select ${s}.defer_job($1::bigint, $2::timestamptz, $3::int)::text as id`,
    /** Makes deferred copies runnable now (the lock session is back). */
    runDeferred: `update ${w}._private_jobs set run_at = now()
      where id = any($1::bigint[]) and locked_at is null and run_at > now()`,
    /** Removes the rows of jobs given back (parked or deferred) that graphile-worker will never complete. */
    cleanGivenBack: `select job_id::text as job_id from ${s}.clean_given_back()`,
    wakeIfFree: `select ${s}.wake_if_free($1::bigint[], $2::bigint, $3::bigint) as woken`,
    joinLine: `select ${s}.join_line($1::bigint, $2::bigint, $3::bigint[]) as ahead`,
    /** Asks the jobs waiting at their workers in the line of key $1 to look at it again (sql/000014.sql). */
    lineChanged: `select pg_catalog.pg_notify('gwl_release', $1::text || '/?')`,
    sweepWaiters: `select ${s}.sweep_waiters()::int + ${s}.sweep_prewakes()::int as removed`,

    /** $1: the lock keys to show, or null for all. */
    heldLocks: `select lock_key::text as lock_key, task_identifier, job_id::text as job_id, pid,
        process_id, host, application_name, since, session_started_at
      from ${s}.held_locks where $1::bigint[] is null or lock_key = any($1::bigint[])
      order by since nulls last, lock_key`,
  };
}

export type Sql = ReturnType<typeof makeSql>;
