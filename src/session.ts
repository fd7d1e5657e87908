/**
 * The lock session: the one PostgreSQL connection of a `Locks` instance on which every advisory lock of
 * this process is taken and released. It is separate from graphile-worker's pool (holding a pool client
 * per running job deadlocks the pool) and it is shared by every job of every runner in the process.
 *
 * State machine:
 *
 *     idle ──first acquire──▶ connecting ──ok──▶ ready ──error / end / failed statement──▶ broken
 *                                  │ fail                                                  │ backoff
 *                                  └──────────────▶ broken ◀───────────────── connecting ◀─┘
 *     connecting / ready ──a second backend seen──▶ refused (final: no reconnection)
 *     any state ──close()──▶ closed
 *
 * Invariants:
 * - Session advisory locks are re-entrant, so PostgreSQL cannot tell two jobs of this process apart. This
 *   module does: a key is held by at most one `Hold` (`holds`), and a key that is being acquired or
 *   released (`pending`) counts as held. A second job asking for such a key gets a conflict without a
 *   round trip, never a re-entrant "success".
 * - Requests are coalesced: while one statement is in flight, every lock and unlock request queues up, and
 *   the next statement carries all of them (batch.ts). One statement is in flight at a time.
 * - Every hold belongs to a generation (one per connection). When the connection is lost, the generation
 *   changes, every hold is marked lost and its signal aborts, and a late release of such a hold is a no-op:
 *   it can never unlock a key that a hold of the new connection now owns.
 * - A failed lock statement leaves the session's state uncertain, so the connection is destroyed (which
 *   releases everything) rather than reused.
 * - While the session is not ready, acquisition fails at once with GWL_LOCK_SESSION_UNAVAILABLE: no job
 *   ever runs unlocked.
 * - The session is one PostgreSQL backend. Every lock statement and heartbeat answers with
 *   `pg_backend_pid()`, which must be the pid seen at connect; behind a proxy (whose BackendKeyData pid is
 *   not the backend's) the connection is also probed before any lock is taken (see probePooler). A second
 *   backend means a transaction-mode pooler, where session locks stay on pooled backends other clients use:
 *   every hold is lost and the session is `refused`, failing every acquisition with GWL_LOCK_SESSION_POOLED.
 * - A key passes without an unlock only from a finished hold to the job that hold woke early (handoff.ts):
 *   the old hold is settled before the new one is made, and PostgreSQL sees the key held throughout. A job
 *   woken early by another session waits, its key still `pending`, for the release's notification or its
 *   time limit, then tries the key again.
 */
import pg from "pg";
import type { ClientConfig } from "pg";
import { batchQuery, decodeBatch, makeBatch, type BatchRow } from "./batch.js";
import {
  connectFailureReason,
  lockLost,
  lockSessionConnectFailed,
  lockSessionPooled,
  lockSessionUnavailable,
  type LocksError,
} from "./errors.js";
import { Handoff, type HandoffCounts } from "./handoff.js";
import {
  Acquisition,
  HoldImpl,
  LOST,
  RELEASED,
  UNVERIFIED,
  type AcquireReceiver,
  type AcquireResult,
  type HoldInfo,
  type HoldOwner,
  type LockRequest,
} from "./holds.js";
import type { IdleWorkers } from "./idle.js";
import { lockFlag } from "./key.js";
import { BatchOp, type Sql } from "./sql.js";

export type SessionState = "idle" | "connecting" | "ready" | "broken" | "refused" | "closed";

/** The backend's pid, as PostgreSQL itself reports it. */
export async function backendPid(client: pg.Client): Promise<number> {
  const { rows } = await client.query<{ pid: number }>("select pg_catalog.pg_backend_pid() as pid");
  return rows[0]!.pid;
}

/**
 * Whether `client`, on backend `pid`, reaches PostgreSQL through a pooler that pools by transaction.
 * PostgreSQL's BackendKeyData names the backend and a proxy sends its own (PgBouncer: a random key), so a
 * direct connection is recognised without a probe. Behind a proxy, a second client (`config`) opens a
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
  if (pid === (client as unknown as { processID?: number }).processID) return null;
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

export interface LockSessionOptions {
  sql: Sql;
  /** Idle workers of this process's attached runners, which fetch a job woken early here. */
  idleWorkers?: IdleWorkers;
  client: ClientConfig;
  /** Ensures the library's schema exists; called before the first connection. */
  prepare(): Promise<void>;
  onLost(holds: HoldImpl[], error: Error): void;
  onConnected(): void;
  onWarning(message: string, error?: unknown): void;
  heartbeatIntervalMs: number;
  /** How long a heartbeat or lock statement may go unanswered before the connection counts as lost. */
  heartbeatTimeoutMs: number;
  registryIntervalMs: number;
  /** How long an unlock nobody waits for may wait for a lock request to share a statement with. */
  unlockDelayMs: number;
  reconnectDelayMs: { min: number; max: number };
}

