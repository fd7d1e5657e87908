/**
 * The lock session's book: the keys this process holds (`holds`) and is acquiring (`pending`), and how the
 * answer of a lock statement settles them: keys granted or refused, unlocks done, a statement that failed,
 * and the recovery after PostgreSQL refused one for want of lock memory. session.ts queues the requests and
 * sends the statements; its header states the invariants both keep.
 */
import type pg from "pg";
import { decodeBatch, unlockKeys, unlockLines, type Batch, type BatchRow } from "./batch.js";
import type { LockConnection } from "./connection.js";
import { isOutOfResources, lockSessionUnavailable, lockTableFull } from "../errors.js";
import type { Handoff } from "./handoff.js";
import {
  HoldImpl,
  LOST,
  RELEASED,
  UNVERIFIED,
  type Acquisition,
  type HoldInfo,
  type HoldOwner,
  type LockRequest,
  type RodeStart,
} from "./holds.js";
import { lockFlag } from "../key.js";
import { probeAnswered, probeStage } from "./timing-probe.js";
import { BatchOp, type Sql } from "../sql.js";

/** The answer of `reconcileLocks` (sql.ts). */
interface ReconcileRow {
  pid: number;
  marked: boolean;
  released: number;
  max_locks_per_transaction: number;
  max_connections: number;
  max_prepared_transactions: number;
}

/** What the book needs of the session's options. */
export interface BookOptions {
  sql: Sql;
  onWarning(message: string, error?: unknown): void;
}

export abstract class SessionBook implements HoldOwner {
  /** The connection the statements run on (connection.ts). */
  abstract readonly connection: LockConnection;
  protected abstract readonly handoff: Handoff;
  protected readonly holds = new Map<string, HoldImpl>();
  /** Keys being acquired, with the acquisition (settles when its statement answered). */
  protected readonly pending = new Map<string, Acquisition>();

  constructor(protected readonly options: BookOptions) {}

  abstract release(hold: HoldImpl): void;
  abstract lossSignal(): AbortSignal;

  /** Keys this process holds right now. */
  heldKeys(): Array<{ key: bigint; info: HoldInfo; since: Date }> {
    return [...this.holds].map(([key, h]) => ({
      key: h.stacked ? BigInt(key) : h.key,
      info: h.info,
      since: h.since,
    }));
  }

  /** The holds of this process, each once (a hold of several limits is in `holds` under each key). */
  openHolds(): HoldImpl[] {
    const open: HoldImpl[] = [];
    for (const [key, hold] of this.holds) if (hold.keyText === key) open.push(hold);
    return open;
  }

  /**
   * The job flags (`lockFlag`) of the keys this process holds for jobs that wait their turn (`reschedule`)
   * and has not begun to release: graphile-worker need not fetch more jobs of those keys for now. A key being
   * released, or whose next job was woken early, is left out: its next job may be fetched (and then waits for
   * the key, in this process).
   */
  heldFlags(): string[] {
    const flags: string[] = [];
    for (const [key, hold] of this.holds) {
      if (hold.info.reschedule && !hold.releaseRequested && !this.handoff.isPrewoken(key))
        flags.push(lockFlag(key));
    }
    return flags;
  }

  /** Whether no job of this process holds, acquires or releases `key`. */
  protected isFree(key: string): boolean {
    return !this.holds.has(key) && !this.pending.has(key);
  }

