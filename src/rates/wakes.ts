/**
 * Timed wakes of jobs given back to the queue for a later moment. graphile-worker fetches a job whose
 * `run_at` comes only at its next poll, and by `run_at`: a copy given back over its rate would wait behind
 * every job queued after it. So the process that gave a job back wakes it at its moment: a copy given back
 * over its rate through `wake_reserved` (runnable ahead of the jobs queued after it, and announced to every
 * worker, in one statement), any other (a snooze, the end of a pause) by an idle worker of its own
 * (`nudge`), else by telling every worker, as for a new job. Wakes due in the same millisecond share one
 * timer and one statement. Should the process end first, the jobs run at their own `run_at`, at the next
 * poll of any worker.
 */
import type { IdleWorkers } from "../session/idle.js";

/** How long after the moment the wake comes: the timer and the database's clock may differ by a little. */
const MARGIN_MS = 2;

interface Due {
  count: number;
  reserved: string[];
  timer: NodeJS.Timeout;
}

export class Wakes {
  private readonly due = new Map<number, Due>();

  constructor(
    private readonly idle: IdleWorkers,
    private readonly send: (reserved: string[], count: number) => void,
  ) {}

  /** A job becomes runnable in `delayMs`; `reservedCopy`: it is a copy given back over its rate. */
  in(delayMs: number, reservedCopy?: string): void {
    const at = Math.ceil(performance.now() + Math.max(0, delayMs)) + MARGIN_MS;
    let entry = this.due.get(at);
    if (!entry) {
      const timer = setTimeout(() => this.fire(at), at - performance.now());
      timer.unref();
      entry = { count: 0, reserved: [], timer };
      this.due.set(at, entry);
    }
    if (reservedCopy === undefined) entry.count++;
    else entry.reserved.push(reservedCopy);
  }

  private fire(at: number): void {
    const entry = this.due.get(at);
    this.due.delete(at);
    if (!entry) return;
    let left = entry.count;
    while (left > 0 && this.idle.nudge()) left--;
    if (left > 0 || entry.reserved.length > 0) this.send(entry.reserved, left);
  }

  /** Cancels every wake (the instance is released). */
  clear(): void {
    for (const { timer } of this.due.values()) clearTimeout(timer);
    this.due.clear();
  }
}