export class LockSession implements HoldOwner {
  private state: SessionState = "idle";
  private client: pg.Client | null = null;
  private connecting: Promise<void> | null = null;
  private generation = 0;
  private reconnectAttempt = 0;
  private reconnectTimer: NodeJS.Timeout | null = null;
  private readonly holds = new Map<string, HoldImpl>();
  /** Keys being acquired, with the acquisition (settles when its statement answered). */
  private readonly pending = new Map<string, Acquisition>();
  private lockQueue: LockRequest[] = [];
  private unlockQueue: HoldImpl[] = [];
  private inFlight: Promise<void> | null = null;
  /** When the lock statement in flight was sent (`performance.now()`). */
  private inFlightSince = 0;
  private heartbeatPending = false;
  private flushScheduled = false;
  private unlockTimer: NodeJS.Timeout | null = null;
  /** Acquisitions in this process waiting for a key this process is releasing. */
  private successorsWaiting = 0;
  private readonly handoff: Handoff;
  private registryDirty = false;
  private readonly timers: NodeJS.Timeout[] = [];
  /** Heartbeats, registry writes and sweeps in flight, so that close() can wait for them. */
  private readonly sideQueries = new Set<Promise<unknown>>();
  /** Aborts when the current connection is lost (made on first use, one per connection). */
  private lossController: AbortController | undefined;
  /** Statements sent on the lock session, for the benchmark's statements-per-job figure. */
  statements = 0;
  /** `pg_backend_pid()` of the current connection, as seen at connect. */
  private backendPid: number | null = null;
  /** Why the session is `refused`. */
  private refusal: LocksError | null = null;
  /** Why the last connection attempt failed (null once one succeeds). */
  private connectError: LocksError | null = null;
  /** Callers of `whenReady` waiting for the session, told when it becomes ready or closes. */
  private readonly readyWaiters = new Set<() => void>();

  constructor(private readonly options: LockSessionOptions) {
    this.handoff = new Handoff(
      {
        holdOf: (key) => this.holds.get(key),
        isPending: (key) => this.pending.has(key),
        retryLock: (request) => {
          this.lockQueue.push(request);
          this.scheduleFlush();
        },
        scheduleFlush: () => this.scheduleFlush(),
        passKey: (from, request) => {
          this.holds.delete(from.keyText);
          from.settle(RELEASED);
          // The next job was woken from a line, so it is taken to have one behind it.
          request.resolve({
            acquired: true,
            hold: this.grant(request, from.keyText, from.generation, true),
          });
        },
      },
      options.idleWorkers,
    );
  }

  get currentState(): SessionState {
    return this.state;
  }

  /** The backend pid of the current connection, if connected. */
  get pid(): number | null {
    return (this.client as unknown as { processID?: number } | null)?.processID ?? null;
  }

  /** What the session has done about hand-offs, for `locks.status()`. */
  get handoffs(): HandoffCounts {
    return this.handoff.counts;
  }

  /** A signal that aborts when the current connection is lost; every hold of this connection shares it. */
  lossSignal(): AbortSignal {
    this.lossController ??= new AbortController();
    return this.lossController.signal;
  }

  private abortLossSignal(reason: Error): void {
    const controller = this.lossController;
    this.lossController = undefined;
    controller?.abort(reason);
  }

  /** Keys this process holds right now. */
  heldKeys(): Array<{ key: bigint; info: HoldInfo; since: Date }> {
    return [...this.holds.values()].map((h) => ({ key: h.key, info: h.info, since: h.since }));
  }

  /**
   * The job flags (`lockFlag`) of the keys this process holds for jobs that wait their turn (`reschedule`)
   * and has not begun to release: graphile-worker need not fetch more jobs of those keys for now. A key being
   * released, or whose next job was woken early, is left out: its next job may be fetched (and then waits for
   * the key, in this process).
   */
  heldFlags(): string[] {
    const flags: string[] = [];
    for (const hold of this.holds.values()) {
      if (hold.info.reschedule && !hold.releaseRequested && !this.handoff.isPrewoken(hold.keyText))
        flags.push(lockFlag(hold.keyText));
    }
    return flags;
  }

