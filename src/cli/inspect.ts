/**
 * The operator CLI's reads: what `status` shows and what `check` diagnoses. Read-only: every connection
 * opened here runs with `default_transaction_read_only`, so nothing is written.
 */
import { randomInt, randomUUID } from "node:crypto";
import { readdir } from "node:fs/promises";
import pg from "pg";
import { TESTED_WORKER_SCHEMAS } from "../migrate.js";
import { backendPid, isDirect, probeTransactionPooling } from "../session/backend.js";
import { readHeldLocks } from "../held-locks.js";
import { readPaused, readThrottled } from "../rates/status.js";
import { escapeIdentifier, makeSql } from "../sql.js";
import type { HeldLock } from "../types.js";

const UNDEFINED_TABLE = "42P01";
const INVALID_SCHEMA_NAME = "3F000";

export interface Target {
  connectionString: string;
  /** The lock session's own connection, when it differs (`worker.locks.lockConnectionString`). */
  lockConnectionString?: string;
  schema: string;
  workerSchema: string;
}

function readOnlyConfig(connectionString: string): pg.ClientConfig {
  return {
    connectionString,
    application_name: "graphile-worker-locks-cli",
    options: "-c default_transaction_read_only=on",
  };
}

export function readOnlyClient(connectionString: string): pg.Client {
  return new pg.Client(readOnlyConfig(connectionString));
}

/** The schema level of a `migrations` table, or null when it does not exist. */
export async function schemaLevel(client: pg.Client, schema: string): Promise<number | null> {
  try {
    const { rows } = await client.query<{ level: number | null }>(
      `select max(id)::int as level from ${escapeIdentifier(schema)}.migrations`,
    );
    return rows[0]?.level ?? 0;
  } catch (error) {
    const code = (error as { code?: string }).code;
    if (code === UNDEFINED_TABLE || code === INVALID_SCHEMA_NAME) return null;
    throw error;
  }
}

/** The highest migration this package ships. */
async function latestLibraryLevel(): Promise<number> {
  const files = await readdir(new URL("../../sql/", import.meta.url));
  return Math.max(
    0,
    ...files.filter((f) => /^\d{6}\.sql$/.test(f)).map((f) => Number.parseInt(f, 10)),
  );
}

export interface Status {
  /** The held-locks view's rows, as JSON carries them (key and time as strings). */
  held: Array<
    Omit<HeldLock, "lockKey" | "since" | "sessionStartedAt"> & {
      lockKey: string;
      since: string | null;
    }
  >;
  lines: Array<{ lockKey: string; waiting: number; oldestSince: string; nextWake: string | null }>;
  uniqueWindowsAlive: number;
  /** Throttled keys: used/limit in the current period, jobs waiting for a slot, when the next slot frees. */
  throttled: Array<{
    rateKey: string;
    label: string;
    used: number;
    limit: number;
    period: number;
    waiting: number;
    nextAt: string;
  }>;
  /** Keys paused by a task, until when. */
  paused: Array<{ pauseKey: string; label: string; until: string }>;
  sessions: Array<{
    pid: number;
    processId: number | null;
    host: string | null;
    applicationName: string;
    connectedAt: string;
  }>;
}

