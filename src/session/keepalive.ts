/**
 * What the lock session sets for its own backend, so that neither a server setting nor a dead network keeps
 * it from doing its job:
 *
 * - Timeouts a role or database may set (`idle_session_timeout`, `idle_in_transaction_session_timeout`,
 *   `statement_timeout`, `lock_timeout`) are turned off: the session sits idle between jobs, and a lock
 *   statement that fails ends the session and every lock on it. Its own heartbeat (`heartbeatTimeout`)
 *   decides when it counts as lost.
 * - TCP keepalives and `tcp_user_timeout` on the server's side bound how long a holder that the network cut
 *   off (no reset, no answer) keeps its locks on the server: `partitionTimeout`. Keepalive probes end a
 *   silent connection that is idle; `tcp_user_timeout` ends one whose data (a notification, say) stays
 *   unacknowledged, where keepalives do not apply, and on Linux also ends the keepalive probing once it has
 *   gone unanswered that long.
 *
 * The settings are sent as one statement after connecting (not as startup options: PostgreSQL 12 and 13
 * refuse an unknown `idle_session_timeout` there, and PgBouncer may refuse an `options` startup parameter), and
 * only those the server knows are set.
 */

/** Probes of the server's keepalive before it gives up, where `tcp_user_timeout` is not supported. */
const KEEPALIVE_PROBES = 5;

/** The server-side settings and the client's keepalive delay for a given `partitionTimeout`. */
export interface SessionSettings {
  /** Setting name and value, for the session's own backend. */
  server: Array<[name: string, value: string]>;
  /** node-postgres `keepAliveInitialDelayMillis` of the lock session's client. */
  keepAliveInitialDelayMillis: number;
}

/**
 * The settings under which the server ends a lock session whose client went silent `partitionTimeoutMs`
 * ago. Keepalive probes start halfway and are spaced a tenth apart so that the last one falls on the bound
 * (in whole seconds, as PostgreSQL takes them); `tcp_user_timeout` ends the connection at the first probe
 * at or past the bound (so at most a probe interval late), or when data sent has gone unacknowledged that
 * long.
 */
export function sessionSettings(partitionTimeoutMs: number): SessionSettings {
  const seconds = Math.max(1, Math.floor(partitionTimeoutMs / 1000));
  const interval = Math.max(1, Math.floor(seconds / (2 * KEEPALIVE_PROBES)));
  const idle = Math.max(1, seconds - KEEPALIVE_PROBES * interval);
  return {
    server: [
      ["idle_session_timeout", "0"],
      ["idle_in_transaction_session_timeout", "0"],
      ["statement_timeout", "0"],
      ["lock_timeout", "0"],
      ["tcp_keepalives_idle", String(idle)],
      ["tcp_keepalives_interval", String(interval)],
      ["tcp_keepalives_count", String(KEEPALIVE_PROBES)],
      ["tcp_user_timeout", String(Math.round(partitionTimeoutMs))],
    ],
    keepAliveInitialDelayMillis: idle * 1000,
  };
}

/**
 * Sets $1 (names) to $2 (values) for the session, skipping names the server does not know
 * (`idle_session_timeout` before PostgreSQL 14).
 */
export const SET_SESSION_SETTINGS = `select pg_catalog.set_config(s.name, v.value, false)
  from unnest($1::text[], $2::text[]) as v(name, value)
  join pg_catalog.pg_settings s on s.name = v.name`;
