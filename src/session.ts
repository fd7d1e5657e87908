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
 *     any state ──close()──▶ closed
 *
 * Invariants:
 * - Session advisory locks are re-entrant, so PostgreSQL cannot tell two jobs of this process apart. This
 *   module does: a key is held by at most one `Hold` (`holds`), and a key that is being acquired or
 *   released (`pending`) counts as held. A second job asking for such a key gets a conflict without a
 *   round trip, never a re-entrant "success".
 * - Requests are coalesced: while one statement is in flight, every lock and unlock request queues up, and
 *   the next statement carries all of them (`lockBatch` in sql.ts, or `lockBatchPlain` when they are only
 *   plain locks and unlocks). One statement is in flight at a time.
 * - Every hold belongs to a generation (one per connection). When the connection is lost, the generation
 *   changes, every hold is marked lost and its signal aborts, and a late release of such a hold is a no-op:
 *   it can never unlock a key that a hold of the new connection now owns.
 * - A failed lock statement leaves the session's state uncertain, so the connection is destroyed (which
 *   releases everything) rather than reused.
 * - While the session is not ready, acquisition fails at once with GWL_LOCK_SESSION_UNAVAILABLE: no job
 *   ever runs unlocked.
 * - A key passes without an unlock only from a finished hold to the job that hold woke early (`prewoken`,
 *   waiting in `handovers`): the old hold is settled before the new one is made, and PostgreSQL sees the key
 *   held throughout. A job woken early by another session waits in `awaitingRelease`, its key still
 *   `pending`, for the release's notification or its time limit, then tries the key again.
 */
import pg from "pg";
import type { ClientConfig } from "pg";
import { lockLost, lockSessionUnavailable } from "./errors.js";
import { lockFlag } from "./key.js";
import type { IdleWorkers } from "./idle.js";
import type { Sql } from "./sql.js";

export type SessionState = "idle" | "connecting" | "ready" | "broken" | "closed";

/** What a hold is for, written to the holder registry for operators. */
export interface HoldInfo {
  taskIdentifier: string;
  jobId: string | null;
  /** The key whose waiters (parked rescheduled jobs) to wake on release, if any. */
  wakeKey: bigint | null;
  /**
   * For a `reschedule` hold whose key has a line: when, counted from the start of the hold, to wake the first
   * job in line early, so that it is fetched while this one still runs (null: only at the release).
   */
  prewakeAfterMs?: number | null;
  /** For a job woken early: how long it waits for its key's release before it parks again. */
  releaseWaitMs?: number;
}

export interface ReleaseResult {
  /** True when PostgreSQL confirmed the unlock. */
  released: boolean;
  /** `ok`; `lost` when the session died first (the lock went with it); `unverified` when the unlock returned false. */
  outcome: "ok" | "lost" | "unverified";
}

/** A key held by this process on the lock session. */
export interface Hold {
  readonly key: bigint;
  readonly info: HoldInfo;
  readonly since: Date;
  /** Whether the connection this hold was taken on is gone, and the key with it. */
  readonly lost: boolean;
  /** Aborts (with a GWL_LOCK_LOST error) if the session is lost while the key is held. */
  readonly signal: AbortSignal;
  /**
   * Aborts (with a GWL_LOCK_LOST error) when the connection this hold was taken on is lost: one signal
   * shared by every hold of that connection, so it may also abort after this hold was released.
   */
  readonly sessionSignal: AbortSignal;
  /** Releases the key. Idempotent; resolves once PostgreSQL answered (or at once if the hold was lost). */
  release(): Promise<ReleaseResult>;
  /** Releases the key like `release()`, for a caller that does not wait for the answer (no promise made). */
  releaseQuietly(): void;
}

export type AcquireResult = { acquired: true; hold: Hold } | { acquired: false; local: boolean };