/** Everything `status` shows, optionally only for the given lock keys. */
export async function readStatus(
  client: pg.Client,
  target: Target,
  keys: readonly bigint[] | null,
  rateKeys: readonly bigint[] | null = keys,
): Promise<Status> {
  const s = escapeIdentifier(target.schema);
  const w = escapeIdentifier(target.workerSchema);
  const filter = keys ? keys.map(String) : null;
  const sql = makeSql(target.schema, target.workerSchema, false);
  const held = await readHeldLocks(client, sql, keys);
  const throttled = await readThrottled(client, sql.rates, rateKeys);
  const paused = await readPaused(client, sql.rates, rateKeys);
  const lines = await client.query<{
    lock_key: string;
    waiting: number;
    oldest: Date;
    next_wake: Date | null;
  }>(
    `select wt.lock_key::text, count(*)::int as waiting, min(wt.since) as oldest, min(j.run_at) as next_wake
     from ${s}.waiters wt left join ${w}.jobs j on j.id = wt.job_id
     where $1::bigint[] is null or wt.lock_key = any($1::bigint[])
     group by wt.lock_key order by min(wt.since)`,
    [filter],
  );
  const windows = await client.query<{ n: number }>(
    `select count(*)::int as n from ${s}.unique_windows where expires_at > now()`,
  );
  const sessions = await client.query<{
    pid: number;
    process_id: number | null;
    host: string | null;
    application_name: string;
    backend_start: Date;
  }>(
    `select a.pid, g.process_id, g.host, a.application_name, a.backend_start
     from pg_stat_activity a
     left join ${s}.lock_sessions g on g.pid = a.pid and g.backend_start = a.backend_start
     where a.datname = current_database()
       and (g.pid is not null or a.application_name like 'graphile-worker-locks/%'
         or a.pid in (select pid from ${s}.lock_holders))
     order by a.backend_start`,
  );
  return {
    held: held.map(({ sessionStartedAt: _started, lockKey, since, ...holder }) => ({
      lockKey: String(lockKey),
      ...holder,
      since: since?.toISOString() ?? null,
    })),
    lines: lines.rows.map((r) => ({
      lockKey: r.lock_key,
      waiting: r.waiting,
      oldestSince: r.oldest.toISOString(),
      nextWake: r.next_wake?.toISOString() ?? null,
    })),
    uniqueWindowsAlive: windows.rows[0]!.n,
    throttled: throttled.map(({ now: _now, rateKey, nextAt, ...key }) => ({
      rateKey: String(rateKey),
      ...key,
      nextAt: nextAt.toISOString(),
    })),
    paused: paused.map((p) => ({
      pauseKey: String(p.pauseKey),
      label: p.label,
      until: p.until.toISOString(),
    })),
    sessions: sessions.rows.map((r) => ({
      pid: r.pid,
      processId: r.process_id,
      host: r.host,
      applicationName: r.application_name,
      connectedAt: r.backend_start.toISOString(),
    })),
  };
}

export interface Finding {
  ok: boolean;
  check: string;
  detail: string;
  /** How to fix it, when not ok. */
  fix?: string;
}

export interface CheckOptions {
  /** Worker processes sharing the database, for the connection budget. @defaultValue `1` */
  processes: number;
  /** graphile-worker's pool size per process. @defaultValue `10` */
  maxPoolSize: number;
  /** Allowed clock difference between this machine and the database, in ms. @defaultValue `2000` */
  maxSkewMs: number;
}

