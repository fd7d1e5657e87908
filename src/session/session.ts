/**
 * The lock session: which advisory keys this process holds, takes and releases, on the one PostgreSQL
 * connection of a `Locks` instance (connection.ts). That connection is separate from graphile-worker's pool
 * (holding a pool client per running job deadlocks the pool) and shared by every job of every runner in the
 * process. This module owns the holds, the keys being acquired, the lock and unlock queues and the lock
 * statement (batch.ts); the connection's state machine, heartbeat, registry and reconnection are
 * connection.ts's.
 *
 * Invariants:
 * - Session advisory locks are re-entrant, so PostgreSQL cannot tell two jobs of this process apart. This
 *   module does: a key is held by at most one `Hold` (`holds`), and a key that is being acquired or
 *   released (`pending`) counts as held. A second job asking for such a key gets a conflict without a
 *   round trip, never a re-entrant "success". A semaphore request (`limit` > 1) counts every slot it tries
 *   as pending but takes at most one: a request that finds its slots pending for another job of this
 *   process waits for that answer and tries the slots still free, so this process's own acquisitions never
 *   turn a job away while a slot is free.
 * - Requests are coalesced: the requests of one turn of the event loop share a statement (batch.ts). Up to
 *   PIPELINE_DEPTH statements are in flight at once; beyond that, requests queue up and the next statement
 *   carries all of them. PostgreSQL runs them in the order sent, and each request's state (`pending`,
 *   `holds`) settles from its own statement's answer, so no request depends on a statement still in flight.
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
 */
import type pg from "pg";
import { batchQuery, decodeBatch, makeBatch, type BatchRow } from "./batch.js";
import { LockConnection, type LockConnectionOptions } from "./connection.js";
import {
  isOutOfResources,
  lockLost,
  lockSessionUnavailable,
  lockTableFull,
  type LocksError,
} from "../errors.js";
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
import { lockFlag } from "../key.js";
import { probeAnswered, probeQueued } from "./timing-probe.js";
import { BatchOp, type Sql } from "../sql.js";

export type { SessionState } from "./connection.js";

/** The answer of `reconcileLocks` (sql.ts). */
interface ReconcileRow {
  pid: number;
  marked: boolean;
  released: number;
  max_locks_per_transaction: number;
  max_connections: number;
  max_prepared_transactions: number;
}

export { setSessionProbe, type SessionProbe } from "./timing-probe.js";

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
 * that, requests queue up for the next statement. Measured with the latency section at concurrency 10
 * (tasks waiting 5-100 ms): four in flight rather than two take 0.1-0.2 ms off the time a job waits for its
 * lock (p50), most of it the wait for a place in the pipeline, whose p99 falls from 2-4 ms to under 1 ms,
 * and still send at most about one statement per job; eight made each statement wait behind the others on
 * the server, and added time overall.
 */
const PIPELINE_DEPTH = 4;

/**
 * While lock-ahead is in use (a lock-ahead request in the last LOCK_AHEAD_RECENT_MS), an unlock nobody waits
 * for may wait up to QUIET_UNLOCK_HOLD_MS on an idle connection for a lock statement to ride. Lock-ahead
 * statements carry a fetched batch's locks, ahead of its jobs, so no job waits on what rides them; sent alone,
 * the unlock is a socket write in the finishing job's path and a wake of the server for one key. Measured
 * with the latency section's local-queue rows (concurrency 24, tasks waiting 5 and 20 ms, 1 and 3
 * processes), against leaving at once: half the lock statements per job (0.05-0.10 instead of 0.10-0.25),
 * 0.1-0.4 ms less from a job's start to its success (p50), and throughput higher by up to 0.08 of plain
 * graphile-worker's, in 7 of 8 rows. Without lock-ahead every lock statement is some job's wait, and an
 * unlock riding it measured slower (see `onlyQuietUnlocks`), so there it leaves at once.
 */
const QUIET_UNLOCK_HOLD_MS = 2;
const LOCK_AHEAD_RECENT_MS = 1000;

/**
 * The slots of semaphore request `request` that its statement found held by other sessions: all it tried
 * when it took none, else those before the one it took (they are tried in order).
 */
function slotsHeldElsewhere(request: LockRequest, answer: AcquireResult): readonly string[] {
  if (!answer.acquired) return answer.local ? [] : request.slots;
  const taken = request.slots.indexOf(answer.hold.key.toString());
  return taken < 0 ? [] : request.slots.slice(0, taken);
}

