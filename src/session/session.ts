/**
 * The lock session: which advisory keys this process holds, takes and releases, on the one PostgreSQL
 * connection of a `Locks` instance (connection.ts). That connection is separate from graphile-worker's pool
 * (holding a pool client per running job deadlocks the pool) and shared by every job of every runner in the
 * process. This module owns the lock and unlock queues and sends the lock statement (batch.ts); the holds,
 * the keys being acquired and the settling of a statement's answer are book.ts's (its base class); the
 * connection's state machine and reconnection are connection.ts's, its heartbeat and registry upkeep.ts's.
 *
 * Invariants:
 * - Session advisory locks are re-entrant, so PostgreSQL cannot tell two jobs of this process apart. This
 *   module does: a key is held by at most one `Hold` (`holds`), and a key that is being acquired or
 *   released (`pending`) counts as held. A second job asking for such a key gets a conflict without a
 *   round trip, never a re-entrant "success". A semaphore request (`limit` > 1) counts every slot it tries
 *   as pending but takes at most one: a request that finds its slots pending for another job of this
 *   process waits for that answer and tries the slots still free, so this process's own acquisitions never
 *   turn a job away while a slot is free.
 * - A request of a job with several limits (`limits`) counts every slot it tries as pending and takes one
 *   slot of each limit or none, in its statement (try_lock_all, sql/000002.sql, or for limits of one key each
 *   without a line, one expression: `fastLimits`, sql.ts). Its hold is one
 *   `Hold` registered under each key it took, released in one unlock, marked lost once; it is never handed
 *   over in memory nor woken early (a single key's hand-off cannot promise every limit). A request of this
 *   process may take its slots in the statement that carries their unlock, which runs before its locks.
 * - Requests are coalesced: the requests of one turn of the event loop share a statement (batch.ts). Up to
 *   PIPELINE_DEPTH statements are in flight at once; beyond that, requests queue up and the next statement
 *   carries all of them. PostgreSQL runs them in the order sent, and each request's state (`pending`,
 *   `holds`) settles from its own statement's answer, so no request depends on a statement still in flight.
 * - A statement that hands something on in this process (a hand-over's check, a request for a slot its
 *   unlocks free) or has early wakes beside lock requests, and that wakes lines or jobs early, sends those
 *   wakes in a second statement of its transaction, in the same write (two-part.ts): its requests
 *   settle at the first statement's answer, its early wakes at the second's. The line locks, taken by the
 *   first before its unlocks, last until the second ends, as in one statement. The second takes and releases
 *   no session lock, so its failure leaves the session's state known: the connection stays, and the lines
 *   its rolled-back wakes left are woken again in a statement of their own (book.ts, `wakesFailed`). A batch
 *   of requests with their rate stays one statement (batch.ts, `batchQueries`).
 * - Every hold belongs to a generation (one per connection). When the connection is lost, the generation
 *   changes, every hold is marked lost and its signal aborts, and a late release of such a hold is a no-op:
 *   it can never unlock a key that a hold of the new connection now owns.
 * - A failed lock statement leaves the session's state uncertain, so the connection is destroyed (which
 *   releases everything) rather than reused; except a statement PostgreSQL refused for want of resources
 *   (SQLSTATE class 53, a full lock table), after which the connection is sound: the session releases
 *   whatever of the statement's keys its backend still holds (`recover`), settles its unlocks as released
 *   and fails its lock requests with GWL_LOCK_TABLE_FULL. Nobody else's hold is touched.
 * - While the connection is not ready, acquisition fails at once with GWL_LOCK_SESSION_UNAVAILABLE (or,
 *   behind a transaction pooler, GWL_LOCK_SESSION_POOLED): no job ever runs unlocked.
 * - Every lock statement answers with `pg_backend_pid()`, checked against the connection's backend: what a
 *   statement took on another backend is never granted.
 * - A key passes without an unlock only from a finished hold to the job that hold woke early (handoff.ts):
 *   the old hold is settled before the new one is made, and PostgreSQL sees the key held throughout. A job
 *   woken early by another session waits, its key still `pending`, for the release's notification or its
 *   time limit, then tries the key again.
 * - A supersede notice (supersede.ts) only aborts the signals of the holds of the key's older jobs: it never
 *   releases a key, which stays held until its job returns.
 */
