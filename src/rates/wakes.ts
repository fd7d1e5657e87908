/**
 * Timed wakes of jobs given back to the queue for a later moment (a reserved slot, a snooze, the end of a
 * pause). graphile-worker fetches a job whose `run_at` comes only at its next poll; the process that gave the
 * job back makes a worker fetch at that moment instead: an idle worker of its own (`nudge`), else every
 * worker is told, as for a new job. Wakes due in the same millisecond share one timer. Should the process end
 * first, the job runs at the next poll of any worker.
 */
import type { IdleWorkers } from "../session/idle.js";

/** How long after the moment the fetch is made: the timer and the database's clock may differ by a little. */
const MARGIN_MS = 2;

export class Wakes {
  private readonly due = new Map<number, { count: number; timer: NodeJS.Timeout }>();

  constructor(
    private readonly idle: IdleWorkers,
    private readonly announce: (count: number) => void,
  ) {}

  /** A job becomes runnable in `delayMs`. */
  in(delayMs: number): void {
    const at = Math.ceil(performance.now() + Math.max(0, delayMs)) + MARGIN_MS;
    const entry = this.due.get(at);
    if (entry) {
      entry.count++;
      return;
    }
    const timer = setTimeout(() => this.fire(at), at - performance.now());
    timer.unref();
    this.due.set(at, { count: 1, timer });
  }

  private fire(at: number): void {
    const entry = this.due.get(at);
    this.due.delete(at);
    if (!entry) return;
    let left = entry.count;
    while (left > 0 && this.idle.nudge()) left--;
    if (left > 0) this.announce(left);
  }

  /** Cancels every wake (the instance is released). */
  clear(): void {
    for (const { timer } of this.due.values()) clearTimeout(timer);
    this.due.clear();
  }
}
