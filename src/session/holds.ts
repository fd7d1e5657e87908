/**
 * The lock session's values: what a hold is for (`HoldInfo`), a key held by this process (`HoldImpl`), and a
 * lock request on its way to PostgreSQL (`Acquisition`). They keep their own state and settle their own
 * promises; the session (session.ts) decides when.
 */
import type { SupersededError } from "../errors.js";

/** What a hold is for, written to the holder registry for operators. */
export type HoldInfo = PlainHoldInfo | RescheduleHoldInfo;

interface HoldInfoBase {
  taskIdentifier: string;
  jobId: string | null;
  /**
   * The keys whose lines (parked jobs) the release wakes, when they are not just `wakeKey`: the slot-0 key
   * of each limit of a job with several limits, or of a job whose key space other tasks share (a group: a
   * `reschedule` job of another task may wait in its line, whatever this job's strategy).
   */
  wakeKeys?: readonly bigint[];
}

/** The hold of a job that gives up on a conflict (`drop`, `raise`). */
export interface PlainHoldInfo extends HoldInfoBase {
  reschedule: false;
}

/** The hold of a `reschedule` job, which waits its turn in its key's line. */
export interface RescheduleHoldInfo extends HoldInfoBase {
  reschedule: true;
  /** The key whose line (parked jobs) to wake on release: the task's lock key (slot 0). */
  wakeKey: bigint;
  /**
   * When, counted from the start of the hold, to wake the first job in line early, so that it is fetched
   * while this one still runs (null: only at the release).
   */
  prewakeAfterMs: number | null;
  /** For a job woken early: how long it waits for its key's release before it parks again. */
  releaseWaitMs: number;
}

/** The keys whose lines the release of a hold for `info` wakes. */
export function linesOf(info: HoldInfo): readonly bigint[] {
  return info.wakeKeys ?? (info.reschedule ? [info.wakeKey] : []);
}

export interface ReleaseResult {
  /** True when PostgreSQL confirmed the unlock. */
  released: boolean;
  /** `ok`; `lost` when the session died first (the lock went with it); `unverified` when the unlock returned false. */
  outcome: "ok" | "lost" | "unverified";
}

export const RELEASED: ReleaseResult = Object.freeze({ released: true, outcome: "ok" });
export const LOST: ReleaseResult = Object.freeze({ released: false, outcome: "lost" });
export const UNVERIFIED: ReleaseResult = Object.freeze({ released: false, outcome: "unverified" });

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
  /** Why a newer job of the key superseded this hold's job (`supersede`), or null. */
  readonly supersededBy: SupersededError | null;
  /** Aborts (with a GWL_SUPERSEDED error) when a newer job of the key supersedes this hold's job. */
  readonly supersedeSignal: AbortSignal;
  /** Releases the key. Idempotent; resolves once PostgreSQL answered (or at once if the hold was lost). */
  release(): Promise<ReleaseResult>;
  /** Releases the key like `release()`, for a caller that does not wait for the answer (no promise made). */
  releaseQuietly(): void;
  /**
   * Set by the release: a job of this process waits to take this hold's key (passed in memory) or one of its
   * slots (in the statement that carries its unlock), and the release's answer is that job's start.
   */
  readonly handsOffHere: boolean;
}

/**
 * The rate of a job with a lock and a rate, asked in its lock statement (lock_rated, sql/000012.sql): its
 * rate key, readable name, limit, period (ms) and burst, and the keys whose pause stops it.
 */
export interface RateRide {
  rateKey: string;
  label: string;
  limit: number;
  periodMs: number;
  burst: number;
  pauseKeys: string[];
}

/** A start a lock statement counted with its key (`RateRide`): its instant, and in µs since the epoch. */
export interface RodeStart {
  at: Date;
  atUs: string;
}

/**
 * An acquisition's outcome. A conflict of a job with several limits says which limit (from 0) was full
 * (`full`). A request with a `RateRide` may come back with its start counted (`counted`), or not taken
 * because its rate must decide first (`rateFirst`: the key has a pause, a reservation or no room; or, for a
 * `reschedule` job, its rate's row was busy or its key held).
 */
export type AcquireResult =
  | { acquired: true; hold: Hold; counted?: RodeStart }
  | { acquired: false; local: boolean; full?: number; rateFirst?: boolean };

/** Who takes an acquisition's outcome without a promise: null when it failed (see `acquireInto`). */
export interface AcquireReceiver {
  settle(result: AcquireResult | null): void;
}

/** What a hold needs of its session. */
export interface HoldOwner {
  release(hold: HoldImpl): void;
  lossSignal(): AbortSignal;
}

