/**
 * The lock session's connection: one PostgreSQL client, and everything about keeping it. It connects (after
 * the library's schema is ready), probes a proxy in front of it for transaction pooling, sends a heartbeat
 * while something is held, writes the holder registry, sweeps waiters, reconnects with backoff after a
 * loss, tells `whenReady` callers, and closes the client. Which keys are held is the session's
 * (session.ts), told through `ConnectionHost`.
 *
 * State machine:
 *
 *     idle ──first use──▶ connecting ──ok──▶ ready ──error / end / lost()──▶ broken
 *                              │ fail                                          │ backoff
 *                              └──────────────▶ broken ◀──────── connecting ◀──┘
 *     connecting / ready ──a second backend seen──▶ refused (final: no reconnection)
 *     any state ──close()──▶ closed
 *
 * Each connection is one generation: `generation` changes when a connection is lost or closed, so that the
 * session can tell a hold of the current connection from one of a connection gone.
 *
 * The connection is one PostgreSQL backend, claimed at connect (`claimBackend`: a backend another lock
 * session claimed is refused). Every lock statement runs only on that backend and answers with
 * `pg_backend_pid()`, as every heartbeat does, which must be the pid seen at connect (`checkBackend`);
 * behind a proxy (whose BackendKeyData pid is not the backend's) the connection is also probed before any
 * lock is taken (`probePooler`). A second backend means a transaction-mode pooler, where session locks stay
 * on pooled backends other clients use: the connection is `refused`, for good, with GWL_LOCK_SESSION_POOLED.
 *
 * A refusal after connect (a statement that reached another backend) leaves the locks the session took on
 * its own backend there, held until the pooler closes that backend; its message says so, naming PgBouncer's
 * `server_idle_timeout` and `server_lifetime`. Nothing is unsafe meanwhile: every holder has aborted, the
 * backend carries the session's mark (no other lock session takes locks there), and the locks only make
 * their keys look taken. So no release is attempted: the connect-time checks leave that case rare under
 * pooler traffic (measured by bench/pooler-miss.ts: bench/README.md, "A lock session through a transaction
 * pooler"), and a release through the pooler would need a walk over its backends to reach the session's own
 * again, for what only frees keys sooner.
 */
import { randomUUID } from "node:crypto";
import { hostname } from "node:os";
import pg from "pg";
import type { ClientConfig } from "pg";
import {
  connectFailureReason,
  lockSessionConnectFailed,
  lockSessionPooled,
  lockSessionUnavailable,
  type LocksError,
} from "./errors.js";
import type { HoldImpl } from "./holds.js";
import { SET_SESSION_SETTINGS, sessionSettings } from "./keepalive.js";
import { destroySocket, discard } from "./pgclient.js";
import { CLAIM_BACKEND, CLAIM_SETTING, type Sql } from "./sql.js";

export type SessionState = "idle" | "connecting" | "ready" | "broken" | "refused" | "closed";

/** What the connection asks of the session that uses it. */
export interface ConnectionHost {
  /** The holds to write to the holder registry. */
  holds(): HoldImpl[];
  /** When the lock statement in flight was sent (`performance.now()`), or null when none is. */
  inFlightSince(): number | null;
  /** The connection is ready (first time or again): statements may go. */
  onReady(): void;
  /** The connection was lost (`refusal` set: for good): everything it held is gone. */
  onLost(error: Error, refusal: LocksError | null): void;
  /** The connection was refused at connect: nothing was held on it. */
  onRefused(refusal: LocksError): void;
  /** A release notice on the release channel (hand-offs between processes). */
  onReleaseNotice(payload: string): void;
}

export interface LockConnectionOptions {
  sql: Sql;
  client: ClientConfig;
  /** Ensures the library's schema exists; called before the first connection. */
  prepare(): Promise<void>;
  onWarning(message: string, error?: unknown): void;
  heartbeatIntervalMs: number;
  /** How long a heartbeat or lock statement may go unanswered before the connection counts as lost. */
  heartbeatTimeoutMs: number;
  /** How long the server keeps the locks of a session whose network went silent (keepalive.ts). */
  partitionTimeoutMs: number;
  registryIntervalMs: number;
  reconnectDelayMs: { min: number; max: number };
}

