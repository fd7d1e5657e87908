/**
 * The idle workers of the runners given to `locks.attach`, so that a job woken early for a key this process
 * holds can be fetched here (where the key then passes to it in memory) rather than by whichever process
 * answers graphile-worker's notification first.
 *
 * A worker without a local queue that found no job waits for its next poll; graphile-worker's `nudge()` makes
 * it fetch at once and says whether it was idle. Workers fed by a local queue never show as idle here, so
 * their early wakes are announced to every worker, as without `attach`.
 */
import type { Worker, WorkerEvents } from "graphile-worker";

export class IdleWorkers {
  private readonly idle = new Set<Worker>();
  /** Nudged workers whose fetch someone waits for, with what to tell them (the job's id, or null: none). */
  private readonly fetching = new Map<Worker, (jobId: string | null) => void>();
  /** Workers whose fetch is in flight, nudged or not. */
  private readonly inFlight = new Set<Worker>();
  /** Those waiting for a set of fetches in flight to come back (see afterFetchesInFlight). */
  private readonly settleWaiters = new Set<{ workers: Set<Worker>; done: () => void }>();
  /** Jobs watched for their start by any worker here, with whether it started (see watch). */
  private readonly watched = new Map<string, boolean>();

  /** How many workers are idle now. */
  get count(): number {
    return this.idle.size;
  }

  /**
   * Makes one idle worker fetch a job now; false if none was idle. `fetched`, if given, hears which job that
   * fetch got (null: none).
   */
  nudge(fetched?: (jobId: string | null) => void): boolean {
    for (const worker of this.idle) {
      this.idle.delete(worker);
      try {
        if (worker.nudge()) {
          if (fetched) this.fetching.set(worker, fetched);
          return true;
        }
      } catch {
        // released meanwhile (graphile-worker asserts that a nudged worker is active)
      }
    }
    return false;
  }

  /**
   * Calls `done` once every fetch in flight now has come back; at once if none is. Fetches that start later
   * are not waited for. (A nudged worker's `fetched` hears of its fetch once it is no longer in flight.)
   */
  afterFetchesInFlight(done: () => void): void {
    if (this.inFlight.size === 0) done();
    else this.settleWaiters.add({ workers: new Set(this.inFlight), done });
  }

  /** Notes from now on whether any worker here starts job `jobId` (see started), until `unwatch`. */
  watch(jobId: string): void {
    this.watched.set(jobId, false);
  }

  /** Whether a worker here started job `jobId` since `watch`. */
  started(jobId: string): boolean {
    return this.watched.get(jobId) === true;
  }

  unwatch(jobId: string): void {
    this.watched.delete(jobId);
  }

  /**
   * Follows a runner's workers; returns a function that stops following them. A runner detaches as it
   * begins to stop, before its workers do: what they do after that is never heard, so the function also
   * forgets each worker this runner showed, as if its fetch in flight, if any, had come back with nothing.
   * Otherwise a fetch in flight at the stop would stay in flight here for good, and a key kept for a job
   * woken early would wait for it (`afterFetchesInFlight`) until the keep's time limit.
   */
  attach(events: WorkerEvents): () => void {
    const seen = new Set<Worker>();
    const told = (worker: Worker, jobId: string | null) => {
      this.inFlight.delete(worker);
      if (jobId !== null && this.watched.has(jobId)) this.watched.set(jobId, true);
      for (const waiter of this.settleWaiters) {
        if (!waiter.workers.delete(worker) || waiter.workers.size > 0) continue;
        this.settleWaiters.delete(waiter);
        waiter.done();
      }
      const fetched = this.fetching.get(worker);
      if (!fetched) return;
      this.fetching.delete(worker);
      fetched(jobId);
    };
    const onEmpty = ({ worker }: { worker: Worker }) => {
      seen.add(worker);
      this.idle.add(worker);
      told(worker, null);
    };
    const onFetch = ({ worker }: { worker: Worker }) => {
      seen.add(worker);
      this.idle.delete(worker);
      this.inFlight.add(worker);
    };
    const onError = ({ worker }: { worker: Worker }) => told(worker, null);
    const onBusy = ({ worker }: { worker: Worker }) => {
      this.idle.delete(worker);
    };
    const onStart = ({ worker, job }: { worker: Worker; job: { id: string } }) =>
      told(worker, job.id);
    const onStop = ({ worker }: { worker: Worker }) => {
      seen.delete(worker);
      this.idle.delete(worker);
      told(worker, null);
    };
    events.on("worker:getJob:empty", onEmpty);
    events.on("worker:getJob:start", onFetch);
    events.on("worker:getJob:error", onError);
    events.on("worker:release", onBusy);
    events.on("worker:stop", onStop);
    events.on("job:start", onStart);
    return () => {
      events.off("worker:getJob:empty", onEmpty);
      events.off("worker:getJob:start", onFetch);
      events.off("worker:getJob:error", onError);
      events.off("worker:release", onBusy);
      events.off("worker:stop", onStop);
      events.off("job:start", onStart);
      for (const worker of seen) {
        this.idle.delete(worker);
        told(worker, null);
      }
      seen.clear();
    };
  }
}