/** The doctor's checks, each with a fix when it fails. */
export async function runChecks(target: Target, options: CheckOptions): Promise<Finding[]> {
  const findings: Finding[] = [];
  const client = readOnlyClient(target.connectionString);
  await client.connect();
  try {
    // graphile-worker's schema level
    const workerLevel = await schemaLevel(client, target.workerSchema);
    if (workerLevel === null) {
      findings.push({
        ok: false,
        check: "graphile-worker schema",
        detail: `graphile-worker's schema '${target.workerSchema}' is not installed in this database`,
        fix: "run graphile-worker once (`graphile-worker --schema-only`, or run()/runMigrations())",
      });
    } else {
      const tested = TESTED_WORKER_SCHEMAS.find((t) => t.level === workerLevel);
      findings.push(
        tested
          ? {
              ok: true,
              check: "graphile-worker schema",
              detail: `level ${workerLevel} (graphile-worker ${tested.version})`,
            }
          : {
              ok: false,
              check: "graphile-worker schema",
              detail: `graphile-worker's schema is at level ${workerLevel}, which this library was not tested with (tested: ${TESTED_WORKER_SCHEMAS.map(
                (t) => `${t.level} = ${t.version}`,
              ).join(", ")})`,
              fix: "use a graphile-worker version this library supports, or a library release tested with yours",
            },
      );
    }

    // the library's schema
    const level = await schemaLevel(client, target.schema);
    const latest = await latestLibraryLevel();
    if (level === null || level < latest) {
      findings.push({
        ok: false,
        check: "graphile-worker-locks schema",
        detail:
          level === null
            ? `the schema '${target.schema}' is not installed`
            : `the schema '${target.schema}' is at level ${level}, behind this version's ${latest}`,
        fix: "run `graphile-worker-locks migrate` (workers also install it on start)",
      });
    } else {
      findings.push({ ok: true, check: "graphile-worker-locks schema", detail: `level ${level}` });
    }

    // connection budget
    const { rows } = await client.query<{ max: number; reserved: number; used: number }>(
      `select current_setting('max_connections')::int as max,
              current_setting('superuser_reserved_connections')::int as reserved,
              (select count(*)::int from pg_stat_activity where backend_type = 'client backend') as used`,
    );
    const { max, reserved } = rows[0]!;
    // per process: graphile-worker's pool, the library's pool (10) and its lock session
    const needed = options.processes * (options.maxPoolSize + 10 + 1);
    const available = max - reserved;
    findings.push(
      needed > available
        ? {
            ok: false,
            check: "max_connections",
            detail: `${options.processes} worker process(es) may open ${needed} connections; the server allows ${available} (max_connections ${max} - ${reserved} reserved)`,
            fix: "raise max_connections, lower maxPoolSize, or put the pools (not the lock session) behind a pooler",
          }
        : {
            ok: true,
            check: "max_connections",
            detail: `${needed} needed of ${available} available`,
          },
    );

    // clock skew
    const before = Date.now();
    const { rows: clock } = await client.query<{ ms: string }>(
      "select (extract(epoch from clock_timestamp()) * 1000)::bigint::text as ms",
    );
    const after = Date.now();
    const skew = Number(clock[0]!.ms) - (before + after) / 2;
    findings.push(
      Math.abs(skew) > options.maxSkewMs
        ? {
            ok: false,
            check: "clock",
            detail: `the database's clock is ${Math.round(skew)} ms ${skew > 0 ? "ahead of" : "behind"} this machine's`,
            fix: "synchronise the clocks (NTP); uniqueFor windows and reschedule delays assume they agree",
          }
        : { ok: true, check: "clock", detail: `skew ${Math.round(skew)} ms` },
    );
  } finally {
    await client.end();
  }

  // the lock session's connection: a transaction-mode pooler hands each transaction its own backend, so
  // the session's advisory locks would stay on backends other clients use. The same probe as the lock
  // session's at connect, then the backend again after a transaction of its own.
  const lockUrl = target.lockConnectionString ?? target.connectionString;
  const lock = readOnlyClient(lockUrl);
  await lock.connect();
  let resetCheckWanted = false;
  try {
    const pid = await backendPid(lock);
    let pooled = await probeTransactionPooling(lock, pid, readOnlyConfig(lockUrl));
    if (pooled === null) {
      await lock.query("begin");
      const after = await backendPid(lock);
      await lock.query("commit");
      if (after !== pid) pooled = `its transactions reached backends ${pid} and ${after}`;
    }
    findings.push(
      pooled !== null
        ? {
            ok: false,
            check: "lock session connection",
            detail: `the lock session's connection goes through a transaction-mode pooler (${pooled}): session advisory locks would not hold`,
            fix: "set `lockConnectionString` (worker.locks.lockConnectionString) to a direct connection to PostgreSQL, or to a pooler in session mode",
          }
        : {
            ok: true,
            check: "lock session connection",
            detail: isDirect(lock, pid)
              ? `direct (backend ${pid})`
              : `through a proxy that keeps one backend per session (backend ${pid})`,
          },
    );
    if (pooled === null && !isDirect(lock, pid)) resetCheckWanted = true;
  } finally {
    await lock.end();
  }
  if (resetCheckWanted) findings.push(await checkBackendReset(lockUrl));
  return findings;
}

