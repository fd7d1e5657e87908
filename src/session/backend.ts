/**
 * What the lock session learns of the backend behind its client: its pid as PostgreSQL reports it, its claim
 * (one lock session per backend), whether a proxy stands in front of it, and the probe of that proxy for
 * transaction pooling. The lock session (connection.ts) and the CLI's `check` share them.
 */
import pg from "pg";
import type { ClientConfig } from "pg";
import { CLAIM_BACKEND } from "../sql.js";

/** The backend's pid, as PostgreSQL itself reports it. */
export async function backendPid(client: pg.Client): Promise<number> {
  const { rows } = await client.query<{ pid: number }>("select pg_catalog.pg_backend_pid() as pid");
  return rows[0]!.pid;
}

/**
 * Marks the backend of `client` as the lock session's, with `token` (new for each connection), unless a
 * mark is there already: reading and setting are one statement, which runs on one backend, so of two
 * sessions that a pooler put on one backend, exactly one claims it. A session's lock statements run only
 * on the backend it claimed (`onOwnBackend`, sql.ts), so no two sessions ever take locks on one backend.
 * A mark already there means the backend serves, or served, another client without being reset: a pooler
 * in transaction mode, or a session pooler that does not reset backends between clients, where a crashed
 * client's locks would stay held too (PgBouncer resets with `server_reset_query`, by default DISCARD ALL).
 */
export async function claimBackend(
  client: pg.Client,
  token: string,
): Promise<{ pid: number; claimed: boolean }> {
  const { rows } = await client.query<{ pid: number; claimed: boolean }>(CLAIM_BACKEND, [token]);
  return rows[0]!;
}

/**
 * Whether `client` reaches PostgreSQL directly: PostgreSQL's BackendKeyData names the backend (`pid`, as
 * `pg_backend_pid()` reports it), and a proxy sends its own (PgBouncer: a random key).
 */
export function isDirect(client: pg.Client, pid: number): boolean {
  return pid === (client as unknown as { processID?: number }).processID;
}

/**
 * Whether `client`, on backend `pid`, reaches PostgreSQL through a pooler that pools by transaction.
 * A direct connection (`isDirect`) needs no probe. Behind a proxy, a second client (`config`) opens a
 * transaction, which pins a backend (a pooler hands out the backend released last first: this client's),
 * and this client asks for its backend again. A session pool gives each client its own backend throughout;
 * a transaction pool shows this client's backend to the other client, or another backend to this one.
 * Returns what was seen when it pools by transaction, else null; throws when the probe cannot run. The
 * lock session and the CLI's `check` share it.
 */
export async function probeTransactionPooling(
  client: pg.Client,
  pid: number,
  config: ClientConfig,
): Promise<string | null> {
  if (isDirect(client, pid)) return null;
  const other = new pg.Client(config);
  other.on("error", () => undefined);
  try {
    await other.connect();
    await other.query("begin");
    const otherPid = await backendPid(other);
    const again = await backendPid(client);
    await other.query("rollback");
    if (otherPid === pid)
      return `a second client through it was given the session's backend (pid ${pid})`;
    if (again !== pid) return `the session's statements reached backends ${pid} and ${again}`;
    return null;
  } finally {
    await other.end().catch(() => undefined);
  }
}

/** Where a client connects to, for error messages: host and port, or the socket directory. */
export function target(client: pg.Client): string {
  const { host, port } = client as unknown as { host?: string; port?: number };
  return host?.startsWith("/") ? `${host}/.s.PGSQL.${port}` : `${host}:${port}`;
}