export class LockSession implements HoldOwner {
  /**
   * The connection: its state, backend pid, generation, `whenReady` and `warmUp` (connection.ts). Others
   * read it; only the session sends lock statements on it.
   */
  readonly connection: LockConnection;
  private readonly holds = new Map<string, HoldImpl>();
  /** Keys being acquired, with the acquisition (settles when its statement answered). */
  private readonly pending = new Map<string, Acquisition>();
  private lockQueue: LockRequest[] = [];
  private unlockQueue: HoldImpl[] = [];
  /** The lock statements in flight, oldest first, each with when it was sent (`performance.now()`). */
  private readonly inFlight: Array<{ sentAt: number; done: Promise<void> }> = [];
  /** PIPELINE_DEPTH on a pipelining connection; 1 with a node-postgres that has no pipeline mode. */
  private maxInFlight = 1;
  private flushScheduled = false;
  /** When the oldest unlock of `unlockQueue` was queued (`performance.now()`). */
  private unlocksSince = 0;
  /** When lock-ahead last asked for a lock (`acquireInto`). */
  private lockAheadAt = -Infinity;
  /** The end of a hold of quiet unlocks (QUIET_UNLOCK_HOLD_MS), while one runs. */
  private quietHold: NodeJS.Timeout | null = null;
  /** Set by close(): queued unlocks leave at once, and nothing else is sent (see flush). */
  private closing = false;
  /** Acquisitions in this process waiting for a key this process is releasing. */
  private successorsWaiting = 0;
  private readonly handoff: Handoff;