import { batchQueries, makeBatch, type BatchRow } from "./batch.js";
import { SessionBook } from "./book.js";
import { LockConnection, type ConnectionState, type LockConnectionOptions } from "./connection.js";
import { lockLost, lockSessionUnavailable, SupersededError, type LocksError } from "../errors.js";
import { Handoff, type HandoffCounts, type LineWaiter } from "./handoff.js";
import {
  Acquisition,
  HoldImpl,
  LOST,
  RELEASED,
  type AcquireReceiver,
  type AcquireResult,
  type HoldInfo,
  type LockRequest,
  type RateRide,
} from "./holds.js";
import type { IdleWorkers } from "./idle.js";
import { QuietUnlocks } from "./quiet-unlocks.js";
import { parseSupersedeNotice, Supersessions } from "./supersede.js";
import { probeQueued, probeStage } from "./timing-probe.js";
import { TwoPartQuery } from "./two-part.js";
import type { Sql } from "../sql.js";

export interface LockSessionOptions extends LockConnectionOptions {
  sql: Sql;
  /** Idle workers of this process's attached runners, which fetch a job woken early here. */
  idleWorkers?: IdleWorkers;
  onLost(holds: HoldImpl[], error: Error): void;
  onConnected(): void;
}

/**
 * Lock statements in flight at once on a connection in node-postgres's `pipeline` mode (connection.ts opens
 * it so): a lock request made while fewer are unanswered leaves at once in a statement of its own; beyond
 * that, requests queue up for the next statement. Four rather than two shorten the wait for a place in the
 * pipeline and still send about one statement per job; eight make each statement wait behind the others on
 * the server (figures: bench/README.md, section "Pipeline depth").
 */
const PIPELINE_DEPTH = 4;

/**
 * The slots of semaphore request `request` that its statement found held by other sessions: all it tried
 * when it took none, else those before the one it took (they are tried in order).
 */
function slotsHeldElsewhere(request: LockRequest, answer: AcquireResult): readonly string[] {
  if (!answer.acquired) return answer.local ? [] : request.slots;
  const taken = request.slots.indexOf(answer.hold.key.toString());
  return taken < 0 ? [] : request.slots.slice(0, taken);
}

export class LockSession extends SessionBook {
  /**
   * The connection: its state, backend pid, generation, `whenReady` and `warmUp` (connection.ts). Others
   * read it; only the session sends lock statements on it.
   */
  override readonly connection: LockConnection;
  private lockQueue: LockRequest[] = [];
  private unlockQueue: HoldImpl[] = [];
  /** The lock statements in flight, oldest first, each with when it was sent (`performance.now()`). */
  private readonly inFlight: Array<{ sentAt: number; done: Promise<void> }> = [];
  /** PIPELINE_DEPTH on a pipelining connection; 1 with a node-postgres that has no pipeline mode. */
  private maxInFlight = 1;
  private flushScheduled = false;
  /** When unlocks nobody waits for leave (quiet-unlocks.ts). */
  private readonly quiet = new QuietUnlocks(() => this.flush());
  /** Set by close(): queued unlocks leave at once, and nothing else is sent (see flush). */
  private closing = false;
  /** Acquisitions in this process waiting for a key this process is releasing. */
  private successorsWaiting = 0;
  /** Requests of jobs with several limits waiting for a hold of this process to be released (`awaitRelease`). */
  private readonly releaseWatchers = new Set<() => void>();
  /**
   * Requests woken by a release (`releaseWatchers`) that have not yet looked again: the flush waits for
   * them, so that a request queued then rides with the release's unlock.
   */
  private wakingRequests = 0;
  /** Hand-over checks waiting for the answer of the next lock statement (`confirmWithNext`). */
  private confirmQueue: Array<(alive: boolean) => void> = [];
  protected override readonly handoff: Handoff;
  /** Supersessions noticed lately (supersede.ts). */
  private readonly supersessions = new Supersessions();