  /** Whether no job of this process holds, acquires or releases `key`. */
  private isFree(key: string): boolean {
    return !this.holds.has(key) && !this.pending.has(key);
  }

  /**
   * Tries the slots in order and takes the first that is free. Resolves `{ acquired: false }` on a
   * conflict (`local: true` when this process itself holds every slot), throws GWL_LOCK_SESSION_UNAVAILABLE
   * when there is no session.
   */
  acquire(slots: readonly bigint[], info: HoldInfo): Promise<AcquireResult> {
    return this.queueIfFree(slots, info, undefined)?.promise() ?? this.acquireSlowly(slots, info);
  }

  /** `acquire`, its outcome given to `receiver` (null if it failed) rather than promised: for lock-ahead. */
  acquireInto(slots: readonly bigint[], info: HoldInfo, receiver: AcquireReceiver): void {
    if (this.queueIfFree(slots, info, receiver)) return;
    this.acquireSlowly(slots, info).then(
      (result) => receiver.settle(result),
      () => receiver.settle(null),
    );
  }

  /**
   * The common case, a free single key on a ready session, queued without the general path's async frame;
   * null otherwise (acquireSlowly).
   */
  private queueIfFree(
    slots: readonly bigint[],
    info: HoldInfo,
    receiver: AcquireReceiver | undefined,
  ): Acquisition | null {
    if (this.state !== "ready" || slots.length !== 1) return null;
    const key = slots[0]!.toString();
    return this.isFree(key) ? this.queueLock([key], slots, info, receiver) : null;
  }

  private async acquireSlowly(slots: readonly bigint[], info: HoldInfo): Promise<AcquireResult> {
    const keys = slots.map(String);
    let free: string[];
    for (;;) {
      if (this.state !== "ready") await this.ensureReady();
      free = keys.filter((k) => this.isFree(k));
      if (free.length > 0) break;
      // A job that waits its turn (`reschedule`) does not give up on a key another job of this process is
      // only trying to take: that attempt may fail (it may not be that job's turn), and this one's may not.
      if (info.reschedule) {
        const acquiring = keys.map((k) => this.pending.get(k)).find((p) => p !== undefined);
        if (acquiring) {
          await acquiring.promise().catch(() => undefined);
          continue;
        }
      }
      // A key whose job has finished and whose unlock is on its way is not a conflict: wait for the unlock.
      const releasing = keys.map((k) => this.holds.get(k)).find((h) => h?.releaseRequested);
      if (!releasing) {
        const handedOver =
          keys.length === 1 ? this.handoff.onLocalConflict(keys[0]!, slots, info) : null;
        if (!handedOver) return { acquired: false, local: true };
        const result = await handedOver;
        if (result === "retry") continue;
        return result;
      }
      const turn = this.handoff.joinLine(releasing, keys[0]!, info);
      this.successorsWaiting++;
      this.scheduleFlush();
      try {
        await releasing.release();
      } finally {
        this.successorsWaiting--;
      }
      if (turn && !turn.first()) return { acquired: false, local: true };
    }
    return this.queueLock(
      free,
      free.length === slots.length ? slots : free.map((k) => BigInt(k)),
      info,
      undefined,
    ).promise();
  }

  /** Queues a lock request for the next statement; its keys count as held meanwhile (`pending`). */
  private queueLock(
    free: string[],
    keys: readonly bigint[],
    info: HoldInfo,
    receiver: AcquireReceiver | undefined,
  ): Acquisition {
    const acquisition = new Acquisition(free, keys as bigint[], info, receiver);
    this.lockQueue.push(acquisition);
    this.scheduleFlush();
    for (const k of free) this.pending.set(k, acquisition);
    return acquisition;
  }

  /**
   * Queues the unlock of `hold`; its answer goes to `hold.settle`. When the job its hold woke early waits in
   * this process, the key passes to that job instead, without an unlock.
   */
  release(hold: HoldImpl): void {
    hold.cancelPrewake();
    if (hold.lost || hold.generation !== this.generation || this.state !== "ready") {
      hold.settle(LOST);
      return;
    }
    if (this.holds.get(hold.keyText) === hold && this.handoff.handOver(hold)) return;
    this.unlockQueue.push(hold);
    this.scheduleFlush();
  }