  /**
   * Settles what a lock statement sent at `sentAt` on `client` asked, from its answer `rows`: locks taken or
   * refused, unlocks done, early wakes planned. An answer from a connection gone, or from another backend,
   * grants nothing.
   */
  protected settleAnswer(
    rows: BatchRow[],
    client: pg.Client,
    generation: number,
    batch: Batch,
    locks: LockRequest[],
    prewakes: HoldImpl[],
    wakeHere: boolean,
    noticesAtSend: number,
    sentAt: number,
  ): void {
    const { unlocks, singles, multis, stacked, rated } = batch;
    if (generation !== this.connection.generation) {
      // The connection died after answering: whatever this statement took died with it.
      const unavailable = lockSessionUnavailable("the connection was lost");
      return this.fail(locks, unlocks, unavailable, false);
    }
    probeAnswered(sentAt, locks, unlocks);
    const answer = decodeBatch(rows);
    if (
      !this.connection.checkBackend(client, answer.backendPid, "a lock statement", answer.marked)
    ) {
      // It ran on another backend, or found its own reset: it took nothing (onOwnBackend), and none of it
      // is granted.
      return this.fail(locks, unlocks, this.connection.refusal!, true);
    }
    for (const [i, key] of answer.slots) this.settleLock(multis[i - 1]!, key, generation, false);
    for (const [i, jobId] of answer.prewoken)
      if (jobId.startsWith("f")) this.handoff.prewokeFetched(prewakes[i - 1]!, jobId.slice(1));
      else this.handoff.prewoke(prewakes[i - 1]!, jobId, wakeHere);
    for (const [i, taken] of answer.stacked) this.settleStacked(stacked[i - 1]!, taken, generation);
    const { holdAt } = unlockKeys(unlocks);
    if (holdAt && answer.failedUnlocks.size > 0) {
      // (a hold of several limits counts as unlocked only when every one of its keys was)
      const failed = new Set([...answer.failedUnlocks].map((i) => holdAt[i - 1]! + 1));
      answer.failedUnlocks = failed;
    }
    unlocks.forEach((hold, index) => this.settleUnlock(hold, !answer.failedUnlocks.has(index + 1)));
    singles.forEach((r, index) => {
      const op = answer.singles.get(index + 1);
      if (op === undefined || op === BatchOp.LOCKED_WITH_LINE) {
        if (r.waits) this.handoff.counts.afterRelease++;
        this.settleLock(r, r.slots[0]!, generation, op === BatchOp.LOCKED_WITH_LINE);
      } else if (op === BatchOp.WAIT_FOR_RELEASE && (r.waits ?? 0) < 2)
        this.handoff.awaitRelease(r, noticesAtSend);
      else this.settleLock(r, null, generation, false);
    });
    rated.forEach((r, index) => this.settleRated(r, answer.rated.get(index + 1), generation));
  }

  /**
   * Settles a request asked with its rate from lock_rated's answer (see BatchOp.RATED; every such request
   * has a row when the statement ran on its own backend).
   */
  private settleRated(request: LockRequest, rode: string | null | undefined, generation: number) {
    if (rode === "-") {
      this.answered(request);
      request.resolve({ acquired: false, local: false, rateFirst: true });
      return;
    }
    if (rode == null) {
      this.settleLock(request, null, generation, false);
      return;
    }
    const line = rode.startsWith("L");
    const start = line ? rode.slice(1) : rode;
    const counted =
      start === "~" ? undefined : { at: new Date(Number(BigInt(start) / 1000n)), atUs: start };
    this.settleLock(request, request.slots[0]!, generation, line, counted);
  }

