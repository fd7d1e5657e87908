/**
 * The bench's timing probe of the lock session, for the benchmark's latency section: when each lock and
 * unlock request was queued, when its statement was sent, and when the answer arrived (`performance.now()`
 * values). Off unless `setTimingProbe` set one; then each request costs a map entry and a few clock reads.
 * Not in the package's entry point: the bench imports this module from the build.
 */

export interface TimingProbe {
  lock(queuedAt: number, sentAt: number, answeredAt: number): void;
  unlock(queuedAt: number, sentAt: number, answeredAt: number): void;
}

let probe: TimingProbe | null = null;
const queuedAt = new WeakMap<object, number>();

/** Sets (or, with null, removes) the probe of every lock session of this process. Not part of the API. */
export function setTimingProbe(next: TimingProbe | null): void {
  probe = next;
}

/** Notes when a lock request or an unlock was queued, while a probe is set. */
export function probeQueued(request: object): void {
  if (probe) queuedAt.set(request, performance.now());
}

/** Reports the requests of a statement sent at `sentAt` that has just answered, while a probe is set. */
export function probeAnswered(
  sentAt: number,
  locks: readonly object[],
  unlocks: readonly object[],
): void {
  if (!probe) return;
  const answeredAt = performance.now();
  for (const r of locks) probe.lock(queuedAt.get(r) ?? sentAt, sentAt, answeredAt);
  for (const h of unlocks) probe.unlock(queuedAt.get(h) ?? sentAt, sentAt, answeredAt);
}
