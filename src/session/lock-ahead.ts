/**
 * Lock-ahead for graphile-worker's local queue. When a runner fetches a batch of jobs into its local queue
 * (`localQueue.size`), the locks of the first of the batch's exclusive jobs are requested at once, in the
 * lock session's next statement, so that each job finds its lock already taken when it starts instead of
 * waiting a round trip. A job keeps a lock taken ahead until it runs and finishes; a job handed back by the
 * local queue (shutdown, ttl) gives it back. A lock-ahead request that met a held key is not final: the job tries
 * again when it starts, so lock-ahead never turns a key that frees in time into a conflict.
 *
 * Lock-ahead takes only what the runner can start soon: the jobs of a fetched batch that go straight to
 * idle workers, and LOCK_AHEAD_MARGIN more; as a job with a lock taken ahead starts, the next waiting job of
 * its local queue takes its lock, up to the idle workers and the margin again. So a runner's jobs hold at most
 * its concurrency plus LOCK_AHEAD_MARGIN keys, whatever the size of its local queue: each is an entry of
 * PostgreSQL's shared lock table (see the README's lock table sizing).
 *
 * Holding the lock from fetch to start is stricter, never looser: the job is claimed by this worker from
 * the moment it is fetched.
 */
import type { Job, WorkerEvents } from "graphile-worker";
import type { AcquireReceiver, AcquireResult, HoldInfo } from "./holds.js";
import type { LockSession } from "./session.js";

/** How a task defined on this instance locks a job: its slot keys and hold info, or null if it does not. */
export type LockPlan = (
  job: Job,
) => { slots: bigint[]; info: HoldInfo; limits?: ReadonlyArray<readonly bigint[]> } | null;

/**
 * How many jobs of a local queue, besides those going to idle workers, hold a lock taken ahead without having
 * started: the next jobs of busy workers, ready for when those workers finish.
 */
export const LOCK_AHEAD_MARGIN = 8;

/**
 * A lock-ahead acquisition: its result once settled (null if it failed), and a promise of it, made only for a
 * job that starts before its lock statement has answered.
 */
export class AheadAcquisition implements AcquireReceiver {
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

/** What graphile-worker's local queue events show of the queue (0.17.3 and 0.18). */
interface LocalQueueView {
  /** Jobs fetched and waiting for a worker, in the order workers take them. */
  readonly jobQueue?: readonly Job[];
  /** Workers waiting for a job (idle). */
  readonly workerQueue?: readonly unknown[];
}

/** A local queue's lock-ahead: how many of its jobs hold a lock taken ahead and have not started. */
interface QueueAhead {
  readonly queue: LocalQueueView;
  ahead: number;
}

export class LockAhead {
  private readonly pending = new Map<
    string,
    { acquisition: AheadAcquisition; queue: QueueAhead }
  >();
  private readonly queues = new WeakMap<object, QueueAhead>();
  /** Jobs fetched in a batch that would wait in line for a held key, and have not started yet. */
  private readonly batched = new Set<string>();

  /** `waitsInLine`: whether a job of a batch would wait in its key's line at its worker (exclusive.ts). */
  constructor(
    private readonly session: LockSession,
    private readonly plan: LockPlan,
    private readonly waitsInLine: (job: Job) => boolean = () => false,
  ) {}

  /** A batch `queue` fetched: its first jobs take their locks, for its idle workers and the margin. */
  fetched(jobs: readonly Job[], queue: LocalQueueView = {}): void {
    for (const job of jobs) if (this.waitsInLine(job)) this.batched.add(job.id);
    let state = this.queues.get(queue);
    if (!state) {
      state = { queue, ahead: 0 };
      this.queues.set(queue, state);
    }
    this.fill(state, jobs);
  }

  /**
   * Takes locks ahead for `jobs` (in the order they will start) while fewer of `state`'s jobs hold one than
   * it has idle workers plus LOCK_AHEAD_MARGIN. (A fetched batch goes to the idle workers after this.) A job
   * that would wait in line at its worker takes its lock ahead only as one of the idle workers' jobs, never
   * within the margin: a key taken ahead by a job that waits in the local queue for a worker would keep
   * this process's workers waiting in line for it, for as long as they wait.
   */
  private fill(state: QueueAhead, jobs: readonly Job[]): void {
    const idle = state.queue.workerQueue?.length ?? 0;
    const limit = idle + LOCK_AHEAD_MARGIN;
    for (const job of jobs) {
      if (state.ahead >= limit) return;
      if (this.pending.has(job.id)) continue;
      if (state.ahead >= idle && this.waitsInLine(job)) continue;
      let plan: ReturnType<LockPlan>;
      try {
        plan = this.plan(job);
      } catch {
        continue; // the job itself will report the bad key when it runs
      }
      if (!plan) continue;
      const acquisition = new AheadAcquisition();
      this.pending.set(job.id, { acquisition, queue: state });
      state.ahead++;
      this.session.acquireInto(plan.slots, plan.info, acquisition, plan.limits);
    }
  }

  /**
   * The lock-ahead acquisition of a job that is starting, if any (and forgets it); the jobs waiting in its
   * local queue then take locks ahead in its place.
   */
  take(jobId: string): AheadAcquisition | undefined {
    const entry = this.forget(jobId);
    if (!entry) return undefined;
    const waiting = entry.queue.queue.jobQueue;
    if (Array.isArray(waiting)) this.fill(entry.queue, waiting);
    return entry.acquisition;
  }

  private forget(jobId: string): { acquisition: AheadAcquisition; queue: QueueAhead } | undefined {
    const entry = this.pending.get(jobId);
    if (!entry) return undefined;
    this.pending.delete(jobId);
    entry.queue.ahead--;
    return entry;
  }

  /** Whether job `jobId`, starting, was fetched in a batch (and forgets it). */
  wasBatched(jobId: string): boolean {
    return this.batched.delete(jobId);
  }

  /** Jobs handed back by the local queue: their locks taken ahead are released. */
  returned(jobs: readonly Job[]): void {
    for (const job of jobs) {
      this.batched.delete(job.id);
      this.giveBack(job.id);
    }
  }

  releaseAll(): void {
    for (const id of [...this.pending.keys()]) this.giveBack(id);
  }

  private giveBack(jobId: string): void {
    void this.forget(jobId)?.acquisition.promise.then((result) => {
      if (result?.acquired) result.hold.releaseQuietly();
    });
  }

  /** Listens to a runner's events; returns a function that stops listening and releases what is left. */
  attach(events: WorkerEvents): () => void {
    const onFetched = ({ jobs, localQueue }: { jobs: Job[]; localQueue: object }) =>
      this.fetched(jobs, localQueue as LocalQueueView);
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