  constructor(protected override readonly options: LockSessionOptions) {
    super(options);
    this.connection = new LockConnection(options, {
      holds: () => this.openHolds(),
      inFlightSince: () => this.inFlight[0]?.sentAt ?? null,
      onReady: () => {
        const pipelining = (this.connection.client as { pipeline?: boolean } | null)?.pipeline;
        this.maxInFlight = pipelining === true ? PIPELINE_DEPTH : 1;
        this.options.onConnected();
        this.scheduleFlush();
      },
      onLost: (error, refusal) => this.onLost(error, refusal),
      onRefused: (refusal) => {
        for (const request of this.lockQueue.splice(0)) request.reject(refusal);
      },
      onReleaseNotice: (payload) => this.handoff.onReleaseNotice(payload),
      onSupersedeNotice: (payload) => this.onSupersedeNotice(payload),
    });
    this.handoff = new Handoff(
      {
        holdOf: (key) => this.holds.get(key),
        isPending: (key) => this.pending.has(key),
        unlock: (hold) => this.queueUnlock(hold),
        retryLock: (request) => {
          this.lockQueue.push(request);
          this.scheduleFlush();
        },
        scheduleFlush: () => this.scheduleFlush(),
        passKey: (from, request) => {
          this.holds.delete(from.keyText);
          // The next job was woken from a line, so it is taken to have one behind it; its hold counts from now.
          // `from` is answered once the pass is confirmed (passConfirmed): released, or lost with the
          // connection.
          const hold = this.grant(request, from.keyText, from.generation, true);
          hold.passedFrom = from;
          return hold;
        },
        passConfirmed: (hold, alive) => {
          const from = hold.passedFrom;
          hold.passedFrom = null;
          from?.settle(alive ? RELEASED : LOST);
        },
        confirmWithNext: () =>
          new Promise<boolean>((resolve) => {
            this.confirmQueue.push(resolve);
            this.scheduleFlush();
          }),
        unavailable: () =>
          this.connection.refusal ?? lockSessionUnavailable("the connection was lost"),
      },
      options.idleWorkers,
    );
  }

  /**
   * A superseding enqueue committed: the holds of this process for jobs of its key older than the new one
   * abort their jobs' signals with a `SupersededError` (the jobs keep their keys until they return), and the
   * notice is remembered for the jobs of the key still on their way to it (supersede.ts).
   */
  private onSupersedeNotice(payload: string): void {
    const notice = parseSupersedeNotice(payload);
    if (!notice) return;
    this.supersessions.record(notice);
    for (const hold of this.holds.values()) {
      const { info } = hold;
      if (!info.reschedule || info.jobId === null || hold.releaseRequested) continue;
      if (info.wakeKey.toString() !== notice.key || BigInt(info.jobId) >= notice.by) continue;
      hold.supersede(
        new SupersededError(info.taskIdentifier, info.wakeKey, info.jobId, notice.by.toString()),
      );
    }
  }

  /** The id of the job that superseded job `jobId` of `key` (slot 0), if this session heard of one lately. */
  supersededBy(key: bigint, jobId: string): string | null {
    return this.supersessions.supersededBy(key.toString(), jobId);
  }

  /** The connection's state. */
  get state(): ConnectionState {
    return this.connection.state;
  }

  /** The backend pid of the connection, if connected. */
  get pid(): number | null {
    return this.connection.pid;
  }

  /** Resolves true as soon as the connection is ready, false when it is still not after `timeoutMs`. */
  whenReady(timeoutMs: number): Promise<boolean> {
    return this.connection.whenReady(timeoutMs);
  }

  /** What the session has done about hand-offs, for `locks.status()`. */
  get handoffs(): HandoffCounts {
    return this.handoff.counts;
  }

  /** Registers a fetched job of `key` about to wait at its worker in the key's line (`waitInLine`). */
  lineWaiter(key: string, jobId: string): LineWaiter {
    return this.handoff.lineWaiter(key, jobId);
  }