  /**
   * A lock statement failed: its requests fail and the connection is dropped (its state is uncertain), unless
   * PostgreSQL refused it for want of resources (`recover`).
   */
  protected settleFailure(
    client: pg.Client,
    generation: number,
    locks: LockRequest[],
    unlocks: HoldImpl[],
    error: Error,
  ): Promise<void> | void {
    if (generation === this.connection.generation && isOutOfResources(error))
      return this.recover(client, generation, locks, unlocks, error);
    const unavailable = lockSessionUnavailable("a lock statement failed", error);
    this.fail(locks, unlocks, unavailable, true);
    if (generation === this.connection.generation) {
      this.options.onWarning("A lock statement failed; dropping the lock session", error);
      this.connection.lost(client, error);
    }
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
    const keys = [...locks.flatMap((r) => r.slots), ...unlockKeys(unlocks).keys];
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
      this.answered(request);
      request.reject(full);
    }
    for (const hold of unlocks) this.settleUnlock(hold, true);
    // The wakes of the failed statement rolled back with it.
    await this.wakeReleasedLines(client, unlocks);
  }

  /**
   * Wakes the lines of the keys `unlocks` released in a statement whose wakes rolled back (should this fail,
   * their parked jobs run by their safety net).
   */
  private async wakeReleasedLines(client: pg.Client, unlocks: HoldImpl[]): Promise<void> {
    const waking = unlockLines(unlocks);
    if (waking.keys.length === 0) return;
    try {
      await client.query(this.options.sql.releaseWaiters, [
        waking.keys.map((key) => key?.toString() ?? null),
        waking.jobIds,
      ]);
    } catch (wakeError) {
      this.options.onWarning(
        "Could not wake the lines of keys released after a failed lock statement (their parked jobs run by their safety net)",
        wakeError,
      );
    }
  }

  /**
   * The wakes of a lock statement sent in a second statement of its transaction (two-part.ts) answered: the
   * jobs its early wakes woke.
   */
  protected settleWakes(
    rows: BatchRow[],
    generation: number,
    prewakes: HoldImpl[],
    wakeHere: boolean,
  ): void {
    if (generation !== this.connection.generation) return;
    for (const [i, jobId] of decodeBatch(rows).prewoken)
      if (jobId.startsWith("f")) this.handoff.prewokeFetched(prewakes[i - 1]!, jobId.slice(1));
      else this.handoff.prewoke(prewakes[i - 1]!, jobId, wakeHere);
  }

  /**
   * The wakes sent after a lock statement, in its transaction, failed (`error`), after the lock statement was
   * answered and settled. They take and release no session lock, so the session's state is known and the
   * connection stays: their transaction rolled back, so no job was woken early, and the lines of the keys
   * released are woken again in a statement of their own.
   */
  protected async wakesFailed(
    client: pg.Client,
    generation: number,
    unlocks: HoldImpl[],
    error: Error,
  ): Promise<void> {
    if (generation !== this.connection.generation) return;
    this.options.onWarning("The wakes of a lock statement failed; waking its lines again", error);
    await this.wakeReleasedLines(client, unlocks);
  }

  /**
   * Fails a statement's lock requests with `error` and settles its unlocks as lost. `forget`: their keys stop
   * counting as pending (not after the connection changed, when a new request may own them).
   */
  protected fail(locks: LockRequest[], unlocks: HoldImpl[], error: Error, forget: boolean): void {
    for (const request of locks) {
      if (forget) for (const k of request.slots) this.pending.delete(k);
      request.reject(error);
    }
    for (const hold of unlocks) hold.settle(LOST);
  }

  /** `request`'s keys are no longer being acquired: its statement answered (or failed). */
  private answered(request: LockRequest): void {
    for (const k of request.slots) {
      this.pending.delete(k);
      this.handoff.answered(k);
    }
  }

  /** Settles a lock request with the key it took (`line`: others wait in line for it), or none. */
  private settleLock(
    request: LockRequest,
    key: string | null,
    generation: number,
    line: boolean,
    counted?: RodeStart,
  ): void {
    this.answered(request);
    if (key === null) {
      request.resolve({ acquired: false, local: false });
      return;
    }
    probeStage("granted", request.info.jobId);
    const hold = this.grant(request, key, generation, line);
    request.resolve(counted ? { acquired: true, hold, counted } : { acquired: true, hold });
  }

  /**
   * Settles a request of several limits from its answer: the slots it took (`k,k,...`, one per limit), or
   * '!' and the limit that was full (it took none).
   */
  private settleStacked(request: LockRequest, taken: string, generation: number): void {
    this.answered(request);
    if (taken.startsWith("!")) {
      request.resolve({ acquired: false, local: false, full: Number(taken.slice(1)) - 1 });
      return;
    }
    const keys = taken.split(",");
    const hold = new HoldImpl(this, BigInt(keys[0]!), keys[0]!, generation, request.info, keys);
    for (const key of keys) this.holds.set(key, hold);
    this.connection.registryDirty = true;
    request.resolve({ acquired: true, hold });
  }

  /** Makes the hold of `key` for `request` (whose key it is now) and plans its early wake if it has a line. */
  protected grant(request: LockRequest, key: string, generation: number, line: boolean): HoldImpl {
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
    for (const key of hold.keyTexts) {
      if (this.holds.get(key) === hold) {
        this.holds.delete(key);
        this.handoff.released(key);
      }
    }
    this.connection.registryDirty = true;
    probeStage("unlockAnswered", hold.info.jobId);
    if (!ok) {
      this.options.onWarning(
        `pg_advisory_unlock(${hold.keyText}) returned false: the lock session did not hold the key it was releasing`,
      );
    }
    hold.settle(ok ? RELEASED : UNVERIFIED);
  }
}
