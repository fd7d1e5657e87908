/**
 * Timed wakes of jobs given back to the queue for a later moment. graphile-worker fetches a job whose
 * `run_at` comes only at its next poll, and by `run_at`: a copy given back over its rate would wait behind
 * every job queued after it. So the process that gave a job back wakes it at its moment: a copy given back
 * over its rate through `wake_reserved_planned` (runnable ahead of the jobs queued after it, and announced
 * to every worker, in one statement), any other (a snooze, the end of a pause) by an idle worker of its own
 * (`nudge`), else by telling every worker, as for a new job. A copy whose slot moved later meanwhile (the
 * jobs ahead of it started late) is not woken then: it is woken ahead of its new slot. Should the process
 * end first, the jobs run at their own `run_at`, at the next poll of any worker.
 *
 * A process sends one wake statement at a time: wakes that fall due while one is in flight go together in
 * the next. (A statement per wake, each on a connection of its own, would open new connections just when
 * a backlog keeps the server busy, and a wake then waits for its connection longer than the slot it is
 * for.)
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
  /** Wakes fallen due while a statement is in flight: they go in the next. */
  private pending: { count: number; reserved: string[] } = { count: 0, reserved: [] };
  private sending = false;

  /**
   * @param idle - this process's idle workers
   * @param send - wakes the copies `reserved` and tells every worker of `count` more jobs; answers the copies
   *   it did not wake because their slot moved later, each with how long from now to wake it instead
   */
  constructor(
    private readonly idle: IdleWorkers,
    private readonly send: (
      reserved: string[],
      count: number,
    ) => Promise<Array<{ copy: string; delayMs: number }>>,
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
    this.pending.count += left;
    this.pending.reserved.push(...entry.reserved);
    this.flush();
  }

  /** Sends the pending wakes, unless a statement is in flight (they follow it). */
  private flush(): void {
    if (this.sending) return;
    const { count, reserved } = this.pending;
    if (count === 0 && reserved.length === 0) return;
    this.pending = { count: 0, reserved: [] };
    this.sending = true;
    void this.send(reserved, count)
      .then((later) => {
        for (const { copy, delayMs } of later) this.in(delayMs, copy);
      })
      .catch(() => undefined)
      .finally(() => {
        this.sending = false;
        this.flush();
      });
  }

  /** Cancels every wake (the instance is released). */
  clear(): void {
    for (const { timer } of this.due.values()) clearTimeout(timer);
    this.due.clear();
    this.pending = { count: 0, reserved: [] };
  }
}
