/**
 * The operator CLI's reads: what `status` shows and what `check` diagnoses. Read-only: every connection
 * opened here runs with `default_transaction_read_only`, so nothing is written.
 */
import { readdir } from "node:fs/promises";
import pg from "pg";
import { TESTED_WORKER_SCHEMAS } from "../migrate.js";
import { backendPid, isDirect, probeTransactionPooling } from "../connection.js";
import { readHeldLocks } from "../held.js";
import { escapeIdentifier, makeSql } from "../sql.js";

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
  held: Array<{
    lockKey: string;
    taskIdentifier: string | null;
    jobId: string | null;
    pid: number;
    applicationName: string;
    since: string | null;
  }>;
  lines: Array<{ lockKey: string; waiting: number; oldestSince: string; nextWake: string | null }>;
  uniqueWindowsAlive: number;
  sessions: Array<{ pid: number; applicationName: string; connectedAt: string }>;
}

/** Everything `status` shows, optionally only for the given lock keys. */
export async function readStatus(
  client: pg.Client,
  target: Target,
  keys: readonly bigint[] | null,
): Promise<Status> {
  const s = escapeIdentifier(target.schema);
  const w = escapeIdentifier(target.workerSchema);
  const filter = keys ? keys.map(String) : null;
  const held = await readHeldLocks(
    client,
    makeSql(target.schema, target.workerSchema, false),
    keys,
  );
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
    application_name: string;
    backend_start: Date;
  }>(
    `select pid, application_name, backend_start from pg_stat_activity
     where datname = current_database()
       and (application_name like 'graphile-worker-locks/%' or pid in (select pid from ${s}.lock_holders))
     order by backend_start`,
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
    sessions: sessions.rows.map((r) => ({
      pid: r.pid,
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
  } finally {
    await lock.end();
  }
  return findings;
}