export class HoldImpl implements Hold {
  private controller: AbortController | undefined;
  private supersedeController: AbortController | undefined;
  supersededBy: SupersededError | null = null;
  /** The timer of this hold's early wake of the next job in line (see Handoff.planPrewake). */
  prewakeTimer: NodeJS.Timeout | undefined;
  /** The statement carrying this hold's early wake, until it answered. */
  prewaking: Promise<void> | null = null;
  private lostReason: Error | undefined;
  private readonly sinceMs = Date.now();
  lost = false;
  /** The unlock was asked for (and until `result`, is on its way). */
  releaseRequested = false;
  /**
   * The hold that passed this one its key in memory (a hand-over), until the connection confirmed the pass:
   * its job has returned, and whether its key was held until then is known only with that answer.
   */
  passedFrom: HoldImpl | null = null;
  handsOffHere = false;
  private result: ReleaseResult | undefined;
  private answered: Promise<ReleaseResult> | undefined;
  private resolveAnswered: ((result: ReleaseResult) => void) | undefined;
  constructor(
    private readonly owner: HoldOwner,
    readonly key: bigint,
    readonly keyText: string,
    readonly generation: number,
    readonly info: HoldInfo,
    /** Every key of the hold: its own, or one slot per limit of a job with several limits (`key` first). */
    readonly keyTexts: readonly string[] = [keyText],
  ) {}
  /** Whether the hold covers one slot of each of several limits. */
  get stacked(): boolean {
    return this.keyTexts.length > 1;
  }
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
    return this.lost ? this.signal : this.owner.lossSignal();
  }
  /** Made on first use: only a job of a `reschedule` task that looks at its abort signal asks for it. */
  get supersedeSignal(): AbortSignal {
    if (!this.supersedeController) {
      this.supersedeController = new AbortController();
      if (this.supersededBy) this.supersedeController.abort(this.supersededBy);
    }
    return this.supersedeController.signal;
  }
  /** A newer job of the key superseded this hold's job: its signal aborts with `reason` (the first counts). */
  supersede(reason: SupersededError): void {
    if (this.supersededBy) return;
    this.supersededBy = reason;
    this.supersedeController?.abort(reason);
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
    this.owner.release(this);
  }
  /** The unlock's answer (called once, by the session). */
  settle(result: ReleaseResult): void {
    this.result = result;
    this.resolveAnswered?.(result);
  }
}

/** A lock request waiting for, or carried by, a lock statement. */
export interface LockRequest {
  slots: string[];
  /** The same keys as bigints, kept to avoid parsing them back. */
  keys: bigint[];
  info: HoldInfo;
  resolve(result: AcquireResult): void;
  reject(error: Error): void;
  /** How many times this request, woken early, has waited for its key's release (see Handoff.awaitRelease). */
  waits?: number;
  /**
   * A request of a job with several limits: the slots to try for each limit (those this process does not
   * hold or acquire itself; `slots` is all of them), one of each taken all or nothing.
   */
  limits?: string[][];
  /** With `limits`: each limit's slot-0 key (its line) for a limit of one slot, else "" (no line order). */
  lines?: string[];
  /** The rate asked with a single key, in the same statement (see `RateRide`). */
  ride?: RateRide;
  /**
   * Set when the request asks for a slot that the unlock of a hold of this process, in the same statement,
   * frees: its job waited here for that release (session.ts, `acquireAll`).
   */
  ridesUnlock?: boolean;
}

/**
 * A queued lock request and its outcome, which goes to its receiver, if any, and to a promise made only when
 * someone awaits it. Lock-ahead takes it by receiver: per job locked ahead, two promises, two closures and a
 * microtask fewer than a promise and its `then`, which allocates less per key (see bench/README.md, section
 * "Lock-ahead receivers"). Settles once; later calls are ignored, as a promise's would be.
 */
export class Acquisition implements LockRequest {
  waits?: number;
  limits?: string[][];
  lines?: string[];
  ride?: RateRide;
  ridesUnlock?: boolean;
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
    this.settle(result, undefined);
  }
  reject(error: Error): void {
    this.settle(undefined, error);
  }
  /** The first outcome counts: `value`, or `error` when set. */
  private settle(value: AcquireResult | undefined, error: Error | undefined): void {
    if (this.done) return;
    this.done = true;
    this.value = value;
    this.error = error;
    this.receiver?.settle(error ? null : value!);
    if (error) this.rejectMade?.(error);
    else this.resolveMade?.(value!);
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