export interface LockSessionOptions {
  sql: Sql;
  /** Idle workers of this process's attached runners, which fetch a job woken early here. */
  idleWorkers?: IdleWorkers;
  client: ClientConfig;
  /** Ensures the library's schema exists; called before the first connection. */
  prepare(): Promise<void>;
  onLost(holds: Hold[], error: Error): void;
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

const OK: ReleaseResult = Object.freeze({ released: true, outcome: "ok" });
const LOST: ReleaseResult = Object.freeze({ released: false, outcome: "lost" });
const UNVERIFIED: ReleaseResult = Object.freeze({ released: false, outcome: "unverified" });

class HoldImpl implements Hold {
  private controller: AbortController | undefined;
  /** The timer of this hold's early wake of the next job in line (see planPrewake). */
  prewakeTimer: NodeJS.Timeout | undefined;
  /** The statement carrying this hold's early wake, until it answered. */
  prewaking: Promise<void> | null = null;
  private lostReason: Error | undefined;
  private readonly sinceMs = Date.now();
  lost = false;
  /** The unlock was asked for (and until `result`, is on its way). */
  releaseRequested = false;
  private result: ReleaseResult | undefined;
  private answered: Promise<ReleaseResult> | undefined;
  private resolveAnswered: ((result: ReleaseResult) => void) | undefined;
  constructor(
    readonly session: LockSession,
    readonly key: bigint,
    readonly keyText: string,
    readonly generation: number,
    readonly info: HoldInfo,
  ) {}
  get since(): Date {
    return new Date(this.sinceMs);
  }
  /** Made on first use: most jobs never look at it. */
  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.lostReason) this.controller.abort(this.lostReason);
    }
    return this.controller.signal;
  }
  get sessionSignal(): AbortSignal {
    return this.lost ? this.signal : this.session.lossSignal();
  }
  cancelPrewake(): void {
    if (this.prewakeTimer) clearTimeout(this.prewakeTimer);
    this.prewakeTimer = undefined;
  }
  markLost(reason: Error): void {
    this.cancelPrewake();
    this.lost = true;
    this.lostReason = reason;
    this.controller?.abort(reason);
  }
  release(): Promise<ReleaseResult> {
    this.releaseQuietly();
    this.answered ??= this.result
      ? Promise.resolve(this.result)
      : new Promise<ReleaseResult>((resolve) => (this.resolveAnswered = resolve));
    return this.answered;
  }
  releaseQuietly(): void {
    if (this.releaseRequested) return;
    this.releaseRequested = true;
    this.session.release(this);
  }
  /** The unlock's answer (called once, by the session). */
  settle(result: ReleaseResult): void {
    this.result = result;
    this.resolveAnswered?.(result);
  }
}

interface LockRequest {
  slots: string[];
  /** The same keys as bigints, kept to avoid parsing them back. */
  keys: bigint[];
  info: HoldInfo;
  resolve(result: AcquireResult): void;
  reject(error: Error): void;
  /** How many times this request, woken early, has waited for its key's release (see awaitRelease). */
  waits?: number;
}

/** Who takes an acquisition's outcome without a promise: null when it failed (see acquireInto). */
export interface AcquireReceiver {
  settle(result: AcquireResult | null): void;
}

/**
 * A queued lock request and its outcome, which goes to its receiver, if any, and to a promise made only when
 * someone awaits it. Lock-ahead takes it by receiver: per prefetched job, two promises, two closures and a
 * microtask fewer than a promise and its `then` (measured with the session alone: about a quarter less memory
 * allocated per key). Settles once; later calls are ignored, as a promise's would be.
 */
