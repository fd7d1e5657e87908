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

  /** Follows a runner's workers; returns a function that stops following them. */
  attach(events: WorkerEvents): () => void {
    const told = (worker: Worker, jobId: string | null) => {
      const fetched = this.fetching.get(worker);
      if (!fetched) return;
      this.fetching.delete(worker);
      fetched(jobId);
    };
    const onEmpty = ({ worker }: { worker: Worker }) => {
      this.idle.add(worker);
      told(worker, null);
    };
    const onBusy = ({ worker }: { worker: Worker }) => {
      this.idle.delete(worker);
    };
    const onStart = ({ worker, job }: { worker: Worker; job: { id: string } }) =>
      told(worker, job.id);
    const onStop = ({ worker }: { worker: Worker }) => {
      this.idle.delete(worker);
      told(worker, null);
    };
    events.on("worker:getJob:empty", onEmpty);
    events.on("worker:getJob:start", onBusy);
    events.on("worker:release", onBusy);
    events.on("worker:stop", onStop);
    events.on("job:start", onStart);
    return () => {
      events.off("worker:getJob:empty", onEmpty);
      events.off("worker:getJob:start", onBusy);
      events.off("worker:release", onBusy);
      events.off("worker:stop", onStop);
      events.off("job:start", onStart);
    };
  }
}