  /**
   * A fetched `reschedule` job that met its key held, with its place in the key's line (join_line): it tries
   * the key again each time a release notification names it or a hold here wakes it early (it then takes the
   * key in memory at the release), until it holds it, or `until` (`performance.now()`) passes ("timeout"), or
   * it tried and did not get it, or a job ahead of it parked ("recheck": the caller takes its place in line
   * again, which a job woken from it has left, and looks at its line). `now`: it tries at once (the key looked
   * free, and it next, as it took its place).
   */
  async waitInLine(
    waiter: LineWaiter,
    slots: readonly bigint[],
    info: HoldInfo,
    until: number,
    now: boolean,
  ): Promise<AcquireResult | "timeout" | "recheck"> {
    if (!now) {
      const left = until - performance.now();
      if (left <= 0 || !(await waiter.next(left))) return "timeout";
      if (waiter.takeRecheck()) return "recheck";
    }
    const result = await this.acquire(slots, info);
    if (!result.acquired) return "recheck";
    this.handoff.counts.waitedInLine++;
    return result;
  }

  /** A signal that aborts when the current connection is lost; every hold of this connection shares it. */
  lossSignal(): AbortSignal {
    return this.connection.lossSignal();
  }

  /**
   * Tries the slots in order and takes the first that is free. Resolves `{ acquired: false }` on a
   * conflict (`local: true` when this process itself holds every slot), throws GWL_LOCK_SESSION_UNAVAILABLE
   * when there is no session.
   */
  acquire(
    slots: readonly bigint[],
    info: HoldInfo,
    limits?: ReadonlyArray<readonly bigint[]>,
    ride?: RateRide,
  ): Promise<AcquireResult> {
    if (limits) return this.acquireAll(limits, info);
    return (
      this.queueIfFree(slots, info, undefined, ride)?.promise() ??
      this.acquireSlowly(slots, info, ride)
    );
  }