class Acquisition implements LockRequest {
  waits?: number;
  private done = false;
  private value: AcquireResult | undefined;
  private error: Error | undefined;
  private made: Promise<AcquireResult> | undefined;
  private resolveMade: ((result: AcquireResult) => void) | undefined;
  private rejectMade: ((error: Error) => void) | undefined;
  constructor(
    readonly slots: string[],
    readonly keys: bigint[],
    readonly info: HoldInfo,
    private readonly receiver: AcquireReceiver | undefined,
  ) {}
  resolve(result: AcquireResult): void {
    if (this.done) return;
    this.done = true;
    this.value = result;
    this.receiver?.settle(result);
    this.resolveMade?.(result);
  }
  reject(error: Error): void {
    if (this.done) return;
    this.done = true;
    this.error = error;
    this.receiver?.settle(null);
    this.rejectMade?.(error);
  }
  promise(): Promise<AcquireResult> {
    this.made ??= !this.done
      ? new Promise<AcquireResult>((resolve, reject) => {
          this.resolveMade = resolve;
          this.rejectMade = reject;
        })
      : this.error
        ? Promise.reject(this.error)
        : Promise.resolve(this.value!);
    return this.made;
  }
}

/** A request that waits for its key (a job woken early waits for its holder to finish). */
interface Waiting {
  request: LockRequest;
  timer: NodeJS.Timeout;
}

/** What the session has done about hand-offs, for `locks.status()`. */
export interface HandoffCounts {
  /** Early wakes of the next job in line that woke a job. */
  prewakes: number;
  /** Keys passed from a finished job to the next one in this process, without an unlock. */
  handedOver: number;
  /** Keys taken by a job woken early after waiting for another session's release. */
  afterRelease: number;
  /** Early wakes left to an idle worker of this process to fetch (a runner given to `locks.attach`). */
  wokenHere: number;
}

/**
 * A PostgreSQL array literal of integers (keys, job ids; null as NULL). node-postgres would quote every
 * element and run two regular expressions over it: measured alone, with batches of 126 locks and 126 unlocks,
 * this saves about 0.3 µs of Node.js CPU per key. Every element is an integer by construction (a bigint, or
 * the decimal text of one: graphile-worker's job ids, a key's text).
 */
function integerArray(values: ReadonlyArray<bigint | string | null>): string {
  let literal = "{";
  for (let i = 0; i < values.length; i++) {
    if (i > 0) literal += ",";
    const value = values[i];
    literal += value === null ? "NULL" : String(value);
  }
  return literal + "}";
}

/** How long a job woken early waits for its key (every such job is a `reschedule` job, whose info sets it). */
function releaseWaitMs(info: HoldInfo): number {
  return info.releaseWaitMs ?? 100;
}

export class LockSession {
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
  /** `reschedule` jobs waiting for a hold's release, by hold (see acquireSlowly). */
  private readonly successorLines = new Map<HoldImpl, Set<bigint>>();
  /** Acquisitions in this process waiting for a key this process is releasing. */
  private successorsWaiting = 0;
  /** Keys whose first waiter a hold of this process woke early, with the woken job's id. */
  private readonly prewoken = new Map<string, string>();
  /** Holds whose key's first waiter to wake early, in the next statement. */
  private prewakeQueue: HoldImpl[] = [];
  /** Jobs woken early that wait for a hold of this process to pass them its key (see release). */
  private readonly handovers = new Map<string, Waiting>();
  /** Jobs woken early that wait for another session's release of their key (see awaitRelease). */
  private readonly awaitingRelease = new Map<string, Waiting>();
  /** For keys being acquired: the number of the last release notification seen for each. */
  private readonly releaseNotices = new Map<string, number>();
  private notices = 0;
  readonly handoffs: HandoffCounts = { prewakes: 0, handedOver: 0, afterRelease: 0, wokenHere: 0 };
  private registryDirty = false;
  private readonly timers: NodeJS.Timeout[] = [];
  /** Heartbeats, registry writes and sweeps in flight, so that close() can wait for them. */
  private readonly sideQueries = new Set<Promise<unknown>>();
  /** Aborts when the current connection is lost (made on first use, one per connection). */
  private lossController: AbortController | undefined;
  /** Statements sent on the lock session, for the benchmark's statements-per-job figure. */
  statements = 0;
  /** Callers of `whenReady` waiting for the session, told when it becomes ready or closes. */
  private readonly readyWaiters = new Set<() => void>();

