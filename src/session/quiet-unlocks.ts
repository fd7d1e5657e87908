/**
 * When an unlock nobody waits for leaves, while lock-ahead is in use (a lock-ahead request in the last
 * LOCK_AHEAD_RECENT_MS): it may wait up to QUIET_UNLOCK_HOLD_MS on an idle connection for a lock statement to
 * ride. Lock-ahead statements carry a fetched batch's locks, ahead of its jobs, so no job waits on what rides
 * them; sent alone, the unlock is a socket write in the finishing job's path and a wake of the server for one
 * key. Without lock-ahead every lock statement is some job's wait, and an unlock riding it is slower (see
 * `onlyQuietUnlocks` in session.ts), so there it leaves at once. The figures behind both choices are in
 * bench/README.md, section "Quiet unlocks".
 */

const QUIET_UNLOCK_HOLD_MS = 2;
const LOCK_AHEAD_RECENT_MS = 1000;

export class QuietUnlocks {
  /** When the oldest unlock of the session's unlock queue was queued (`performance.now()`). */
  since = 0;
  /** When lock-ahead last asked for a lock (`acquireInto`). */
  lockAheadAt = -Infinity;
  /** The end of a hold of quiet unlocks, while one runs. */
  private timer: NodeJS.Timeout | null = null;

  /** `flush` sends what the session has queued; called when a hold's time is up. */
  constructor(private readonly flush: () => void) {}

  /**
   * Whether `queued` quiet unlocks on an idle connection wait for a lock statement to ride: only while
   * lock-ahead is in use, and for at most QUIET_UNLOCK_HOLD_MS after the oldest was queued; a timer sends
   * them when the time is up.
   */
  hold(queued: number): boolean {
    if (queued === 0) return false;
    const now = performance.now();
    if (now - this.lockAheadAt > LOCK_AHEAD_RECENT_MS) return false;
    const left = this.since + QUIET_UNLOCK_HOLD_MS - now;
    if (left <= 0) return false;
    this.timer ??= setTimeout(() => {
      this.timer = null;
      this.since = -Infinity;
      this.flush();
    }, left);
    return true;
  }

  /** Ends a hold that runs (its unlocks leave now, or went with the connection). */
  end(): void {
    if (this.timer === null) return;
    clearTimeout(this.timer);
    this.timer = null;
  }
}
