/**
 * The task wrapper: takes the job's key on the lock session before the task runs and releases it after,
 * and applies the conflict strategy when the key is held.
 */
import type { Job, JobHelpers, Task } from "graphile-worker";
import { LockConflictError } from "./errors.js";
import type { LocksContext } from "./context.js";
import type { Hold, HoldInfo } from "./session.js";
import { slotKeys } from "./key.js";
import type { AddJobSpec, ResolvedExclusiveOptions } from "./options.js";
import type { AddJobResult } from "./enqueue.js";

/** A graphile-worker task that runs at most `limit` jobs per key at a time. */
export interface ExclusiveTask<TPayload = unknown> extends Task {
  readonly taskIdentifier: string;
  readonly options: Readonly<ResolvedExclusiveOptions<TPayload>>;
  /** The advisory lock key of a payload (slot 0 when `limit > 1`). */
  lockKey(payload: TPayload): bigint;
  /** Whether a job with this payload could take its lock now. Advisory: it never takes the lock. */
  lockAvailable(payload: TPayload): Promise<boolean>;
  /** Adds a job of this task, dropped up front if its key is held (unless `preemptive: false`). */
  addJob(payload: TPayload, spec?: AddJobSpec): Promise<AddJobResult>;
  /** @internal How lock-ahead locks a fetched job of this task. */
  readonly lockPlan: (job: Job) => { slots: bigint[]; info: HoldInfo };
}