  /** `acquire`, its outcome given to `receiver` (null if it failed) rather than promised: for lock-ahead. */
  acquireInto(
    slots: readonly bigint[],
    info: HoldInfo,
    receiver: AcquireReceiver,
    limits?: ReadonlyArray<readonly bigint[]>,
  ): void {
    this.quiet.lockAheadAt = performance.now();
    if (!limits && this.queueIfFree(slots, info, receiver)) return;
    (limits ? this.acquireAll(limits, info) : this.acquireSlowly(slots, info)).then(
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
    ride?: RateRide,
  ): Acquisition | null {
    if (this.connection.state !== "ready" || slots.length !== 1) return null;
    const key = slots[0]!.toString();
    return this.isFree(key) ? this.queueLock([key], slots, info, receiver, ride) : null;
  }

  /**
   * `acquire` when the key is not simply free here. A request with a `ride` that ends up taking its key
   * without a statement of its own (passed in memory) comes back without its start counted; a `reschedule`
   * one never does: where its key is held, kept or being taken in this process, it takes nothing and its
   * rate decides first (`rateFirst`), so that it does not hold its key while its rate decides it with no
   * reservation of its own.
   */
  private async acquireSlowly(
    slots: readonly bigint[],
    info: HoldInfo,
    ride?: RateRide,
  ): Promise<AcquireResult> {
    const keys = slots.map(String);
    const semaphore = keys.length > 1;
    /** Slots that a statement this request waited for found held by other sessions (semaphores only). */
    let heldElsewhere: Set<string> | undefined;
    let free: string[];
    for (;;) {
      if (this.connection.state !== "ready") await this.connection.ensureReady();
      free = keys.filter((k) => this.isFree(k) && !heldElsewhere?.has(k));
      if (free.length > 0) break;
      if (ride && info.reschedule) return { acquired: false, local: false, rateFirst: true };
      // Another job of this process is only trying to take these keys. A semaphore request takes one slot of
      // all it tries, and a job that waits its turn (`reschedule`) may fail where this one would not (it may
      // not be that job's turn): wait for that answer, then look again.
      if (semaphore || info.reschedule) {
        const acquiring = keys.map((k) => this.pending.get(k)).find((p) => p !== undefined);
        if (acquiring) {
          const answer = await acquiring.promise().catch(() => undefined);
          if (semaphore && answer)
            for (const k of slotsHeldElsewhere(acquiring, answer))
              (heldElsewhere ??= new Set()).add(k);
          continue;
        }
      }
      // A key kept at its release for the job woken early that is on its way here: that job takes it.
      const kept = keys.length === 1 ? this.handoff.onArrival(keys[0]!, slots, info) : null;
      if (kept) return kept;
      // A key whose job has finished and whose unlock is on its way is not a conflict: wait for the unlock.
      const releasing = keys.map((k) => this.holds.get(k)).find((h) => h?.releaseRequested);
      if (!releasing) {
        const handedOver =
          keys.length === 1 ? this.handoff.onLocalConflict(keys[0]!, slots, info) : null;
        if (!handedOver) return { acquired: false, local: heldElsewhere === undefined };
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
      slots.length === 1 ? ride : undefined,
    ).promise();
  }

  /**
   * A job with several limits: one slot of each, all or nothing, in one statement (try_lock_all). Only the
   * slots this process neither holds nor is acquiring are sent (no re-entrant success), and the slots of a
   * hold of several limits whose unlock is queued for the next statement (`unlockRides`): that statement
   * unlocks them before it tries any slot, so the freed slot passes on in one round trip. A limit with none
   * of those is full here, unless its slots are only being acquired or released by this process: then the
   * request waits for that answer and looks again. A `reschedule` job that finds a limit full, some of its
   * slots held here by jobs with several limits, waits for a hold of this process to be released, for at
   * most its `releaseWaitMs` (`awaitRelease`), and looks again, rather than park at once: its request then
   * rides with that unlock. It holds nothing while it waits, and the statement still puts it behind the jobs
   * waiting in line (is_next). A conflict says which limit was full (`full`).
   */
  private async acquireAll(
    limits: ReadonlyArray<readonly bigint[]>,
    info: HoldInfo,
  ): Promise<AcquireResult> {
    const texts = limits.map((slots) => slots.map(String));
    let until: number | undefined;
    for (;;) {
      if (this.connection.state !== "ready") await this.connection.ensureReady();
      const free: string[][] = [];
      let full = -1;
      for (let i = 0; i < texts.length; i++) {
        const open = texts[i]!.filter((k) => this.isFree(k) || this.unlockRides(k));
        if (open.length === 0) {
          full = i;
          break;
        }
        free.push(open);
      }
      if (full < 0) {
        const rides = free.some((open) => open.some((k) => this.holds.has(k)));
        if (rides) this.handoff.counts.rodeWithUnlock++;
        const flat = free.flat();
        const acquisition = new Acquisition(
          flat,
          flat.map((k) => BigInt(k)),
          info,
          undefined,
        );
        if (rides) acquisition.ridesUnlock = true;
        acquisition.limits = free;
        // (a limit of several slots has no line order: see try_lock_all in sql/000002.sql)
        acquisition.lines = texts.map((slots) => (slots.length === 1 ? slots[0]! : ""));
        probeQueued(acquisition);
        this.lockQueue.push(acquisition);
        this.scheduleFlush();
        for (const k of flat) this.pending.set(k, acquisition);
        return acquisition.promise();
      }
      const keys = texts[full]!;
      const acquiring = keys.map((k) => this.pending.get(k)).find((p) => p !== undefined);
      if (acquiring) {
        await acquiring.promise().catch(() => undefined);
        continue;
      }
      const releasing = keys.map((k) => this.holds.get(k)).find((h) => h?.releaseRequested);
      if (!releasing) {
        if (!info.reschedule || !keys.some((k) => this.holds.get(k)?.stacked))
          return { acquired: false, local: true, full };
        if (until === undefined) {
          until = performance.now() + info.releaseWaitMs;
          this.handoff.counts.waitedHere++;
        }
        if (!(await this.awaitRelease(until))) return { acquired: false, local: true, full };
        this.wakingRequests--;
        // (after this turn's requests, the flush held back for them goes)
        this.scheduleFlush();
        continue;
      }
      this.successorsWaiting++;
      this.scheduleFlush();
      try {
        await releasing.release();
      } finally {
        this.successorsWaiting--;
      }
    }
  }

  /**
   * Whether `key` is a slot of a hold of several limits whose unlock waits in the queue of the next statement,
   * and no request of this process is acquiring it: a request queued now goes in that same statement (the
   * batch takes both queues whole), whose unlocks run before its lock requests (sql.ts, `lockStatementText`). Such a
   * hold is never handed over in memory, so the unlock is certain to be in that statement.
   */
  private unlockRides(key: string): boolean {
    const hold = this.holds.get(key);
    return (
      hold !== undefined &&
      hold.stacked &&
      hold.releaseRequested &&
      !this.pending.has(key) &&
      !this.closing &&
      this.unlockQueue.includes(hold)
    );
  }

  /**
   * Waits until a hold of this process is released (true), or until `until` (false). The caller that was
   * answered true looks again at once and then counts itself out of `wakingRequests`: until then the flush
   * that carries the release's unlock waits, so that a request queued on that look rides with the unlock
   * (`unlockRides`).
   */
  private awaitRelease(until: number): Promise<boolean> {
    const left = until - performance.now();
    if (left <= 0) return Promise.resolve(false);
    return new Promise<boolean>((resolve) => {
      const done = (released: boolean) => {
        clearTimeout(timer);
        this.releaseWatchers.delete(watcher);
        resolve(released);
      };
      const watcher = () => {
        this.wakingRequests++;
        done(true);
      };
      const timer = setTimeout(() => done(false), left);
      this.releaseWatchers.add(watcher);
    });
  }

  /** Queues a lock request for the next statement; its keys count as held meanwhile (`pending`). */
  private queueLock(
    free: string[],
    keys: readonly bigint[],
    info: HoldInfo,
    receiver: AcquireReceiver | undefined,
    ride?: RateRide,
  ): Acquisition {
    const acquisition = new Acquisition(free, keys as bigint[], info, receiver);
    if (ride) acquisition.ride = ride;
    probeQueued(acquisition);
    this.lockQueue.push(acquisition);
    this.scheduleFlush();
    for (const k of free) this.pending.set(k, acquisition);
    return acquisition;
  }

  /**
   * Queues the unlock of `hold`; its answer goes to `hold.settle`. When the job its hold woke early waits in
   * this process, the key passes to that job instead, without an unlock. The hold is marked `handsOffHere`
   * when a job of this process takes its key or slot with that answer: the key passed in memory (answered at
   * the pass's confirmation), or a slot of several limits that a job waiting here (`awaitRelease`) asks for
   * in the statement carrying the unlock.
   */
  release(hold: HoldImpl): void {
    hold.cancelPrewake();
    if (
      hold.lost ||
      hold.generation !== this.connection.generation ||
      this.connection.state !== "ready"
    ) {
      hold.settle(LOST);
      return;
    }
    if (!hold.stacked && this.holds.get(hold.keyText) === hold) {
      if (this.handoff.handOver(hold)) {
        hold.handsOffHere = true;
        return;
      }
      if (this.handoff.keepFor(hold)) return;
    }
    this.queueUnlock(hold);
    if (hold.stacked && this.releaseWatchers.size > 0) {
      hold.handsOffHere = true;
      for (const watcher of [...this.releaseWatchers]) watcher();
    }
  }

  private queueUnlock(hold: HoldImpl): void {
    probeQueued(hold);
    if (this.unlockQueue.length === 0) this.quiet.since = performance.now();
    this.unlockQueue.push(hold);
    this.scheduleFlush();
  }

  /**
   * Sends what is queued at the end of the current turn (a microtask), so that the requests a turn makes
   * share one statement and the first request after a quiet spell leaves without waiting for the event loop.
   * While `maxInFlight` statements are in flight, requests queue up for the one sent when the first answers.
   */
  private scheduleFlush(): void {
    if (this.flushScheduled || this.inFlight.length >= this.maxInFlight) return;
    this.flushScheduled = true;
    queueMicrotask(() => {
      this.flushScheduled = false;
      this.flush();
    });
  }

  /**
   * Whether what is queued is only unlocks that nobody waits for: no lock request, no waiter to wake, no
   * same-process successor. While a statement is in flight, such a batch waits to ride with the next lock
   * request, or goes when the last statement in flight answers: every statement costs both sides a round of
   * socket I/O, and the keys stay held meanwhile, which is never looser. On an idle connection it goes at
   * once, so that a lock request made a moment later does not queue behind it on the server, unless
   * lock-ahead is in use (quiet-unlocks.ts). Leaving at once beats holding them for a lock request to ride
   * with, and beats sending them after graphile-worker's completion and next fetch (figures: bench/README.md,
   * section "Quiet unlocks").
   */
  private onlyQuietUnlocks(): boolean {
    return (
      this.lockQueue.length === 0 &&
      this.confirmQueue.length === 0 &&
      !this.handoff.hasPrewakes() &&
      this.successorsWaiting === 0 &&
      this.unlockQueue.every((hold) => !hold.info.reschedule)
    );
  }

  private flush(): void {
    if (this.wakingRequests > 0) return;
    const { client, generation } = this.connection;
    if (this.inFlight.length >= this.maxInFlight || this.connection.state !== "ready" || !client)
      return;
    if (
      !this.closing &&
      this.onlyQuietUnlocks() &&
      (this.inFlight.length > 0 || this.quiet.hold(this.unlockQueue.length))
    )
      return;
    if (
      this.lockQueue.length === 0 &&
      this.unlockQueue.length === 0 &&
      this.confirmQueue.length === 0 &&
      !this.handoff.hasPrewakes()
    )
      return;
    if (this.closing && this.unlockQueue.length === 0) return;
    this.quiet.end();
    const noticesAtSend = this.handoff.notices;
    // While closing, only unlocks leave: a lock taken now would be lost with the connection at once, its job
    // running unlocked until it saw its signal; queued lock requests fail when the connection goes instead.
    const { prewakes, wakeHere } = this.closing
      ? { prewakes: [], wakeHere: false }
      : this.handoff.takePrewakes();
    const batch = makeBatch(
      this.unlockQueue.splice(0),
      this.closing ? [] : this.lockQueue.splice(0),
      prewakes,
      wakeHere,
    );
    const { unlocks, singles, multis, stacked, rated } = batch;
    const locks = [...singles, ...multis, ...stacked, ...rated];
    // Hand-over checks: this statement, sent after they asked, answers them (see Handoff.confirmHandOver).
    const confirms = this.closing ? [] : this.confirmQueue.splice(0);
    for (const hold of unlocks) probeStage("unlockSent", hold.info.jobId);
    let answered: () => void = () => undefined;
    if (prewakes.length > 0) {
      const prewaking = new Promise<void>((resolve) => (answered = resolve));
      for (const hold of prewakes) hold.prewaking = prewaking;
    }

    this.connection.statements++;
    const sentAt = performance.now();
    // A batch that hands something on in this process (a hand-over's check, a request for a slot its unlocks
    // free) or carries early wakes beside lock requests, and that wakes lines or jobs early, sends its wakes
    // in a second statement of its transaction, answered after the first: those wakes wake somebody, which
    // costs the server more than the rest of the statement, and the jobs waiting for its answer need not wait
    // for them. A batch of other requests and releases goes whole: its lines are mostly empty, and a second
    // statement would cost more than their wake (figures: bench/README.md, section "The wakes after the lock
    // statement's answer").
    const answerFirst =
      confirms.length > 0 ||
      (prewakes.length > 0 && locks.length > 0) ||
      locks.some((request) => request.ridesUnlock === true);
    const { lock, wake } = batchQueries(
      this.options.sql,
      batch,
      this.connection.backendPid!,
      this.connection.claimToken!,
      answerFirst,
    );
    const settle = (rows: BatchRow[]) => {
      this.settleAnswer(
        rows,
        client,
        generation,
        batch,
        locks,
        prewakes,
        wakeHere,
        noticesAtSend,
        sentAt,
      );
      // (an answer from another backend, or one found reset, has ended the generation meanwhile)
      const alive = generation === this.connection.generation;
      for (const confirmed of confirms) confirmed(alive);
    };
    const fail = async (error: Error) => {
      await this.settleFailure(client, generation, locks, unlocks, error);
      // A statement PostgreSQL refused for want of resources leaves the connection sound (book.ts's
      // recover): its checks wait for the next one.
      if (generation === this.connection.generation && this.connection.state === "ready") {
        this.confirmQueue.push(...confirms);
        this.scheduleFlush();
      } else for (const confirmed of confirms) confirmed(false);
    };
    const sent: Promise<void> = wake
      ? new Promise<void>((resolve) => {
          client.query(
            new TwoPartQuery(lock, wake, settle, (end) => {
              if (!end.firstAnswered) resolve(fail(end.error!));
              else if (end.error) resolve(this.wakesFailed(client, generation, unlocks, end.error));
              else {
                this.settleWakes(end.rows, generation, prewakes, wakeHere);
                resolve();
              }
            }),
          );
        })
      : client.query<BatchRow>(lock).then(({ rows }) => settle(rows), fail);
    const done = sent.finally(() => {
      for (const hold of prewakes) hold.prewaking = null;
      answered();
      this.inFlight.splice(
        this.inFlight.findIndex((s) => s.done === done),
        1,
      );
      this.flush();
    });
    this.inFlight.push({ sentAt, done });
  }

  /**
   * Everything the connection held is gone (it was lost, or closed): lock requests fail with `unavailable`,
   * unlocks settle as lost, and every hold is marked lost with `reason` and its signal aborts. Returns the
   * holds that were open.
   */
  private dropAll(unavailable: LocksError, reason: LocksError): HoldImpl[] {
    const open = this.openHolds();
    this.holds.clear();
    this.pending.clear();
    this.handoff.dropAll(unavailable);
    for (const request of this.lockQueue.splice(0)) request.reject(unavailable);
    for (const hold of this.unlockQueue.splice(0)) hold.settle(LOST);
    for (const confirmed of this.confirmQueue.splice(0)) confirmed(false);
    this.quiet.end();
    for (const hold of open) hold.markLost(reason);
    this.connection.abortLossSignal(reason);
    return open;
  }

  /** The connection of this generation failed (connection.ts told): every hold is lost. */
  private onLost(error: Error, refusal: LocksError | null): void {
    const unavailable = refusal ?? lockSessionUnavailable("the connection was lost", error);
    const open = this.dropAll(unavailable, lockLost(error));
    // A hold that passed its key in memory, the pass not yet confirmed, is lost too: its job returned
    // before the loss was noticed (it is listed as such: released, not answered).
    const passing = open.flatMap((hold) => (hold.passedFrom ? [hold.passedFrom] : []));
    this.options.onLost([...passing, ...open], error);
  }

  /**
   * Closes the connection, which releases every lock it holds. Holds still open are marked lost and their
   * signals abort. Idempotent.
   */
  async close(): Promise<void> {
    if (this.connection.state === "closed") return;
    // Unlocks still queued (waiting for a statement to ride) leave first, so that they are answered as
    // released rather than lost with the connection.
    this.closing = true;
    this.handoff.unlockKept();
    while (this.connection.state === "ready" && this.unlockQueue.length > 0) {
      this.flush();
      if (this.inFlight.length === 0) break;
      await Promise.race(this.inFlight.map((s) => s.done));
    }
    await this.connection.close(
      async () => Promise.allSettled(this.inFlight.map((s) => s.done)),
      () => {
        this.dropAll(
          lockSessionUnavailable("the Locks instance was released"),
          lockLost(new Error("The Locks instance was released")),
        );
      },
    );
  }
}
