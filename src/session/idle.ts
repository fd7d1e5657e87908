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

  /** How many workers are idle now. */
  get count(): number {
    return this.idle.size;
  }

  /** Makes one idle worker fetch a job now; false if none was idle. */
  nudge(): boolean {
    for (const worker of this.idle) {
      this.idle.delete(worker);
      try {
        if (worker.nudge()) return true;
      } catch {
        // released meanwhile (graphile-worker asserts that a nudged worker is active)
      }
    }
    return false;
  }

  /** Follows a runner's workers; returns a function that stops following them. */
  attach(events: WorkerEvents): () => void {
    const onEmpty = ({ worker }: { worker: Worker }) => {
      this.idle.add(worker);
    };
    const onBusy = ({ worker }: { worker: Worker }) => {
      this.idle.delete(worker);
    };
    events.on("worker:getJob:empty", onEmpty);
    events.on("worker:getJob:start", onBusy);
    events.on("worker:release", onBusy);
    events.on("worker:stop", onBusy);
    return () => {
      events.off("worker:getJob:empty", onEmpty);
      events.off("worker:getJob:start", onBusy);
      events.off("worker:release", onBusy);
      events.off("worker:stop", onBusy);
    };
  }
}