  constructor(private readonly options: LockSessionOptions) {}

  get currentState(): SessionState {
    return this.state;
  }

  /** The backend pid of the current connection, if connected. */
  get pid(): number | null {
    return (this.client as unknown as { processID?: number } | null)?.processID ?? null;
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
      if (hold.info.wakeKey !== null && !hold.releaseRequested && !this.prewoken.has(hold.keyText))
        flags.push(lockFlag(hold.keyText));
    }
    return flags;
  }

  /** Whether this process holds, or is acquiring or releasing, any of `keys`. */
  holdsAny(keys: readonly bigint[]): boolean {
    return keys.some((k) => !this.isFree(k.toString()));
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
      if (info.wakeKey !== null) {
        const acquiring = keys.map((k) => this.pending.get(k)).find((p) => p !== undefined);
        if (acquiring) {
          await acquiring.promise().catch(() => undefined);
          continue;
        }
      }
      // A key whose job has finished and whose unlock is on its way is not a conflict: wait for the unlock.
      const releasing = keys.map((k) => this.holds.get(k)).find((h) => h?.releaseRequested);
      if (!releasing) {
        // The job a hold of this process woke early waits for that hold to pass it the key. It may come
        // before the early wake's answer (a worker fetching at that moment): then wait for the answer first.
        const key = keys[0]!;
        if (keys.length === 1 && info.wakeKey !== null && info.jobId !== null) {
          const waking = this.holds.get(key)?.prewaking;
          if (waking) {
            await waking;
            continue;
          }
          if (this.prewoken.get(key) === info.jobId && !this.handovers.has(key))
            return this.awaitHandover(key, slots, info);
        }
        return { acquired: false, local: true };
      }
      // Jobs that wait their turn and meet the same release go on in job id order (the enqueue order of
      // first fetches), the job woken early first: the first takes the key, the others will find it held
      // and park behind it.
      const line = info.wakeKey !== null && info.jobId !== null ? this.lineFor(releasing) : null;
      const me = line ? BigInt(info.jobId!) : 0n;
      line?.add(me);
      // The job woken early for this key goes first (its place in line is older than any fresh job's id).
      const early = line ? this.prewoken.get(keys[0]!) : undefined;
      this.successorsWaiting++;
      this.scheduleFlush();
      try {
        await releasing.release();
      } finally {
        this.successorsWaiting--;
      }
      if (line) {
        const first =
          early !== undefined && line.has(BigInt(early))
            ? BigInt(early)
            : [...line].reduce((a, b) => (b < a ? b : a));
        line.delete(me);
        if (line.size === 0) this.successorLines.delete(releasing);
        if (first !== me) return { acquired: false, local: true };
      }
    }
    return this.queueLock(
      free,
      free.length === slots.length ? slots : free.map((k) => BigInt(k)),
      info,
      undefined,
    ).promise();
  }

  /**
   * Waits, up to the job's `releaseWaitMs`, for the hold of `key` to pass it the key when it is released
   * (release); resolves a local conflict (the job parks again) when the wait runs out.
   */
  private awaitHandover(
    key: string,
    slots: readonly bigint[],
    info: HoldInfo,
  ): Promise<AcquireResult> {
    return new Promise<AcquireResult>((resolve, reject) => {
      const request: LockRequest = { slots: [key], keys: slots as bigint[], info, resolve, reject };
      this.waitIn(this.handovers, request, () => resolve({ acquired: false, local: true }));
    });
  }

  /** Parks `request` in `waiting` under its key for its `releaseWaitMs`, then takes it out and calls `onTimeout`. */
  private waitIn(waiting: Map<string, Waiting>, request: LockRequest, onTimeout: () => void): void {
    const key = request.slots[0]!;
    const timer = setTimeout(() => {
      if (waiting.get(key)?.timer !== timer) return;
      waiting.delete(key);
      onTimeout();
    }, releaseWaitMs(request.info));
    waiting.set(key, { request, timer });
  }

  /** Sends `request` with the next lock statement again. */
  private retryLock(request: LockRequest): void {
    this.lockQueue.push(request);
    this.scheduleFlush();
  }

  /**
   * A job woken early found its key still held by another session: it waits for the release's notification
   * (or, at most, its `releaseWaitMs`) and tries again, its key still pending meanwhile. A notification that
   * came while its statement was on its way means the key is already free: it tries again at once.
   */
  private awaitRelease(request: LockRequest, noticesAtSend: number): void {
    request.waits = (request.waits ?? 0) + 1;
    if ((this.releaseNotices.get(request.slots[0]!) ?? 0) > noticesAtSend) this.retryLock(request);
    else this.waitIn(this.awaitingRelease, request, () => this.retryLock(request));
  }

  /** A release notification: a key that a job woken early may be waiting for is free. */
  private onReleaseNotice(key: string): void {
    if (!this.pending.has(key)) return;
    this.releaseNotices.set(key, ++this.notices);
    const waiting = this.awaitingRelease.get(key);
    if (!waiting) return;
    clearTimeout(waiting.timer);
    this.awaitingRelease.delete(key);
    this.retryLock(waiting.request);
  }

  /** Starts the timer of `hold`'s early wake of the next job in line, if its task has one. */
  private planPrewake(hold: HoldImpl): void {
    const after = hold.info.prewakeAfterMs;
    if (after === null || after === undefined) return;
    if (after <= 0) {
      this.prewakeQueue.push(hold);
      this.scheduleFlush();
      return;
    }
    hold.prewakeTimer = setTimeout(() => {
      hold.prewakeTimer = undefined;
      if (this.holds.get(hold.keyText) !== hold || hold.releaseRequested) return;
      this.prewakeQueue.push(hold);
      this.scheduleFlush();
    }, after);
  }

  /** The job ids of `reschedule` jobs waiting for `hold`'s release. */
  private lineFor(hold: HoldImpl): Set<bigint> {
    let line = this.successorLines.get(hold);
    if (!line) this.successorLines.set(hold, (line = new Set()));
    return line;
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
   * this process, the key passes to that job instead, without an unlock: PostgreSQL sees the key held
   * throughout, and the finished job's hold ends before the next job's begins.
   */
  release(hold: HoldImpl): void {
    hold.cancelPrewake();
    if (hold.lost || hold.generation !== this.generation || this.state !== "ready") {
      hold.settle(LOST);
      return;
    }
    const key = hold.keyText;
    if (this.holds.get(key) === hold) {
      const next = this.handovers.get(key);
      if (next) {
        this.prewoken.delete(key);
        clearTimeout(next.timer);
        this.handovers.delete(key);
        this.holds.delete(key);
        hold.settle(OK);
        this.handoffs.handedOver++;
        // The next job was woken from a line, so it is taken to have one behind it.
        next.request.resolve({
          acquired: true,
          hold: this.grant(next.request, key, hold.generation, true),
        });
        return;
      }
    }
    this.unlockQueue.push(hold);
    this.scheduleFlush();
  }

  /**
   * Resolves true as soon as the session is ready (connecting it if it never was), false when it is still
   * not ready after `timeoutMs`, or is closed. Never rejects.
   */
  whenReady(timeoutMs: number): Promise<boolean> {
    if (this.state === "ready") return Promise.resolve(true);
    if (this.state === "closed" || timeoutMs <= 0) return Promise.resolve(false);
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
    if (this.state !== "ready") throw lockSessionUnavailable("could not connect");
  }

  private async ensureReady(): Promise<void> {
    switch (this.state) {
      case "ready":
        return;
      case "closed":
        throw lockSessionUnavailable("the Locks instance was released");
      case "broken":
        throw lockSessionUnavailable("reconnecting");
      case "idle":
      case "connecting":
        await this.connect();
        if ((this.state as SessionState) !== "ready")
          throw lockSessionUnavailable("could not connect");
    }
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
    try {
      await this.options.prepare();
      await client.connect();
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
          this.onReleaseNotice(message.payload);
      });
      await client.query(`listen ${this.options.sql.releaseChannel}`);
    } catch (error) {
      client.removeAllListeners("end");
      client.end().catch(() => undefined);
      if (this.isClosed()) return;
      this.state = "broken";
      this.options.onWarning("The lock session could not connect; retrying", error);
      this.scheduleReconnect();
      return;
    }
    if (this.isClosed()) {
      client.removeAllListeners("end");
      await client.end().catch(() => undefined);
      return;
    }
    this.client = client;
    this.state = "ready";
    this.reconnectAttempt = 0;
    this.registryDirty = this.holds.size > 0;
    if (this.timers.length === 0) this.startTimers();
    this.options.onConnected();
    this.scheduleFlush();
    this.tellReadyWaiters();
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
      client.query(this.options.sql.heartbeat).then(
        () => {
          clearTimeout(timer);
          this.heartbeatPending = false;
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

  /** The connection of this generation failed: everything it held is gone. */
  private handleLost(client: pg.Client | null, error: Error): void {
    if (client !== this.client || this.state !== "ready") return;
    this.generation++;
    this.client = null;
    this.state = "broken";
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
    const unavailable = lockSessionUnavailable("the connection was lost", error);
    this.dropWaiting(unavailable);
    for (const request of this.lockQueue.splice(0)) request.reject(unavailable);
    for (const hold of this.unlockQueue.splice(0)) hold.settle(LOST);
    const reason = lockLost(error);
    for (const hold of lost) hold.markLost(reason);
    this.abortLossSignal(reason);
    this.options.onLost(lost, error);
    this.scheduleReconnect();
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
      this.prewakeQueue.length === 0 &&
      this.successorsWaiting === 0 &&
      this.unlockQueue.every((hold) => hold.info.wakeKey === null)
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
    if (
      this.lockQueue.length === 0 &&
      this.unlockQueue.length === 0 &&
      this.prewakeQueue.length === 0
    )
      return;
    const client = this.client;
    const generation = this.generation;
    const noticesAtSend = this.notices;
    const unlocks = this.unlockQueue.splice(0);
    const locks = this.lockQueue.splice(0);
    // A hold that ended since its early wake was queued has woken its line at its release already.
    const prewakes = this.prewakeQueue
      .splice(0)
      .filter((hold) => this.holds.get(hold.keyText) === hold && !hold.releaseRequested);
    const waking = unlocks.filter((hold) => hold.info.wakeKey !== null);
    // Jobs woken early are fetched by idle workers of this process when there are enough of them (nudged
    // when the wakes are answered); otherwise every worker hears of them.
    const idle = this.options.idleWorkers;
    const wakeHere = prewakes.length > 0 && idle !== undefined && idle.count >= prewakes.length;
    let answered: () => void = () => undefined;
    if (prewakes.length > 0) {
      const prewaking = new Promise<void>((resolve) => (answered = resolve));
      for (const hold of prewakes) hold.prewaking = prewaking;
    }
    const singles: LockRequest[] = [];
    const multis: LockRequest[] = [];
    for (const request of locks) (request.slots.length === 1 ? singles : multis).push(request);

    const { lockBatch, lockBatchPlain } = this.options.sql;
    const plain =
      multis.length === 0 &&
      waking.length === 0 &&
      prewakes.length === 0 &&
      singles.every((r) => r.info.wakeKey === null);

    // $1 and $2 of both statements.
    const unlockKeys = integerArray(unlocks.map((hold) => hold.keyText));
    const singleKeys = integerArray(singles.map((r) => r.slots[0]!));

    this.statements++;
    this.inFlightSince = performance.now();
    this.inFlight = client
      .query<{ op: number; i: number; key: string | null }>(
        plain
          ? {
              name: lockBatchPlain.name,
              text: lockBatchPlain.text,
              values: [unlockKeys, singleKeys],
            }
          : {
              name: lockBatch.name,
              text: lockBatch.text,
              values: [
                unlockKeys,
                singleKeys,
                multis.map((r) => r.slots.join(",")),
                integerArray(waking.map((hold) => hold.info.wakeKey!)),
                // Jobs that wait their turn (`reschedule`) take a free key only when no parked job is ahead.
                integerArray(singles.map((r) => (r.info.wakeKey === null ? null : r.info.jobId))),
                integerArray(prewakes.map((hold) => hold.keyText)),
                integerArray(waking.map((hold) => hold.info.jobId)),
                !wakeHere,
              ],
            },
      )
      .then(
        ({ rows }) => {
          if (generation !== this.generation) {
            // The connection died after answering: whatever this statement took died with it.
            const unavailable = lockSessionUnavailable("the connection was lost");
            for (const request of locks) request.reject(unavailable);
            for (const hold of unlocks) hold.settle(LOST);
            return;
          }
          // Rows name the failed unlocks and single locks, and every semaphore request's slot (see
          // lockBatch for the rest).
          const failedUnlocks = new Set<number>();
          const singleRows = new Map<number, number>();
          for (const row of rows) {
            if (row.op === 0) failedUnlocks.add(row.i);
            else if (row.op === 1 || row.op === 4 || row.op === 5) singleRows.set(row.i, row.op);
            else if (row.op === 2) this.settleLock(multis[row.i - 1]!, row.key, generation, false);
            else if (row.op === 6) {
              // (a hold released meanwhile has told the woken job at its release, in the database)
              const hold = prewakes[row.i - 1]!;
              if (this.holds.get(hold.keyText) === hold && !hold.releaseRequested)
                this.prewoken.set(hold.keyText, row.key!);
              this.handoffs.prewakes++;
              // (should no worker be idle any more, the release announces the job if it is still unfetched)
              if (wakeHere && idle.nudge()) this.handoffs.wokenHere++;
            }
          }
          unlocks.forEach((hold, index) => this.settleUnlock(hold, !failedUnlocks.has(index + 1)));
          singles.forEach((r, index) => {
            const op = singleRows.get(index + 1);
            if (op === undefined || op === 5) {
              if (r.waits) this.handoffs.afterRelease++;
              this.settleLock(r, r.slots[0]!, generation, op === 5);
            } else if (op === 4 && (r.waits ?? 0) < 2) this.awaitRelease(r, noticesAtSend);
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
      if (this.releaseNotices.size > 0) this.releaseNotices.delete(k);
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
    if (line) this.planPrewake(hold);
    return hold;
  }

  /** The connection is gone: jobs waiting for a key fail as if they had asked now, and early wakes are moot. */
  private dropWaiting(error: Error): void {
    for (const waiting of [...this.handovers.values(), ...this.awaitingRelease.values()]) {
      clearTimeout(waiting.timer);
      waiting.request.reject(error);
    }
    this.handovers.clear();
    this.awaitingRelease.clear();
    this.releaseNotices.clear();
    this.prewoken.clear();
    this.prewakeQueue = [];
  }

  private settleUnlock(hold: HoldImpl, ok: boolean): void {
    if (this.holds.get(hold.keyText) === hold) {
      this.holds.delete(hold.keyText);
      this.prewoken.delete(hold.keyText);
    }
    this.registryDirty = true;
    if (!ok) {
      this.options.onWarning(
        `pg_advisory_unlock(${hold.keyText}) returned false: the lock session did not hold the key it was releasing`,
      );
    }
    hold.settle(ok ? OK : UNVERIFIED);
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
    this.dropWaiting(unavailable);
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
