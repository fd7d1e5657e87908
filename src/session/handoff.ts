/**
 * The reschedule hand-off: how the key of a `reschedule` job passes to the next job in its line with as few
 * round trips as possible. The lock session (session.ts) calls it on a local conflict, on a release, on a
 * release notification, and around each lock statement; it owns no connection.
 *
 * - Early wake: a hold whose key has a line wakes the first waiter shortly before it expects to finish
 *   (`planPrewake`; the wake rides the next lock statement). `prewoken` remembers which job was woken for
 *   which key held here. When idle workers of this process's attached runners can fetch the woken jobs,
 *   they are nudged instead of every worker being notified (`IdleWorkers`).
 * - In-process hand-over: the job woken early, fetched here while its key is still held here, waits in
 *   `handovers`; the hold's release passes it the key without an unlock (`handOver`), and the job gets it
 *   once the connection has answered a lock statement sent after the pass (`confirmHandOver`): the next one,
 *   with any request or unlock of the same turn; the new hold's early wake follows in the statement after.
 * - Kept for a job fetched here: a hold released before the job it woke early arrived, while an idle worker
 *   of this process nudged to fetch that job is fetching, keeps its key for it (`keepFor`) rather than
 *   unlocking: until that fetch, and every other fetch of this process in flight when it came back, have
 *   brought other jobs or none (see bench/README.md, "Keeping a key while this process's fetches are
 *   out"), and for at most the woken job's `releaseWaitMs`
 *   (the time the job itself waits for the key: twice the task's usual hold, 100 ms to a second). The job,
 *   first in its key's line, takes the key in memory when it arrives (`onArrival`); otherwise the key is
 *   unlocked as usual. So a hot key stays in the process that runs its line, and no job waits behind it but
 *   those younger in line.
 * - Across sessions: a job woken early that finds its key held by another session waits in
 *   `awaitingRelease` for the release's notification (`onReleaseNotice`) or its time limit, then tries
 *   again, its key still pending meanwhile.
 * - Successor lines: `reschedule` jobs of this process that meet the same release go on in job id order, the
 *   job woken early first (`joinLine`).
 * - Line waiters: a job fetched in a batch that waits for its key at its worker, in the key's line
 *   (`lineWaiter`), hears of the release notifications that name it, and of a hold here that woke it early
 *   (`prewokeFetched`), which then passes it the key in memory as to any job woken early.
 */
import type { IdleWorkers } from "./idle.js";
import {
  LOST,
  type AcquireResult,
  type HoldImpl,
  type HoldInfo,
  type LockRequest,
} from "./holds.js";
import { probeStage } from "./timing-probe.js";

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
  /** Keys kept at their release for the job woken early that an idle worker of this process was fetching. */
  keptForArrival: number;
  /**
   * Requests of jobs with several limits that found a limit full, with a slot held here, and waited for a
   * release of this process rather than park.
   */
  waitedHere: number;
  /** Requests of jobs with several limits sent in the statement of the unlock that freed a slot they took. */
  rodeWithUnlock: number;
  /**
   * Keys taken by a job fetched in a batch of a local queue that waited for its key at its worker, in the
   * key's line, rather than park (`LineWaiter`).
   */
  waitedInLine: number;
}

/** What the hand-off needs of the lock session. */
export interface HandoffHost {
  /** This process's hold of `key`, if any. */
  holdOf(key: string): HoldImpl | undefined;
  /** Whether a lock request of this process for `key` is on its way. */
  isPending(key: string): boolean;
  /** Queues the unlock of `hold`, whose release this module held back (see keepFor). */
  unlock(hold: HoldImpl): void;
  /** Sends `request` with the next lock statement again. */
  retryLock(request: LockRequest): void;
  /** Makes sure a lock statement goes out soon. */
  scheduleFlush(): void;
  /**
   * Gives `from`'s key to `request` in memory (`from` has ended); returns the new hold, which keeps `from`
   * (`passedFrom`) until `passConfirmed`.
   */
  passKey(from: HoldImpl, request: LockRequest): HoldImpl;
  /** The pass that made `hold` was confirmed by the connection (`alive`), or not: `from` is answered. */
  passConfirmed(hold: HoldImpl, alive: boolean): void;
  /**
   * Resolves whether the connection answered the next lock statement, sent after this call (sent soon even
   * with nothing else to carry), from its own backend.
   */
  confirmWithNext(): Promise<boolean>;
  /** The error of a request that cannot be answered because the connection is gone. */
  unavailable(): Error;
}