  constructor(private readonly options: LockSessionOptions) {
    this.connection = new LockConnection(options, {
      holds: () => [...this.holds.values()],
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
    });
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
          // The next job was woken from a line, so it is taken to have one behind it; its hold counts from now.
          return this.grant(request, from.keyText, from.generation, true);
        },
        confirm: () => this.connection.confirm("a hand-over's check"),
        unavailable: () =>
          this.connection.refusal ?? lockSessionUnavailable("the connection was lost"),
      },
      options.idleWorkers,
    );
  }

  /** What the session has done about hand-offs, for `locks.status()`. */
  get handoffs(): HandoffCounts {
    return this.handoff.counts;
  }

  /** A signal that aborts when the current connection is lost; every hold of this connection shares it. */
  lossSignal(): AbortSignal {
    return this.connection.lossSignal();
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
    this.lockAheadAt = performance.now();
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
    if (this.connection.state !== "ready" || slots.length !== 1) return null;
    const key = slots[0]!.toString();
    return this.isFree(key) ? this.queueLock([key], slots, info, receiver) : null;
  }

  private async acquireSlowly(slots: readonly bigint[], info: HoldInfo): Promise<AcquireResult> {
    const keys = slots.map(String);
    const semaphore = keys.length > 1;
    /** Slots that a statement this request waited for found held by other sessions (semaphores only). */
    let heldElsewhere: Set<string> | undefined;
    let free: string[];
    for (;;) {
      if (this.connection.state !== "ready") await this.connection.ensureReady();
      free = keys.filter((k) => this.isFree(k) && !heldElsewhere?.has(k));
      if (free.length > 0) break;
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
    probeQueued(acquisition);
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
    if (
      hold.lost ||
      hold.generation !== this.connection.generation ||
      this.connection.state !== "ready"
    ) {
      hold.settle(LOST);
      return;
    }
    if (this.holds.get(hold.keyText) === hold && this.handoff.handOver(hold)) return;
    probeQueued(hold);
    if (this.unlockQueue.length === 0) this.unlocksSince = performance.now();
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
   * lock-ahead is in use (`holdQuietUnlocks`). Measured with the latency section at concurrency 10 without a
   * local queue (tasks waiting 5 and 20 ms), against holding such unlocks up to 2 ms for a lock request to
   * ride with: throughput higher by 0.01-0.03 of plain graphile-worker's in each of four alternated
   * comparisons (A1:5 once, A1:20 three times), for 1.3-1.5 statements per job instead of 0.9-1.0; against
   * sending them after graphile-worker's completion and next fetch (`setImmediate`), higher by 0.02-0.04 in
   * two.
   */
  private onlyQuietUnlocks(): boolean {
    return (
      this.lockQueue.length === 0 &&
      !this.handoff.hasPrewakes() &&
      this.successorsWaiting === 0 &&
      this.unlockQueue.every((hold) => !hold.info.reschedule)
    );
  }

  /**
   * Whether quiet unlocks on an idle connection wait for a lock statement to ride (QUIET_UNLOCK_HOLD_MS):
   * only while lock-ahead is in use, and for at most that long after the oldest was queued; a timer sends
   * them when the time is up.
   */
  private holdQuietUnlocks(): boolean {
    if (this.unlockQueue.length === 0) return false;
    const now = performance.now();
    if (now - this.lockAheadAt > LOCK_AHEAD_RECENT_MS) return false;
    const left = this.unlocksSince + QUIET_UNLOCK_HOLD_MS - now;
    if (left <= 0) return false;
    this.quietHold ??= setTimeout(() => {
      this.quietHold = null;
      this.unlocksSince = -Infinity;
      this.flush();
    }, left);
    return true;
  }

  private flush(): void {
    const { client, generation } = this.connection;
    if (this.inFlight.length >= this.maxInFlight || this.connection.state !== "ready" || !client)
      return;
    if (
      !this.closing &&
      this.onlyQuietUnlocks() &&
      (this.inFlight.length > 0 || this.holdQuietUnlocks())
    )
      return;
    if (this.lockQueue.length === 0 && this.unlockQueue.length === 0 && !this.handoff.hasPrewakes())
      return;
    if (this.closing && this.unlockQueue.length === 0) return;
    this.endQuietHold();
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
    const { unlocks, singles, multis } = batch;
    const locks = [...singles, ...multis];
    let answered: () => void = () => undefined;
    if (prewakes.length > 0) {
      const prewaking = new Promise<void>((resolve) => (answered = resolve));
      for (const hold of prewakes) hold.prewaking = prewaking;
    }

    this.connection.statements++;
    const sentAt = performance.now();
    const done: Promise<void> = client
      .query<BatchRow>(
        batchQuery(
          this.options.sql,
          batch,
          this.connection.backendPid!,
          this.connection.claimToken!,
        ),
      )
      .then(
        ({ rows }) => {
          if (generation !== this.connection.generation) {
            // The connection died after answering: whatever this statement took died with it.
            const unavailable = lockSessionUnavailable("the connection was lost");
            return this.fail(locks, unlocks, unavailable, false);
          }
          probeAnswered(sentAt, locks, unlocks);
          const answer = decodeBatch(rows);
          if (
            !this.connection.checkBackend(
              client,
              answer.backendPid,
              "a lock statement",
              answer.marked,
            )
          ) {
            // It ran on another backend, or found its own reset: it took nothing (onOwnBackend), and none of it
            // is granted.
            return this.fail(locks, unlocks, this.connection.refusal!, true);
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
          if (generation === this.connection.generation && isOutOfResources(error))
            return this.recover(client, generation, locks, unlocks, error);
          const unavailable = lockSessionUnavailable("a lock statement failed", error);
          this.fail(locks, unlocks, unavailable, true);
          if (generation === this.connection.generation) {
            this.options.onWarning("A lock statement failed; dropping the lock session", error);
            this.connection.lost(client, error);
          }
        },
      )
      .finally(() => {
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
   * A lock statement failed for want of resources (`error`, SQLSTATE class 53: PostgreSQL's lock table is
   * full): the connection is sound, but the statement may have taken some of its keys, and released some,
   * before it failed (session locks ignore its rollback). One statement releases those of its keys the backend
   * still holds; then its lock requests fail with GWL_LOCK_TABLE_FULL (their jobs go back to the queue) and its
   * unlocks count as done, their lines woken. Should that statement fail too, the session's state is unknown
   * and the connection goes, as for any other failed statement.
   */
  private async recover(
    client: pg.Client,
    generation: number,
    locks: LockRequest[],
    unlocks: HoldImpl[],
    error: Error,
  ): Promise<void> {
    const keys = [...locks.flatMap((r) => r.slots), ...unlocks.map((hold) => hold.keyText)];
    let row: ReconcileRow | undefined;
    try {
      const { name, text } = this.options.sql.reconcileLocks;
      const values = [keys, this.connection.backendPid, this.connection.claimToken];
      ({
        rows: [row],
      } = await client.query<ReconcileRow>({ name, text, values }));
    } catch (reconcileError) {
      this.fail(locks, unlocks, lockSessionUnavailable("a lock statement failed", error), true);
      if (generation === this.connection.generation) {
        this.options.onWarning(
          "A lock statement failed for want of resources, and so did the release of what it took; dropping the lock session",
          reconcileError,
        );
        this.connection.lost(client, error);
      }
      return;
    }
    if (generation !== this.connection.generation) {
      return this.fail(locks, unlocks, lockSessionUnavailable("the connection was lost"), false);
    }
    if (!this.connection.checkBackend(client, row?.pid, "a lock statement's recovery", row?.marked))
      return this.fail(locks, unlocks, this.connection.refusal!, true);
    const full = lockTableFull(
      error,
      row
        ? {
            maxLocksPerTransaction: row.max_locks_per_transaction,
            maxConnections: row.max_connections,
            maxPreparedTransactions: row.max_prepared_transactions,
          }
        : null,
    );
    this.options.onWarning(
      `A lock statement failed: ${full.message}. The lock session stays connected; ${locks.length} lock request(s) failed, ${unlocks.length} unlock(s) done, ${row?.released ?? 0} key(s) the statement left held released`,
    );
    for (const request of locks) {
      for (const k of request.slots) {
        this.pending.delete(k);
        this.handoff.answered(k);
      }
      request.reject(full);
    }
    for (const hold of unlocks) this.settleUnlock(hold, true);
    // The wakes of the failed statement rolled back with it: the lines of released `reschedule` keys are woken
    // now (should this fail, their jobs' safety net runs them).
    const waking = unlocks.filter((hold) => hold.info.reschedule);
    if (waking.length === 0) return;
    try {
      await client.query(this.options.sql.releaseWaiters, [
        waking.map((hold) => (hold.info.reschedule ? hold.info.wakeKey.toString() : null)),
        waking.map((hold) => hold.info.jobId),
      ]);
    } catch (wakeError) {
      this.options.onWarning(
        "Could not wake the lines of keys released after a failed lock statement (their parked jobs run by their safety net)",
        wakeError,
      );
    }
  }

  private endQuietHold(): void {
    if (this.quietHold === null) return;
    clearTimeout(this.quietHold);
    this.quietHold = null;
  }

  /**
   * Fails a statement's lock requests with `error` and settles its unlocks as lost. `forget`: their keys stop
   * counting as pending (not after the connection changed, when a new request may own them).
   */
  private fail(locks: LockRequest[], unlocks: HoldImpl[], error: Error, forget: boolean): void {
    for (const request of locks) {
      if (forget) for (const k of request.slots) this.pending.delete(k);
      request.reject(error);
    }
    for (const hold of unlocks) hold.settle(LOST);
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
    this.connection.registryDirty = true;
    if (line) this.handoff.planPrewake(hold);
    return hold;
  }

  private settleUnlock(hold: HoldImpl, ok: boolean): void {
    if (this.holds.get(hold.keyText) === hold) {
      this.holds.delete(hold.keyText);
      this.handoff.released(hold.keyText);
    }
    this.connection.registryDirty = true;
    if (!ok) {
      this.options.onWarning(
        `pg_advisory_unlock(${hold.keyText}) returned false: the lock session did not hold the key it was releasing`,
      );
    }
    hold.settle(ok ? RELEASED : UNVERIFIED);
  }

  /**
   * Everything the connection held is gone (it was lost, or closed): lock requests fail with `unavailable`,
   * unlocks settle as lost, and every hold is marked lost with `reason` and its signal aborts. Returns the
   * holds that were open.
   */
  private dropAll(unavailable: LocksError, reason: LocksError): HoldImpl[] {
    const open = [...this.holds.values()];
    this.holds.clear();
    this.pending.clear();
    this.handoff.dropAll(unavailable);
    for (const request of this.lockQueue.splice(0)) request.reject(unavailable);
    for (const hold of this.unlockQueue.splice(0)) hold.settle(LOST);
    this.endQuietHold();
    for (const hold of open) hold.markLost(reason);
    this.connection.abortLossSignal(reason);
    return open;
  }

  /** The connection of this generation failed (connection.ts told): every hold is lost. */
  private onLost(error: Error, refusal: LocksError | null): void {
    const unavailable = refusal ?? lockSessionUnavailable("the connection was lost", error);
    const lost = this.dropAll(unavailable, lockLost(error));
    this.options.onLost(lost, error);
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
