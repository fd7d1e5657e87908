/**
 * Where the server's time goes, statement by statement. With BENCH_SERVER_STATS=1 the bench's embedded
 * server (or container) loads pg_stat_statements, counting the statements functions run as well as the
 * ones sent (`pg_stat_statements.track = all`), and times every function (`track_functions = all`). A run
 * resets both before it and reads them after; sections that do so print two tables of their own. Off by
 * default: the timing itself costs the server a little on every statement.
 */
import type pg from "pg";
import { fmtFixed, fmtInt, sleep, table, type Table } from "./lib.js";

export const serverStatsOn = process.env.BENCH_SERVER_STATS === "1";

/** The server settings BENCH_SERVER_STATS needs, for startPostgres. */
export const SERVER_STATS_FLAGS: ReadonlyArray<readonly [string, string]> = serverStatsOn
  ? [
      ["shared_preload_libraries", "pg_stat_statements"],
      ["pg_stat_statements.track", "all"],
      ["track_functions", "all"],
    ]
  : [];

/**
 * A statement's text, short: a lock statement (its text opens with the backend's pid) by the functions it
 * calls; any other by its first words.
 */
function label(query: string): string {
  if (query.includes("pg_backend_pid() as i")) {
    const calls = [
      "try_lock_all",
      "try_lock_first",
      "is_next",
      "release_waiters",
      "prewake",
      "lock_rated",
    ];
    const called = calls.filter((f) => query.includes(`.${f}(`));
    return `lock statement${called.length > 0 ? ` (${called.join(", ")})` : ""}`;
  }
  return query.replace(/\s+/g, " ").slice(0, 90);
}

/** Clears the statement and function counts, when BENCH_SERVER_STATS is on. */
export async function resetServerStats(pool: pg.Pool): Promise<void> {
  if (!serverStatsOn) return;
  await pool.query("create extension if not exists pg_stat_statements");
  await pool.query("select pg_stat_statements_reset()");
  await pool.query("select pg_stat_reset()");
}

/**
 * The statements and functions that took the most server time since resetServerStats, per call, as two
 * tables (none when BENCH_SERVER_STATS is off). `calls` divides the totals into a per-job figure.
 */
export async function serverStatsTables(
  pool: pg.Pool,
  what: string,
  jobs: number,
  limit = 12,
): Promise<Table[]> {
  if (!serverStatsOn) return [];
  // (a backend reports its function counts when idle, at most once a second)
  await sleep(1500);
  const statements = await pool.query<{ calls: string; total: number; query: string }>(
    `select calls, total_exec_time as total, query
       from pg_stat_statements
      where query not like '%pg_stat_%'
      order by total_exec_time desc limit $1`,
    [limit],
  );
  const functions = await pool.query<{ name: string; calls: string; total: number; self: number }>(
    `select funcname as name, calls, total_time as total, self_time as self
       from pg_catalog.pg_stat_user_functions where funcname not like 'pg_stat%'
      order by total_time desc limit $1`,
    [limit],
  );
  return [
    table(
      `Server time by statement, ${what} (pg_stat_statements, nested statements included)`,
      "<statement | calls | total ms | per call µs | per job µs",
      statements.rows.map((r) => [
        label(r.query),
        fmtInt(Number(r.calls)),
        fmtFixed(r.total, 1),
        fmtInt((r.total * 1000) / Number(r.calls)),
        fmtInt((r.total * 1000) / jobs),
      ]),
      ["A function's own statements count under it as well as on their own rows."],
    ),
    table(
      `Server time by function, ${what} (track_functions)`,
      "<function | calls | total ms | self ms | per call µs | per job µs",
      functions.rows.map((r) => [
        r.name,
        fmtInt(Number(r.calls)),
        fmtFixed(r.total, 1),
        fmtFixed(r.self, 1),
        fmtInt((r.total * 1000) / Number(r.calls)),
        fmtInt((r.total * 1000) / jobs),
      ]),
    ),
  ];
}