/** Waiters whose job ran on its safety-net delay instead of being woken are swept this often. */
const SWEEP_WAITERS_INTERVAL_MS = 60_000;

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
function target(client: pg.Client): string {
  const { host, port } = client as unknown as { host?: string; port?: number };
  return host?.startsWith("/") ? `${host}/.s.PGSQL.${port}` : `${host}:${port}`;
}

export class LockConnection {
  state: SessionState = "idle";
  client: pg.Client | null = null;
  /** Changes whenever a connection is lost or closed. */
  generation = 0;
  /** Aborts when the current connection is lost (made on first use, one per connection). */
  private lossController: AbortController | undefined;
  /** Why the connection is `refused`. */
  refusal: LocksError | null = null;
  /** Set when the holds changed since the holder registry was last written. */
  registryDirty = false;
  /** Statements sent on the connection, for the benchmark's statements-per-job figure. */
  statements = 0;
  private connecting: Promise<void> | null = null;
  private reconnectAttempt = 0;
  private reconnectTimer: NodeJS.Timeout | null = null;
  private heartbeatPending = false;
  private readonly timers: NodeJS.Timeout[] = [];
  /** Heartbeats, registry writes and sweeps in flight, so that close() can wait for them. */
  private readonly sideQueries = new Set<Promise<unknown>>();
  /** `pg_backend_pid()` of the current connection, as seen at connect. */
  backendPid: number | null = null;
  /** The mark this connection claimed its backend with (`claimBackend`). */
  claimToken: string | null = null;
  /** Why the last connection attempt failed (null once one succeeds). */
  private connectError: LocksError | null = null;
  /** Callers of `whenReady` waiting for the connection, told when it becomes ready or closes. */
  private readonly readyWaiters = new Set<() => void>();

  constructor(
    private readonly options: LockConnectionOptions,
    private readonly host: ConnectionHost,
  ) {}

  /**
   * The backend pid of the current connection, if connected: as PostgreSQL reports it (through a proxy,
   * the pid in the connection's BackendKeyData is the proxy's, not the backend's).
   */
  get pid(): number | null {
    return this.client ? this.backendPid : null;
  }

