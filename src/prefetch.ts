/**
 * Lock-ahead for graphile-worker's local queue. When a runner fetches a batch of jobs into its local queue
 * (`localQueue.size`), the locks of the batch's exclusive jobs are requested at once, in the lock session's
 * next statement, so that each job finds its lock already taken when it starts instead of waiting a round
 * trip. A job keeps a prefetched lock until it runs and finishes; a job handed back by the local queue
 * (shutdown, ttl) gives it back. A prefetch that met a held key is not final: the job tries again when it
 * starts, so lock-ahead never turns a key that frees in time into a conflict.
 *
 * Holding the lock from fetch to start is stricter, never looser: the job is claimed by this worker from
 * the moment it is fetched.
 */
import type { Job, WorkerEvents } from "graphile-worker";
import type { AcquireReceiver, AcquireResult, HoldInfo } from "./holds.js";
import type { LockSession } from "./session.js";

/** How a task defined on this instance locks a job: its slot keys and hold info, or null if it does not. */
export type LockPlan = (job: Job) => { slots: bigint[]; info: HoldInfo } | null;

/**
 * A lock-ahead acquisition: its result once settled (null if it failed), and a promise of it, made only for a
 * job that starts before its lock statement has answered.
 */
export class Prefetch implements AcquireReceiver {
  settled = false;
  result: AcquireResult | null = null;
  private made: Promise<AcquireResult | null> | undefined;
  private resolveMade: ((result: AcquireResult | null) => void) | undefined;

  get promise(): Promise<AcquireResult | null> {
    this.made ??= this.settled
      ? Promise.resolve(this.result)
      : new Promise((resolve) => (this.resolveMade = resolve));
    return this.made;
  }

  settle(result: AcquireResult | null): void {
    this.settled = true;
    this.result = result;
    this.resolveMade?.(result);
  }
}

export class Prefetcher {
  private readonly pending = new Map<string, Prefetch>();

  constructor(
    private readonly session: LockSession,
    private readonly plan: LockPlan,
  ) {}

  fetched(jobs: readonly Job[]): void {
    for (const job of jobs) {
      if (this.pending.has(job.id)) continue;
      let plan: ReturnType<LockPlan>;
      try {
        plan = this.plan(job);
      } catch {
        continue; // the job itself will report the bad key when it runs
      }
      if (!plan) continue;
      const entry = new Prefetch();
      this.pending.set(job.id, entry);
      this.session.acquireInto(plan.slots, plan.info, entry);
    }
  }

  /** The prefetched acquisition of a job that is starting, if any (and forgets it). */
  take(jobId: string): Prefetch | undefined {
    const pending = this.pending.get(jobId);
    if (pending) this.pending.delete(jobId);
    return pending;
  }

  /** Jobs handed back by the local queue: their prefetched locks are released. */
  returned(jobs: readonly Job[]): void {
    for (const job of jobs) this.giveBack(job.id);
  }

  releaseAll(): void {
    for (const id of [...this.pending.keys()]) this.giveBack(id);
  }

  private giveBack(jobId: string): void {
    void this.take(jobId)?.promise.then((result) => {
      if (result?.acquired) result.hold.releaseQuietly();
    });
  }

  /** Listens to a runner's events; returns a function that stops listening and releases what is left. */
  attach(events: WorkerEvents): () => void {
    const onFetched = ({ jobs }: { jobs: Job[] }) => this.fetched(jobs);
    const onReturned = ({ jobs }: { jobs: Job[] }) => this.returned(jobs);
    events.on("localQueue:getJobs:complete", onFetched);
    events.on("localQueue:returnJobs", onReturned);
    return () => {
      events.off("localQueue:getJobs:complete", onFetched);
      events.off("localQueue:returnJobs", onReturned);
      this.releaseAll();
    };
  }
}
