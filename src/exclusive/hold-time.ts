/**
 * Reschedule timing of a `reschedule` task: how long its jobs hold their key (which times the early wake of
 * the next job in line and a parked job's safety net), and the count of consecutive conflicts per key that
 * sets the reschedule backoff.
 */

/**
 * How long this task's jobs hold their key, as a moving average (for timing a parked job's safety net by
 * its place in line). Only measured for `reschedule` tasks.
 */
export class HoldTime {
  private average = 0;
  private samples = 0;
  record(ms: number): void {
    this.samples = Math.min(this.samples + 1, 20);
    this.average += (ms - this.average) / this.samples;
  }
  estimateMs(): number {
    return Math.round(this.average * 10) / 10;
  }
  /**
   * When to wake the next job in line early: `PREWAKE_LEAD_MS` before this task's holds usually end, so that
   * it is fetched and waiting when the key frees. Not for tasks not yet measured, nor for long ones (whose
   * hand-off is small beside their run, and whose end is harder to foresee).
   */
  prewakeAfterMs(): number | null {
    if (this.samples < 3 || this.average > PREWAKE_MAX_HOLD_MS) return null;
    return Math.max(0, Math.round(this.average - PREWAKE_LEAD_MS));
  }
  /**
   * How long a job woken early waits for the release before it parks again: twice a usual hold, 100 ms at
   * least, a second at most.
   */
  releaseWaitMs(): number {
    return Math.min(1000, Math.max(100, Math.round(2 * this.average)));
  }
}

/**
 * How long before a hold's usual end the next job in line is woken: a wake, a fetch and a lock take a few
 * milliseconds on a busy server, and a job that arrives early only waits; shorter leads made hand-offs slower
 * (see bench/README.md, section "Early-wake lead").
 */
const PREWAKE_LEAD_MS = 20;
/** Tasks whose holds usually last longer than this wake their line at the release only. */
const PREWAKE_MAX_HOLD_MS = 1000;

/** Remembers consecutive conflicts per key for the reschedule backoff; bounded in size. */
export class ConflictCounter {
  private readonly counts = new Map<string, number>();
  next(key: string): number {
    const n = this.counts.get(key) ?? 0;
    this.counts.delete(key);
    if (this.counts.size >= 10_000) this.counts.delete(this.counts.keys().next().value!);
    this.counts.set(key, n + 1);
    return n;
  }
  clear(key: string): void {
    if (this.counts.size > 0) this.counts.delete(key);
  }
}