  /**
   * Resolves true as soon as the connection is ready (connecting it if it never was), false when it is still
   * not ready after `timeoutMs`, or is closed. Never rejects.
   */
  whenReady(timeoutMs: number): Promise<boolean> {
    if (this.state === "ready") return Promise.resolve(true);
    if (this.state === "closed" || this.state === "refused" || timeoutMs <= 0)
      return Promise.resolve(false);
    if (this.state === "idle") void this.connect().catch(() => undefined);
    return new Promise<boolean>((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.readyWaiters.delete(done);
        resolve(this.state === "ready");
      };
      const timer = setTimeout(done, timeoutMs);
      this.readyWaiters.add(done);
    });
  }

  private tellReadyWaiters(): void {
    for (const done of [...this.readyWaiters]) done();
  }

  /** Connects now rather than on first use. */
  async warmUp(): Promise<void> {
    if (this.state === "idle") await this.connect();
    if (this.state !== "ready") throw this.unavailable();
  }

  /** Returns once ready (connecting if idle); throws why not (GWL_LOCK_SESSION_UNAVAILABLE or the refusal). */
  async ensureReady(): Promise<void> {
    switch (this.state) {
      case "ready":
        return;
      case "closed":
        throw lockSessionUnavailable("the Locks instance was released");
      case "broken":
      case "refused":
        throw this.unavailable();
      case "idle":
      case "connecting":
        await this.connect();
        if ((this.state as SessionState) !== "ready") throw this.unavailable();
    }
  }

  /** The error an acquisition fails with while the connection is not ready: why it is not. */
  private unavailable(): LocksError {
    if (this.state === "closed") return lockSessionUnavailable("the Locks instance was released");
    if (this.refusal) return this.refusal;
    return this.connectError ?? lockSessionUnavailable("reconnecting");
  }

  private connect(): Promise<void> {
    this.connecting ??= this.doConnect().finally(() => {
      this.connecting = null;
    });
    return this.connecting;
  }

  private async doConnect(): Promise<void> {
    this.state = "connecting";
    const settings = sessionSettings(this.options.partitionTimeoutMs);
    // Pipelined: the session may send a lock statement before the previous one is answered (session.ts).
    const client = new pg.Client({
      ...this.options.client,
      keepAlive: true,
      keepAliveInitialDelayMillis: settings.keepAliveInitialDelayMillis,
      pipeline: true,
    });
    // A client that fails before it is this connection's (`this.client`) is not `lost()`: it fails the
    // connection attempt instead, even when the failure came between the last statement's answer and the
    // state's change to ready (a termination read in the same packet as that answer).
    let died: Error | null = null;
    const onBroken = (error: Error) => {
      died ??= error;
      this.lost(client, error);
    };
    client.on("error", onBroken);
    client.on("end", () => onBroken(new Error("The lock session's connection ended")));
    let connected = false;
    let pooled: string | null = null;
    try {
      await client.connect();
      connected = true;
      // First, before the session waits for anything (a role's `idle_session_timeout` would end it meanwhile).
      await client.query(SET_SESSION_SETTINGS, [
        settings.server.map(([name]) => name),
        settings.server.map(([, value]) => value),
      ]);
      await this.options.prepare();
      const token = randomUUID();
      const { pid, claimed } = await claimBackend(client, token);
      pooled = claimed
        ? await this.probePooler(client, pid)
        : `its backend (pid ${pid}) is already marked by another lock session: the pooler hands one backend ` +
          "to several clients, or hands it on without resetting it (PgBouncer's `server_reset_query`)";
      // What this connection writes (wakes of parked jobs, holder registry rows) need not wait for the WAL
      // to reach disk: a server crash ends every lock it holds anyway, and a lost wake is covered by the
      // parked job's safety net. So its hand-offs do not pay a disk flush.
      // Its statements are the lock batch, prepared once, whose branches are switched on and off by their
      // parameters: a generic plan skips the unused ones at run time, while PostgreSQL's default would keep
      // re-planning it for each call (measured: 3× the cost of a lock and unlock).
      await client.query("set synchronous_commit = off; set plan_cache_mode = force_generic_plan");
      await client.query(this.options.sql.registerSession, [process.pid, hostname()]);
      client.on("notification", (message) => {
        if (message.channel === this.options.sql.releaseChannel && message.payload)
          this.host.onReleaseNotice(message.payload);
      });
      await client.query(`listen ${this.options.sql.releaseChannel}`);
      const after = await backendPid(client);
      if (died) throw died;
      if (pooled === null && after !== pid)
        pooled = `its statements at connect reached backends ${pid} and ${after}`;
      this.backendPid = pid;
      this.claimToken = token;
    } catch (error) {
      client.removeAllListeners("end");
      client.end().catch(() => undefined);
      if (this.isClosed()) return;
      this.state = "broken";
      this.connectError = connected
        ? lockSessionUnavailable(`could not start: ${connectFailureReason(error)}`, error)
        : lockSessionConnectFailed(target(client), error);
      this.options.onWarning(`${this.connectError.message}; retrying`, error);
      this.scheduleReconnect();
      return;
    }
    if (pooled !== null) {
      await discard(client);
      if (this.isClosed()) return;
      this.refuse(lockSessionPooled(pooled));
      return;
    }
    if (this.isClosed()) {
      client.removeAllListeners("end");
      await client.end().catch(() => undefined);
      return;
    }
    this.client = client;
    this.state = "ready";
    this.connectError = null;
    this.reconnectAttempt = 0;
    this.registryDirty = this.host.holds().length > 0;
    if (this.timers.length === 0) this.startTimers();
    this.host.onReady();
    this.tellReadyWaiters();
  }

  /** {@link probeTransactionPooling}; a probe that cannot run is a warning (each lock statement checks its backend). */
  private async probePooler(client: pg.Client, pid: number): Promise<string | null> {
    try {
      return await probeTransactionPooling(client, pid, this.options.client);
    } catch (error) {
      this.options.onWarning(
        "Could not probe the proxy in front of the lock session for transaction pooling; every lock statement still checks its backend",
        error,
      );
      return null;
    }
  }

  /** State changes while awaiting; TypeScript's narrowing does not know that. */
  private isClosed(): boolean {
    return this.state === "closed";
  }

  private startTimers(): void {
    const heartbeat = setInterval(() => this.heartbeat(), this.options.heartbeatIntervalMs);
    const registry = setInterval(
      () => this.side(this.writeRegistry()),
      this.options.registryIntervalMs,
    );
    const sweep = setInterval(() => {
      if (this.state !== "ready" || !this.client) return;
      this.side(
        this.client.query(this.options.sql.sweepWaiters).catch((error: unknown) => {
          this.options.onWarning("Could not sweep waiters", error);
        }),
      );
    }, SWEEP_WAITERS_INTERVAL_MS);
    for (const timer of [heartbeat, registry, sweep]) timer.unref();
    this.timers.push(heartbeat, registry, sweep);
  }

  /**
   * Checks the connection while something is held: that is when a silently dead connection matters (a
   * network that drops packets without a reset leaves a query waiting for many minutes). A heartbeat, or a
   * lock statement, unanswered for `heartbeatTimeoutMs` counts as a lost connection: the holders' signals
   * abort, as they would if the connection had failed outright.
   */
  private heartbeat(): void {
    const client = this.client;
    if (this.state !== "ready" || !client) return;
    const timeout = this.options.heartbeatTimeoutMs;
    const inFlightSince = this.host.inFlightSince();
    if (inFlightSince !== null) {
      if (performance.now() - inFlightSince > timeout) {
        this.lost(client, new Error(`A lock statement went unanswered for ${timeout} ms`));
      }
      return;
    }
    if (this.host.holds().length === 0 || this.heartbeatPending) return;
    this.heartbeatPending = true;
    const timer = setTimeout(() => {
      this.lost(client, new Error(`The lock session did not answer a heartbeat in ${timeout} ms`));
    }, timeout);
    this.side(
      client
        .query<{ pid: number; marked: boolean }>(this.options.sql.heartbeat, [this.claimToken])
        .then(
          ({ rows }) => {
            clearTimeout(timer);
            this.heartbeatPending = false;
            this.checkBackend(client, rows[0]?.pid, "a heartbeat", rows[0]?.marked);
          },
          (error: Error) => {
            clearTimeout(timer);
            this.heartbeatPending = false;
            this.lost(client, error);
          },
        ),
    );
  }

  /** Runs a statement beside the lock batches (heartbeat, registry, sweep), counted and awaited by close(). */
  private side(promise: Promise<unknown> | undefined): void {
    if (!promise) return;
    this.statements++;
    this.sideQueries.add(promise);
    void promise.finally(() => this.sideQueries.delete(promise));
  }

  private async writeRegistry(): Promise<void> {
    if (!this.registryDirty || this.state !== "ready" || !this.client) return;
    this.registryDirty = false;
    const holds = this.host.holds();
    try {
      await this.client.query(this.options.sql.writeHolders, [
        holds.map((h) => h.keyText),
        holds.map((h) => h.info.taskIdentifier),
        holds.map((h) => h.info.jobId),
        holds.map((h) => h.since.toISOString()),
      ]);
    } catch (error) {
      this.registryDirty = true;
      if (this.state === "ready")
        this.options.onWarning("Could not update the lock holder registry", error);
    }
  }

  private scheduleReconnect(): void {
    const { min, max } = this.options.reconnectDelayMs;
    const base = Math.min(max, min * 2 ** this.reconnectAttempt++);
    const delay = base / 2 + Math.random() * (base / 2);
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      if (this.state === "broken") void this.connect();
    }, delay);
  }

  /**
   * Whether `pid`, the backend that answered a statement of `client`, is the one the connection began on,
   * still `marked` with the session's claim. If not, the connection goes through a transaction pooler, or
   * something reset its backend (which ends every session lock on it): it is lost and refused for good.
   */
  checkBackend(
    client: pg.Client,
    pid: number | undefined,
    what: string,
    marked: boolean | undefined,
  ): boolean {
    if (client !== this.client || this.state !== "ready") return true;
    if (pid === this.backendPid && marked === true) return true;
    this.refusal = lockSessionPooled(
      pid === this.backendPid
        ? `${what} found the session's backend ${pid} reset, its mark (the setting ${CLAIM_SETTING}) gone: ` +
            "a reset (DISCARD ALL, as PgBouncer's `server_reset_query_always` runs between transactions) also " +
            "ends every session lock"
        : `${what} ran on backend ${pid ?? "(none)"}, not on the session's backend ${this.backendPid}; ` +
            `any locks the session took on backend ${this.backendPid} stay held until the pooler closes that ` +
            "backend (PgBouncer: once idle for `server_idle_timeout`, at the latest after `server_lifetime`)",
    );
    this.lost(client, this.refusal);
    return false;
  }

  /**
   * Whether the current connection is alive now: true once it answers a statement (sent now) from its own
   * backend; false when it is not ready, was replaced meanwhile, or fails (it is then lost, or refused).
   */
  async confirm(what: string): Promise<boolean> {
    const client = this.client;
    if (this.state !== "ready" || !client) return false;
    const generation = this.generation;
    const query = client.query<{ pid: number; marked: boolean }>(this.options.sql.heartbeat, [
      this.claimToken,
    ]);
    // (counted and awaited by close() as a side statement; its failure is handled below)
    this.side(query.catch(() => undefined));
    try {
      const { rows } = await query;
      return (
        generation === this.generation &&
        this.state === "ready" &&
        this.checkBackend(client, rows[0]?.pid, what, rows[0]?.marked)
      );
    } catch (error) {
      this.lost(client, error as Error);
      return false;
    }
  }

  /** Stops for good at connect: `refusal` says why (a transaction pooler). */
  private refuse(refusal: LocksError): void {
    this.refusal = refusal;
    this.state = "refused";
    this.options.onWarning(refusal.message);
    this.host.onRefused(refusal);
    this.tellReadyWaiters();
  }

  /** A signal that aborts when the current connection is lost; every hold of this connection shares it. */
  lossSignal(): AbortSignal {
    this.lossController ??= new AbortController();
    return this.lossController.signal;
  }

  /** Aborts the loss signal of the connection that is gone (the session calls it once its holds are lost). */
  abortLossSignal(reason: Error): void {
    const controller = this.lossController;
    this.lossController = undefined;
    controller?.abort(reason);
  }

  /**
   * The connection of this generation failed: it is dropped, and the host told. It reconnects, unless it
   * was refused (`refusal`, set before the call). A call about a client already gone does nothing.
   */
  lost(client: pg.Client | null, error: Error): void {
    if (client !== this.client || this.state !== "ready") return;
    this.generation++;
    this.client = null;
    this.state = this.refusal ? "refused" : "broken";
    client?.removeAllListeners("end");
    client?.on("error", () => undefined);
    client?.end().catch(() => undefined);
    // end() waits for the server's goodbye, which a dead network never sends: cut the socket, so that what
    // is still waiting on it fails now.
    destroySocket(client);
    this.heartbeatPending = false;
    this.host.onLost(error, this.refusal);
    if (!this.refusal) this.scheduleReconnect();
  }

  /**
   * Closes the client, which releases every lock it holds. Waits for a connection attempt, for `drain` (the
   * session's statement in flight) and for side statements, then ends the generation, lets the session
   * `drop` what it held, and tells `whenReady` callers. Idempotent.
   */
  async close(drain: () => Promise<unknown>, drop: () => void): Promise<void> {
    if (this.state === "closed") return;
    this.state = "closed";
    for (const timer of this.timers.splice(0)) clearInterval(timer);
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    await this.connecting?.catch(() => undefined);
    await drain();
    await Promise.allSettled([...this.sideQueries]);
    this.generation++;
    drop();
    this.tellReadyWaiters();
    const client = this.client;
    this.client = null;
    if (client) await discard(client);
  }
}