/** Remembers consecutive conflicts per key for the reschedule backoff; bounded in size. */
class ConflictCounter {
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

/**
 * The helpers the task sees: graphile-worker's, with an `abortSignal` (and `abortPromise`) that fires on
 * graphile-worker's shutdown abort and when the lock is lost. Made only if the task reads them.
 */
function lockedHelpers(helpers: JobHelpers, hold: Hold): { helpers: JobHelpers; dispose(): void } {
  let sources: AbortSignal[] = [];
  let controller: AbortController | undefined;
  let promise: Promise<void> | undefined;
  const onAbort = (event: Event) => controller!.abort((event.target as AbortSignal).reason);
  const signal = (): AbortSignal => {
    if (!controller) {
      controller = new AbortController();
      sources = [helpers.abortSignal, hold.signal].filter((s): s is AbortSignal => s !== undefined);
      for (const source of sources) {
        if (source.aborted) controller.abort(source.reason);
        else source.addEventListener("abort", onAbort, { once: true });
      }
    }
    return controller.signal;
  };
  const wrapped = { ...helpers };
  Object.defineProperties(wrapped, {
    abortSignal: { enumerable: true, get: signal },
    abortPromise: {
      enumerable: true,
      get: () => {
        if (!promise) {
          const s = signal();
          promise = new Promise<void>((_resolve, reject) => {
            if (s.aborted) reject(s.reason);
            else s.addEventListener("abort", () => reject(s.reason), { once: true });
          });
          promise.catch(() => undefined);
        }
        return promise;
      },
    },
  });
  return {
    helpers: wrapped,
    dispose: () => {
      for (const source of sources) source.removeEventListener("abort", onAbort);
    },
  };
}

export function makeExclusiveTask<TPayload>(
  ctx: LocksContext,
  taskIdentifier: string,
  task: (payload: TPayload, helpers: JobHelpers) => unknown,
  options: ResolvedExclusiveOptions<TPayload>,
): ExclusiveTask<TPayload> {
  const conflicts = new ConflictCounter();
  const keysOf = (payload: TPayload) =>
    slotKeys(taskIdentifier, options.key(payload), options.limit, options.keyPath);
  // A payload read back from PostgreSQL's JSON is JSON-safe by construction: at run time only what a custom
  // key function returns needs the check.
  const runtimePath = options.keyPath === "payload" ? null : options.keyPath;
  const keysOfJob = (job: Job) =>
    slotKeys(taskIdentifier, options.key(job.payload as TPayload), options.limit, runtimePath);
  const holdInfo = (job: Job, slots: readonly bigint[]): HoldInfo => ({
    taskIdentifier,
    jobId: job.id,
    wakeKey: options.onConflict === "reschedule" ? slots[0]! : null,
  });

  const onConflict = async (
    job: Job,
    helpers: JobHelpers,
    slots: readonly bigint[],
    local: boolean,
  ) => {
    const lockKey = slots[0]!;
    const strategy = options.onConflict;
    ctx.emit("lock:conflict", { taskIdentifier, lockKey, job, strategy, local });
    switch (strategy) {
      case "drop":
        helpers.logger.info(`Dropped job ${job.id}: lock ${lockKey} is held by another job`);
        ctx.emit("job:dropped", { taskIdentifier, lockKey, job });
        return;
      case "raise":
        throw new LockConflictError(taskIdentifier, lockKey);
      case "reschedule": {
        const { minDelay, maxDelay, jitter } = options.reschedule;
        const n = conflicts.next(lockKey.toString());
        const base = Math.min(maxDelay, minDelay * 2 ** Math.min(n, 30));
        const delayMs = Math.round(base * (1 - jitter * Math.random()));
        const runAt = new Date(Date.now() + delayMs);
        const newJobId = await helpers.withPgClient(async (client) => {
          const { rows } = await client.query<{ id: string | null }>(ctx.sql.parkJob, [
            job.id,
            runAt.toISOString(),
            lockKey.toString(),
          ]);
          const id = rows[0]?.id;
          // The holder may have released between our attempt and the park's commit: then wake it now.
          if (id) await client.query(ctx.sql.wakeIfFree, [slots.map(String), lockKey.toString()]);
          return id;
        });
        if (!newJobId) throw new Error(`Could not reschedule job ${job.id}: it no longer exists`);
        helpers.logger.debug(
          `Rescheduled job ${job.id} as ${newJobId} in ${delayMs}ms: lock ${lockKey} is held`,
        );
        ctx.emit("job:rescheduled", { taskIdentifier, lockKey, job, newJobId, runAt, delayMs });
        return;
      }
    }
  };

  const wrapped = async (payload: unknown, helpers: JobHelpers) => {
    const { job } = helpers;
    // With lock-ahead the key was derived (and usually taken) when the job was fetched.
    const prefetched = ctx.prefetched(job.id);
    let result = prefetched ? await prefetched : null;
    if (!result?.acquired) {
      const slots = keysOfJob(job);
      result = await ctx.session.acquire(slots, holdInfo(job, slots));
      if (!result.acquired) return onConflict(job, helpers, slots, result.local);
    }

    const { hold } = result;
    if (hold.info.wakeKey !== null) conflicts.clear(hold.info.wakeKey.toString());
    ctx.emit("lock:acquired", { taskIdentifier, lockKey: hold.key, job });

    const locked = lockedHelpers(helpers, hold);
    const started = performance.now();
    try {
      const value = await task(payload as TPayload, locked.helpers);
      // graphile-worker awaits an array of promises after the task returns; keep the lock until they settle.
      if (Array.isArray(value)) await Promise.allSettled(value);
      return value as ReturnType<Task>;
    } finally {
      locked.dispose();
      // The unlock joins the next lock statement; the job need not wait for it to complete. Until it lands,
      // the key is still held (PostgreSQL enforces that, and this process counts it as held), so nothing
      // can overlap; a late unlock of a lost session is a no-op.
      const released = hold.release();
      if (ctx.listening("lock:released")) {
        const heldMs = performance.now() - started;
        void released.then(({ outcome }) =>
          ctx.emit("lock:released", { taskIdentifier, lockKey: hold.key, job, outcome, heldMs }),
        );
      }
    }
  };

  return Object.assign(wrapped as Task, {
    taskIdentifier,
    options,
    lockKey: (payload: TPayload) => keysOf(payload)[0]!,
    lockPlan: (job: Job) => {
      const slots = keysOfJob(job);
      return { slots, info: holdInfo(job, slots) };
    },
    lockAvailable: async (payload: TPayload) => ctx.lockAvailable(keysOf(payload)),
    addJob: (payload: TPayload, spec?: AddJobSpec) => ctx.addJob(taskIdentifier, payload, spec),
  }) as ExclusiveTask<TPayload>;
}