/** The setting the reset check leaves on its backend: not the lock session's mark, so it refuses nothing. */
const RESET_CHECK_SETTING = "graphile_worker_locks.check";
/** How long the reset check waits for a proxy to release the lock a client left behind. */
const RESET_WAIT_MS = 2000;

/**
 * Whether a proxy that keeps one backend per client resets the backend before the next client gets it, as
 * PgBouncer's default `server_reset_query` (DISCARD ALL) does. A client takes an advisory lock (the two-int
 * form, which no job's key uses, on a random pair) and sets a setting of its own, then leaves. A second
 * client looks for the lock in pg_locks, from whichever backend it is given, until it is gone or
 * RESET_WAIT_MS has passed, and, when it is given the same backend, for the setting.
 */
async function checkBackendReset(url: string): Promise<Finding> {
  const check = "lock session backend reset";
  const fix =
    "let the proxy reset a backend between clients: PgBouncer's `server_reset_query = DISCARD ALL` (its default); or set `lockConnectionString` to a direct connection";
  const [classid, objid] = [randomInt(2 ** 31), randomInt(2 ** 31)];
  const token = randomUUID();
  const first = readOnlyClient(url);
  await first.connect();
  let pid: number;
  try {
    const { rows } = await first.query<{ pid: number }>(
      `select pg_catalog.pg_backend_pid() as pid, pg_catalog.pg_try_advisory_lock($1::int, $2::int),
         pg_catalog.set_config('${RESET_CHECK_SETTING}', $3::text, false)`,
      [classid, objid, token],
    );
    pid = rows[0]!.pid;
  } finally {
    await first.end();
  }
  const second = readOnlyClient(url);
  await second.connect();
  let held = true;
  let settingKept: boolean | null = null;
  let nextPid = pid;
  try {
    const deadline = Date.now() + RESET_WAIT_MS;
    for (;;) {
      const { rows } = await second.query<{ pid: number; mark: string | null; held: boolean }>(
        `select pg_catalog.pg_backend_pid() as pid,
           pg_catalog.current_setting('${RESET_CHECK_SETTING}', true) as mark,
           exists (select 1 from pg_catalog.pg_locks l
             where l.locktype = 'advisory' and l.classid = $1::oid and l.objid = $2::oid and l.objsubid = 2
               and l.granted and l.pid = $3::int) as held`,
        [classid, objid, pid],
      );
      const row = rows[0]!;
      nextPid = row.pid;
      if (row.pid === pid) settingKept = row.mark === token;
      held = row.held;
      if (!held || Date.now() >= deadline) break;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  } finally {
    await second.end();
  }
  const problems = [
    ...(held
      ? [
          `an advisory lock outlived the client that took it (backend ${pid} still held it ${RESET_WAIT_MS} ms after the client left): the locks of a lock session whose process died would stay held there, and the jobs of their keys blocked, until the proxy closes that backend`,
        ]
      : []),
    ...(settingKept
      ? [
          `backend ${pid} was handed to the next client with the settings of the one before: a lock session started after its process restarted would find its predecessor's mark there and be refused (GWL_LOCK_SESSION_POOLED)`,
        ]
      : []),
  ];
  if (problems.length > 0) return { ok: false, check, detail: problems.join("; and "), fix };
  return {
    ok: true,
    check,
    detail:
      settingKept === null
        ? `a client's advisory lock ended with the client (backend ${pid}); its settings were not checked (the next client was given backend ${nextPid})`
        : `a client's advisory lock and settings ended with the client (backend ${pid})`,
  };
}