/** A request that waits for its key (a job woken early waits for its holder to finish). */
interface Waiting {
  request: LockRequest;
  timer: NodeJS.Timeout;
}

/** A `reschedule` request's place among this process's jobs that wait for the same release. */
export interface SuccessorTurn {
  /** Whether this request goes first, once the release answered; leaves the line. */
  first(): boolean;
}

/** How long a job woken early waits for its key. */
function releaseWaitMs(info: HoldInfo): number {
  return info.reschedule ? info.releaseWaitMs : 100;
}

export class Handoff {
  readonly counts: HandoffCounts = {
    prewakes: 0,
    handedOver: 0,
    afterRelease: 0,
    wokenHere: 0,
    keptForArrival: 0,
    waitedHere: 0,
    rodeWithUnlock: 0,
    waitedInLine: 0,
  };
  /** `reschedule` jobs of this process waiting for a hold's release, by hold (see joinLine). */
  private readonly successorLines = new Map<HoldImpl, Set<bigint>>();
  /** Keys whose first waiter a hold of this process woke early, with the woken job's id. */
  private readonly prewoken = new Map<string, string>();
  /** Of those, the keys whose woken job an idle worker of this process was nudged to fetch. */
  private readonly fetchedHere = new Set<string>();
  /** Released holds keeping their key for the job woken early that is on its way here (see keepFor). */
  private readonly kept = new Map<string, { hold: HoldImpl; timer: NodeJS.Timeout }>();
  /** Holds whose key's first waiter to wake early, in the next statement. */
  private prewakeQueue: HoldImpl[] = [];
  /** Jobs woken early that wait for a hold of this process to pass them its key (see handOver). */
  private readonly handovers = new Map<string, Waiting>();
  /** Jobs woken early that wait for another session's release of their key (see awaitRelease). */
  private readonly awaitingRelease = new Map<string, Waiting>();
  /** For keys being acquired: the number of the last release notification seen for each. */
  private readonly releaseNotices = new Map<string, number>();
  /** How many release notifications this session has seen. */
  notices = 0;
  /**
   * Fetched jobs of this process that wait at their worker in their key's line (join_line), by key: each
   * is told when a release notification for its key comes or a hold here names it the next (`poke`).
   */
  private readonly lineWaiters = new Map<string, Set<LineWaiter>>();

  constructor(
    private readonly host: HandoffHost,
    private readonly idleWorkers: IdleWorkers | undefined,
  ) {}

  /** Whether the next job in line for `key`, held here, was woken early. */
  isPrewoken(key: string): boolean {
    return this.prewoken.has(key);
  }

  /** Whether early wakes wait for the next statement. */
  hasPrewakes(): boolean {
    return this.prewakeQueue.length > 0;
  }

  /**
   * A `reschedule` job whose key a hold of this process has not begun to release: if that hold woke it
   * early, it waits for the hold to pass it the key (or, when it came before the early wake's answer, for
   * that answer, then tries again: "retry"). Null for any other job, which has met a local conflict.
   */
  onLocalConflict(
    key: string,
    slots: readonly bigint[],
    info: HoldInfo,
  ): Promise<AcquireResult | "retry"> | null {
    if (!info.reschedule || info.jobId === null) return null;
    const waking = this.host.holdOf(key)?.prewaking;
    if (waking) return waking.then(() => "retry" as const);
    if (this.prewoken.get(key) !== info.jobId || this.handovers.has(key)) return null;
    probeStage("waiting", info.jobId);
    return new Promise<AcquireResult>((resolve, reject) => {
      const request: LockRequest = { slots: [key], keys: slots as bigint[], info, resolve, reject };
      this.waitIn(this.handovers, request, () => resolve({ acquired: false, local: true }));
    });
  }

