/**
 * The lock session's connection: one PostgreSQL client, and everything about keeping it. It connects (after
 * the library's schema is ready), probes a proxy in front of it for transaction pooling (backend.ts), keeps
 * a heartbeat, the holder registry and a sweep of waiters running (upkeep.ts), reconnects with backoff after
 * a loss, tells `whenReady` callers, and closes the client. Which keys are held is the session's
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
} from "../errors.js";
import type { HoldImpl } from "./holds.js";
import { backendPid, claimBackend, probeTransactionPooling, target } from "./backend.js";
import { SET_SESSION_SETTINGS, sessionSettings } from "./keepalive.js";
import { Upkeep } from "./upkeep.js";
import { destroySocket, discard } from "./pgclient.js";
import { CLAIM_SETTING, type Sql } from "../sql.js";

export type ConnectionState = "idle" | "connecting" | "ready" | "broken" | "refused" | "closed";

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
  /** A notice on the supersede channel (`supersede`: a key's older jobs are superseded). */
  onSupersedeNotice(payload: string): void;
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

export class LockConnection {
  state: ConnectionState = "idle";
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
  /** Heartbeat, registry and sweep (upkeep.ts). */
  private readonly upkeep: Upkeep;
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
  ) {
    this.upkeep = new Upkeep(options, this, host);
  }

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
        if ((this.state as ConnectionState) !== "ready") throw this.unavailable();
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
    // An attempt that stalls (a network gone silent in the middle of it) is cut after heartbeatTimeout, as
    // an unanswered statement of a ready connection is, and tried again.
    const stalled = setTimeout(() => destroySocket(client), this.options.heartbeatTimeoutMs);
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
      // Its statements are the lock statements, each prepared once, whose plans do not depend on their
      // parameters' values: PostgreSQL's default would keep re-planning them for each call, as the custom
      // plan of a statement whose one-time filters its parameters decide always looks cheaper than the
      // generic one (see bench/README.md, section "Generic plans").
      await client.query("set synchronous_commit = off; set plan_cache_mode = force_generic_plan");
      await client.query(this.options.sql.registerSession, [process.pid, hostname()]);
      const { releaseChannel, supersedeChannel } = this.options.sql;
      client.on("notification", (message) => {
        if (!message.payload) return;
        if (message.channel === releaseChannel) this.host.onReleaseNotice(message.payload);
        else if (message.channel === supersedeChannel) this.host.onSupersedeNotice(message.payload);
      });
      await client.query(`listen ${releaseChannel}; listen ${supersedeChannel}`);
      const after = await backendPid(client);
      if (died) throw died;
      if (pooled === null && after !== pid)
        pooled = `its statements at connect reached backends ${pid} and ${after}`;
      this.backendPid = pid;
      this.claimToken = token;
      clearTimeout(stalled);
    } catch (error) {
      clearTimeout(stalled);
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
    this.upkeep.start();
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
    this.upkeep.connectionLost();
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
    this.upkeep.stop();
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    await this.connecting?.catch(() => undefined);
    await drain();
    await this.upkeep.settled();
    this.generation++;
    drop();
    this.tellReadyWaiters();
    const client = this.client;
    this.client = null;
    if (client) await discard(client);
  }
}
