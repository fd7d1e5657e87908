/**
 * The bench's timing probe of the lock session, for the benchmark's latency and contention sections: when
 * each lock and unlock request was queued, when its statement was sent, and when the answer arrived, and the
 * stages of a hand-off of a key to the next job in its line (`performance.now()` values). Off unless
 * `setTimingProbe` set one; then each request costs a map entry and a few clock reads. Not in the package's
 * entry point: the bench imports this module from the build.
 */

/**
 * A stage of a hand-off, by the job it concerns: `unlockSent` and `unlockAnswered`, the unlock of the job's
 * hold left and came back; `waiting`, the job, woken early, found its key held by a job of this process and
 * waits to be handed it; `handedOver`, the job was passed a key in memory (in-process hand-over);
 * `noticed`, a job waiting for another session's release heard of it; `granted`, the job was given its hold.
 */
export type HandoffStage =
  "unlockSent" | "unlockAnswered" | "waiting" | "handedOver" | "noticed" | "granted";

export interface TimingProbe {
  lock(queuedAt: number, sentAt: number, answeredAt: number): void;
  unlock(queuedAt: number, sentAt: number, answeredAt: number): void;
  /** A hand-off stage of job `jobId`, at `at`. */
  stage?(stage: HandoffStage, jobId: string, at: number): void;
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

/** Notes a hand-off stage of job `jobId` (none for a hold without a job), while a probe is set. */
export function probeStage(stage: HandoffStage, jobId: string | null): void {
  if (probe?.stage && jobId !== null) probe.stage(stage, jobId, performance.now());
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