  /**
   * A `reschedule` request that meets `hold`'s release joins the line of this process's jobs waiting for
   * it; null for any other request (it just tries once the release answered).
   */
  joinLine(hold: HoldImpl, key: string, info: HoldInfo): SuccessorTurn | null {
    if (!info.reschedule || info.jobId === null) return null;
    let line = this.successorLines.get(hold);
    if (!line) this.successorLines.set(hold, (line = new Set()));
    const me = BigInt(info.jobId);
    line.add(me);
    // The job woken early for this key goes first (its place in line is older than any fresh job's id).
    const early = this.prewoken.get(key);
    return {
      first: () => {
        const first =
          early !== undefined && line.has(BigInt(early))
            ? BigInt(early)
            : [...line].reduce((a, b) => (b < a ? b : a));
        line.delete(me);
        if (line.size === 0) this.successorLines.delete(hold);
        return first === me;
      },
    };
  }

  /**
   * At `hold`'s release: when the job it woke early waits in this process, the key passes to that job
   * without an unlock (PostgreSQL sees the key held throughout). Returns whether it did.
   */
  handOver(hold: HoldImpl): boolean {
    const key = hold.keyText;
    const next = this.handovers.get(key);
    if (!next) return false;
    this.forget(key);
    clearTimeout(next.timer);
    this.handovers.delete(key);
    this.counts.handedOver++;
    probeStage("handedOver", next.request.info.jobId);
    this.confirmHandOver(this.host.passKey(hold, next.request), next.request);
    return true;
  }

  /**
   * Gives the job that was passed a key in memory its hold once the connection answers a lock statement
   * sent after the pass, from its own backend. A key passed in memory is only as good as the connection: a
   * backend that ended while this process has not heard of it (a silent network, an error not yet read) has
   * already freed the key for other sessions, and a job handed it then would run beside theirs. Waiting for
   * an answer gives a hand-over the guarantee of a lock statement: the key was held when PostgreSQL
   * answered. The check rides on the next lock statement, sent at once; an early wake of the new hold queued
   * with it follows in the statement after (session.ts, `flush`), so that the job does not wait for the
   * wake's work on the server. A statement already on its way at the pass does not count: its answer may
   * have been written before the backend ended. A job whose check fails
   * gets the connection's error (its hold is lost with the connection).
   */
  private confirmHandOver(hold: HoldImpl, request: LockRequest): void {
    void this.host.confirmWithNext().then((alive) => {
      const confirmed = alive && !hold.lost;
      this.host.passConfirmed(hold, confirmed);
      if (confirmed) {
        probeStage("granted", request.info.jobId);
        request.resolve({ acquired: true, hold });
      } else request.reject(this.host.unavailable());
    });
  }

  /**
   * At `hold`'s release, when the job it woke early is not here yet but an idle worker of this process was
   * nudged to fetch it: the key stays held for that job, for at most its `releaseWaitMs`, then is unlocked.
   * Returns whether it is kept.
   */
  keepFor(hold: HoldImpl): boolean {
    const key = hold.keyText;
    if (!this.fetchedHere.has(key) || !hold.info.reschedule || this.kept.has(key)) return false;
    const timer = setTimeout(() => {
      if (this.kept.get(key)?.timer !== timer) return;
      this.kept.delete(key);
      this.host.unlock(hold);
    }, hold.info.releaseWaitMs);
    this.kept.set(key, { hold, timer });
    this.counts.keptForArrival++;
    return true;
  }

  /**
   * A job that finds `key` held by a released hold: if the hold keeps the key for it (keepFor), it takes the
   * key in memory, as a hand-over. Null for any other job.
   */
  onArrival(key: string, slots: readonly bigint[], info: HoldInfo): Promise<AcquireResult> | null {
    const kept = this.kept.get(key);
    if (!kept || info.jobId === null || this.prewoken.get(key) !== info.jobId) return null;
    clearTimeout(kept.timer);
    this.kept.delete(key);
    this.forget(key);
    this.counts.handedOver++;
    probeStage("handedOver", info.jobId);
    return new Promise<AcquireResult>((resolve, reject) => {
      const request: LockRequest = { slots: [key], keys: slots as bigint[], info, resolve, reject };
      this.confirmHandOver(this.host.passKey(kept.hold, request), request);
    });
  }

  /** Unlocks every key kept for a job on its way (the session closes). */
  unlockKept(): void {
    for (const { hold, timer } of this.kept.values()) {
      clearTimeout(timer);
      this.host.unlock(hold);
    }
    this.kept.clear();
  }

  /** `key`'s hold here has ended (unlocked). */
  released(key: string): void {
    this.forget(key);
  }