  /**
   * Resolves true as soon as the session is ready (connecting it if it never was), false when it is still
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

  /** Connects now rather than on the first acquisition (which then starts without the connection delay). */
  async warmUp(): Promise<void> {
    if (this.state === "idle") await this.connect();
    if (this.state !== "ready") throw this.unavailable();
  }

  private async ensureReady(): Promise<void> {
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

  /** The error an acquisition fails with while the session is not ready: why it is not. */
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
    const client = new pg.Client({ keepAlive: true, ...this.options.client });
    const onBroken = (error: Error) => this.handleLost(client, error);
    client.on("error", onBroken);
    client.on("end", () => onBroken(new Error("The lock session's connection ended")));
    let connected = false;
    let pooled: string | null = null;
    try {
      await client.connect();
      connected = true;
      await this.options.prepare();
      const pid = await backendPid(client);
      pooled = await this.probePooler(client, pid);
      // What this connection writes (wakes of parked jobs, holder registry rows) need not wait for the WAL
      // to reach disk: a server crash ends every lock it holds anyway, and a lost wake is covered by the
      // parked job's safety net. So its hand-offs do not pay a disk flush.
      // Its statements are the lock batch, prepared once, whose branches are switched on and off by their
      // parameters: a generic plan skips the unused ones at run time, while PostgreSQL's default would keep
      // re-planning it for each call (measured: 3× the cost of a lock and unlock).
      await client.query("set synchronous_commit = off; set plan_cache_mode = force_generic_plan");
      await client.query(this.options.sql.cleanHolders);
      client.on("notification", (message) => {
        if (message.channel === this.options.sql.releaseChannel && message.payload)
          this.handoff.onReleaseNotice(message.payload);
      });
      await client.query(`listen ${this.options.sql.releaseChannel}`);
      const after = await backendPid(client);
      if (pooled === null && after !== pid)
        pooled = `its statements at connect reached backends ${pid} and ${after}`;
      this.backendPid = pid;
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
      client.removeAllListeners("end");
      client.on("error", () => undefined);
      await client.end().catch(() => undefined);
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
    this.registryDirty = this.holds.size > 0;
    if (this.timers.length === 0) this.startTimers();
    this.options.onConnected();
    this.scheduleFlush();
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
    // Waiters whose job ran on its safety-net delay instead of being woken.
    const sweep = setInterval(() => {
      if (this.state !== "ready" || !this.client) return;
      this.side(
        this.client.query(this.options.sql.sweepWaiters).catch((error: unknown) => {
          this.options.onWarning("Could not sweep waiters", error);
        }),
      );
    }, 60_000);
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
    if (this.inFlight) {
      if (performance.now() - this.inFlightSince > timeout) {
        this.handleLost(client, new Error(`A lock statement went unanswered for ${timeout} ms`));
      }
      return;
    }
    if (this.holds.size === 0 || this.heartbeatPending) return;
    this.heartbeatPending = true;
    const timer = setTimeout(() => {
      this.handleLost(
        client,
        new Error(`The lock session did not answer a heartbeat in ${timeout} ms`),
      );
    }, timeout);
    this.side(
      client.query<{ pid: number }>(this.options.sql.heartbeat).then(
        ({ rows }) => {
          clearTimeout(timer);
          this.heartbeatPending = false;
          this.checkBackend(client, rows[0]?.pid, "a heartbeat");
        },
        (error: Error) => {
          clearTimeout(timer);
          this.heartbeatPending = false;
          this.handleLost(client, error);
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
    const holds = [...this.holds.values()];
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
   * Whether `pid`, the backend that answered a statement of `client`, is the one the session connected to.
   * If not, the session goes through a transaction pooler: every hold is lost and the session is refused.
   */
  private checkBackend(client: pg.Client, pid: number | undefined, what: string): boolean {
    if (pid === this.backendPid || client !== this.client || this.state !== "ready") return true;
    this.refusal = lockSessionPooled(
      `${what} ran on backend ${pid ?? "(none)"}, not on the session's backend ${this.backendPid}`,
    );
    this.handleLost(client, this.refusal);
    return false;
  }

  /** Stops the session for good at connect: `refusal` says why (a transaction pooler). */
  private refuse(refusal: LocksError): void {
    this.refusal = refusal;
    this.state = "refused";
    this.options.onWarning(refusal.message);
    for (const request of this.lockQueue.splice(0)) request.reject(refusal);
    this.tellReadyWaiters();
  }

  /**
   * The connection of this generation failed: everything it held is gone. The session reconnects, unless it
   * was refused (`refusal`, set before the call).
   */
  private handleLost(client: pg.Client | null, error: Error): void {
    if (client !== this.client || this.state !== "ready") return;
    this.generation++;
    this.client = null;
    this.state = this.refusal ? "refused" : "broken";
    client?.removeAllListeners("end");
    client?.on("error", () => undefined);
    client?.end().catch(() => undefined);
    // end() waits for the server's goodbye, which a dead network never sends: cut the socket, so that what
    // is still waiting on it fails now.
    (
      client as { connection?: { stream?: { destroy(): void } } } | null
    )?.connection?.stream?.destroy();
    this.heartbeatPending = false;

    const lost = [...this.holds.values()];
    this.holds.clear();
    this.pending.clear();
    const unavailable = this.refusal ?? lockSessionUnavailable("the connection was lost", error);
    this.handoff.dropAll(unavailable);
    for (const request of this.lockQueue.splice(0)) request.reject(unavailable);
    for (const hold of this.unlockQueue.splice(0)) hold.settle(LOST);
    const reason = lockLost(error);
    for (const hold of lost) hold.markLost(reason);
    this.abortLossSignal(reason);
    this.options.onLost(lost, error);
    if (!this.refusal) this.scheduleReconnect();
  }

  private scheduleFlush(): void {
    if (this.flushScheduled || this.inFlight) return;
    this.flushScheduled = true;
    setImmediate(() => {
      this.flushScheduled = false;
      this.flush();
    });
  }

  /**
   * Whether what is queued is only unlocks that nobody waits for: no lock request, no waiter to wake, no
   * same-process successor. Such a batch waits (up to `unlockDelayMs`) to ride with the next lock request:
   * every statement costs both sides a round of socket I/O, and the keys stay held meanwhile, which is
   * never looser.
   */
  private onlyQuietUnlocks(): boolean {
    return (
      this.lockQueue.length === 0 &&
      !this.handoff.hasPrewakes() &&
      this.successorsWaiting === 0 &&
      this.unlockQueue.every((hold) => !hold.info.reschedule)
    );
  }

  private flush(force = false): void {
    if (this.inFlight || this.state !== "ready" || !this.client) return;
    if (
      !force &&
      this.options.unlockDelayMs > 0 &&
      this.unlockQueue.length > 0 &&
      this.onlyQuietUnlocks()
    ) {
      this.unlockTimer ??= setTimeout(() => {
        this.unlockTimer = null;
        this.flush(true);
      }, this.options.unlockDelayMs);
      return;
    }
    if (this.unlockTimer) {
      clearTimeout(this.unlockTimer);
      this.unlockTimer = null;
    }
    if (this.lockQueue.length === 0 && this.unlockQueue.length === 0 && !this.handoff.hasPrewakes())
      return;
    const client = this.client;
    const generation = this.generation;
    const noticesAtSend = this.handoff.notices;
    const { prewakes, wakeHere } = this.handoff.takePrewakes();
    const batch = makeBatch(
      this.unlockQueue.splice(0),
      this.lockQueue.splice(0),
      prewakes,
      wakeHere,
    );
    const { unlocks, singles, multis } = batch;
    const locks = [...singles, ...multis];
    let answered: () => void = () => undefined;
    if (prewakes.length > 0) {
      const prewaking = new Promise<void>((resolve) => (answered = resolve));
      for (const hold of prewakes) hold.prewaking = prewaking;
    }

    this.statements++;
    this.inFlightSince = performance.now();
    this.inFlight = client
      .query<BatchRow>(batchQuery(this.options.sql, batch))
      .then(
        ({ rows }) => {
          if (generation !== this.generation) {
            // The connection died after answering: whatever this statement took died with it.
            const unavailable = lockSessionUnavailable("the connection was lost");
            for (const request of locks) request.reject(unavailable);
            for (const hold of unlocks) hold.settle(LOST);
            return;
          }
          const answer = decodeBatch(rows);
          if (!this.checkBackend(client, answer.backendPid, "a lock statement")) {
            // What it took is on another backend, out of reach: none of it is granted.
            for (const request of locks) {
              for (const k of request.slots) this.pending.delete(k);
              request.reject(this.refusal!);
            }
            for (const hold of unlocks) hold.settle(LOST);
            return;
          }
          for (const [i, key] of answer.slots)
            this.settleLock(multis[i - 1]!, key, generation, false);
          for (const [i, jobId] of answer.prewoken)
            this.handoff.prewoke(prewakes[i - 1]!, jobId, wakeHere);
          unlocks.forEach((hold, index) =>
            this.settleUnlock(hold, !answer.failedUnlocks.has(index + 1)),
          );
          singles.forEach((r, index) => {
            const op = answer.singles.get(index + 1);
            if (op === undefined || op === BatchOp.LOCKED_WITH_LINE) {
              if (r.waits) this.handoff.counts.afterRelease++;
              this.settleLock(r, r.slots[0]!, generation, op === BatchOp.LOCKED_WITH_LINE);
            } else if (op === BatchOp.WAIT_FOR_RELEASE && (r.waits ?? 0) < 2)
              this.handoff.awaitRelease(r, noticesAtSend);
            else this.settleLock(r, null, generation, false);
          });
        },
        (error: Error) => {
          const unavailable = lockSessionUnavailable("a lock statement failed", error);
          for (const request of locks) {
            for (const k of request.slots) this.pending.delete(k);
            request.reject(unavailable);
          }
          for (const hold of unlocks) hold.settle(LOST);
          if (generation === this.generation) {
            this.options.onWarning("A lock statement failed; dropping the lock session", error);
            this.handleLost(client, error);
          }
        },
      )
      .finally(() => {
        for (const hold of prewakes) hold.prewaking = null;
        answered();
        this.inFlight = null;
        this.flush();
      });
  }

  /** Settles a lock request with the key it took (`line`: others wait in line for it), or none. */
  private settleLock(
    request: LockRequest,
    key: string | null,
    generation: number,
    line: boolean,
  ): void {
    for (const k of request.slots) {
      this.pending.delete(k);
      this.handoff.answered(k);
    }
    if (key === null) {
      request.resolve({ acquired: false, local: false });
      return;
    }
    request.resolve({ acquired: true, hold: this.grant(request, key, generation, line) });
  }

  /** Makes the hold of `key` for `request` (whose key it is now) and plans its early wake if it has a line. */
  private grant(request: LockRequest, key: string, generation: number, line: boolean): HoldImpl {
    const index = request.slots.length === 1 ? 0 : request.slots.indexOf(key);
    const hold = new HoldImpl(
      this,
      request.keys[index] ?? BigInt(key),
      key,
      generation,
      request.info,
    );
    this.holds.set(key, hold);
    this.registryDirty = true;
    if (line) this.handoff.planPrewake(hold);
    return hold;
  }

  private settleUnlock(hold: HoldImpl, ok: boolean): void {
    if (this.holds.get(hold.keyText) === hold) {
      this.holds.delete(hold.keyText);
      this.handoff.released(hold.keyText);
    }
    this.registryDirty = true;
    if (!ok) {
      this.options.onWarning(
        `pg_advisory_unlock(${hold.keyText}) returned false: the lock session did not hold the key it was releasing`,
      );
    }
    hold.settle(ok ? RELEASED : UNVERIFIED);
  }

  /**
   * Closes the connection, which releases every lock it holds. Holds still open are marked lost and their
   * signals abort. Idempotent.
   */
  async close(): Promise<void> {
    if (this.state === "closed") return;
    this.state = "closed";
    for (const timer of this.timers.splice(0)) clearInterval(timer);
    if (this.unlockTimer) clearTimeout(this.unlockTimer);
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    await this.connecting?.catch(() => undefined);
    await this.inFlight?.catch(() => undefined);
    await Promise.allSettled([...this.sideQueries]);
    this.generation++;
    const unavailable = lockSessionUnavailable("the Locks instance was released");
    this.handoff.dropAll(unavailable);
    for (const request of this.lockQueue.splice(0)) request.reject(unavailable);
    for (const hold of this.unlockQueue.splice(0)) hold.settle(LOST);
    const open = [...this.holds.values()];
    this.holds.clear();
    this.pending.clear();
    const reason = lockLost(new Error("The Locks instance was released"));
    for (const hold of open) hold.markLost(reason);
    this.abortLossSignal(reason);
    this.tellReadyWaiters();
    const client = this.client;
    this.client = null;
    if (client) {
      client.removeAllListeners("end");
      client.on("error", () => undefined);
      await client.end().catch(() => undefined);
    }
  }
}