  /** A lock request for `key` has been answered. */
  answered(key: string): void {
    if (this.releaseNotices.size > 0) this.releaseNotices.delete(key);
  }

  /** Starts the timer of `hold`'s early wake of the next job in line, if its task has one. */
  planPrewake(hold: HoldImpl): void {
    const after = hold.info.reschedule ? hold.info.prewakeAfterMs : null;
    if (after === null) return;
    if (after <= 0) {
      this.prewakeQueue.push(hold);
      this.host.scheduleFlush();
      return;
    }
    hold.prewakeTimer = setTimeout(() => {
      hold.prewakeTimer = undefined;
      if (this.host.holdOf(hold.keyText) !== hold || hold.releaseRequested) return;
      this.prewakeQueue.push(hold);
      this.host.scheduleFlush();
    }, after);
  }

  /**
   * The early wakes for the next statement, and whether idle workers of this process will fetch the woken
   * jobs (nudged when the wakes are answered) rather than every worker hearing of them.
   */
  takePrewakes(): { prewakes: HoldImpl[]; wakeHere: boolean } {
    // A hold that ended since its early wake was queued has woken its line at its release already.
    const prewakes = this.prewakeQueue
      .splice(0)
      .filter((hold) => this.host.holdOf(hold.keyText) === hold && !hold.releaseRequested);
    const idle = this.idleWorkers;
    const wakeHere = prewakes.length > 0 && idle !== undefined && idle.count >= prewakes.length;
    return { prewakes, wakeHere };
  }

  /** `hold`'s early wake woke job `jobId`. */
  prewoke(hold: HoldImpl, jobId: string, wakeHere: boolean): void {
    // (a hold released meanwhile has told the woken job at its release, in the database)
    if (this.host.holdOf(hold.keyText) === hold && !hold.releaseRequested)
      this.rememberPrewoken(hold.keyText, jobId);
    this.counts.prewakes++;
    // (should no worker be idle any more, the release announces the job if it is still unfetched)
    const key = hold.keyText;
    const notComing = () => {
      if (this.prewoken.get(key) !== jobId) return;
      this.fetchedHere.delete(key);
      this.idleWorkers?.unwatch(jobId);
      const kept = this.kept.get(key);
      if (!kept) return;
      clearTimeout(kept.timer);
      this.kept.delete(key);
      this.host.unlock(kept.hold);
    };
    const fetched = (got: string | null) => {
      const idle = this.idleWorkers!;
      if (got === jobId || idle.started(jobId) || this.prewoken.get(key) !== jobId) return;
      // That worker fetched another job, or none. Another fetch of this process in flight may have taken the
      // woken job from under it: the key stays kept until those fetches are back (within the keep's time
      // limit), and is given up if no worker here started the job.
      idle.afterFetchesInFlight(() => {
        if (!idle.started(jobId)) notComing();
      });
    };
    if (wakeHere && this.idleWorkers?.nudge(fetched)) {
      this.counts.wokenHere++;
      if (this.prewoken.get(key) === jobId) {
        this.fetchedHere.add(key);
        this.idleWorkers.watch(jobId);
      }
    }
  }

  /**
   * A job woken early found its key still held by another session: it waits for the release's notification
   * (or, at most, its `releaseWaitMs`) and tries again, its key still pending meanwhile. A notification that
   * came while its statement was on its way (after `noticesAtSend`) means the key is already free: it tries
   * again at once.
   */
  awaitRelease(request: LockRequest, noticesAtSend: number): void {
    request.waits = (request.waits ?? 0) + 1;
    if ((this.releaseNotices.get(request.slots[0]!) ?? 0) > noticesAtSend)
      this.host.retryLock(request);
    else this.waitIn(this.awaitingRelease, request, () => this.host.retryLock(request));
  }

  /** Registers a fetched job of `key` waiting at its worker in the key's line; `close` ends it. */
  lineWaiter(key: string, jobId: string): LineWaiter {
    const waiter = new LineWaiter(key, jobId, () => {
      const set = this.lineWaiters.get(key);
      set?.delete(waiter);
      if (set?.size === 0) this.lineWaiters.delete(key);
    });
    let set = this.lineWaiters.get(key);
    if (!set) this.lineWaiters.set(key, (set = new Set()));
    set.add(waiter);
    return waiter;
  }

  /**
   * A hold here woke, early, a first waiter that is already fetched (it waits at its worker in line): if it
   * is a job of this process, it takes the key in memory at the release, as a job woken early does.
   */
  prewokeFetched(hold: HoldImpl, jobId: string): void {
    this.counts.prewakes++;
    const key = hold.keyText;
    if (this.host.holdOf(key) !== hold || hold.releaseRequested) return;
    const waiter = [...(this.lineWaiters.get(key) ?? [])].find((w) => w.jobId === jobId);
    if (!waiter) return;
    this.rememberPrewoken(key, jobId);
    waiter.poke();
  }

  /** Job `jobId` is the one woken early for `key`, held here (in place of any woken before it). */
  private rememberPrewoken(key: string, jobId: string): void {
    const before = this.prewoken.get(key);
    if (before !== undefined && before !== jobId) this.idleWorkers?.unwatch(before);
    this.prewoken.set(key, jobId);
  }

  /** A release notification: a key that a job woken early may be waiting for is free. */
  onReleaseNotice(payload: string): void {
    const slash = payload.indexOf("/");
    const key = slash < 0 ? payload : payload.slice(0, slash);
    if (slash >= 0) {
      const jobId = payload.slice(slash + 1);
      for (const waiter of this.lineWaiters.get(key) ?? [])
        if (jobId === "?") waiter.poke(true);
        else if (waiter.jobId === jobId) waiter.poke();
    }
    if (!this.host.isPending(key)) return;
    this.releaseNotices.set(key, ++this.notices);
    const waiting = this.awaitingRelease.get(key);
    if (!waiting) return;
    probeStage("noticed", waiting.request.info.jobId);
    clearTimeout(waiting.timer);
    this.awaitingRelease.delete(key);
    this.host.retryLock(waiting.request);
  }

  /** The connection is gone: jobs waiting for a key fail as if they had asked now, and early wakes are moot. */
  dropAll(error: Error): void {
    for (const waiting of [...this.handovers.values(), ...this.awaitingRelease.values()]) {
      clearTimeout(waiting.timer);
      waiting.request.reject(error);
    }
    for (const { hold, timer } of this.kept.values()) {
      clearTimeout(timer);
      hold.settle(LOST);
    }
    this.kept.clear();
    for (const jobId of this.prewoken.values()) this.idleWorkers?.unwatch(jobId);
    this.fetchedHere.clear();
    this.handovers.clear();
    this.awaitingRelease.clear();
    this.releaseNotices.clear();
    this.prewoken.clear();
    this.prewakeQueue = [];
    // (jobs waiting in line at their workers try again, and meet the connection's state)
    for (const waiters of this.lineWaiters.values()) for (const waiter of waiters) waiter.poke();
  }

  /** Forgets the job woken early for `key`. */
  private forget(key: string): void {
    const jobId = this.prewoken.get(key);
    if (jobId === undefined) return;
    this.prewoken.delete(key);
    this.fetchedHere.delete(key);
    this.idleWorkers?.unwatch(jobId);
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
}

/** A fetched job waiting at its worker in its key's line (see Handoff.lineWaiter). */
export class LineWaiter {
  private poked = false;
  /** Whether a job ahead in line parked since the last look: the waiter looks at its line again. */
  private recheck = false;
  private wake: (() => void) | null = null;

  constructor(
    readonly key: string,
    readonly jobId: string,
    private readonly onClose: () => void,
  ) {}

  /** Something happened that may let the job take its key (`recheck`: a job ahead parked): it looks again. */
  poke(recheck = false): void {
    this.poked = true;
    if (recheck) this.recheck = true;
    this.wake?.();
  }

  /** Whether a job ahead parked since the last call. */
  takeRecheck(): boolean {
    const recheck = this.recheck;
    this.recheck = false;
    return recheck;
  }

  /** Resolves true once poked (at once if it was since the last call), false after `ms`. */
  next(ms: number): Promise<boolean> {
    if (this.poked) {
      this.poked = false;
      return Promise.resolve(true);
    }
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.wake = null;
        resolve(false);
      }, ms);
      this.wake = () => {
        clearTimeout(timer);
        this.wake = null;
        this.poked = false;
        resolve(true);
      };
    });
  }

  close(): void {
    this.wake = null;
    this.onClose();
  }
}
