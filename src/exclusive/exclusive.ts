/**
 * The task wrapper: takes the job's key on the lock session before the task runs and releases it after,
 * and applies the conflict strategy when the key is held.
 */
import type { Job, JobHelpers, Task } from "graphile-worker";
import { ErrorCodes, LockConflictError } from "../errors.js";
import type { LocksContext } from "../context.js";
import type { AcquireResult, Hold, HoldInfo } from "../session/holds.js";
import { callKeyFunction, slotKeys } from "../key.js";
import type { AddJobSpec, ResolvedExclusiveOptions } from "../options.js";
import type { ExclusiveTask } from "../types.js";

/** An exclusive task as this library sees it: the public task, and how lock-ahead locks its jobs. */
export interface ExclusiveTaskImpl<TPayload = unknown> extends ExclusiveTask<TPayload> {
  /** How lock-ahead locks a fetched job of this task. */
  readonly lockPlan: (job: Job) => { slots: bigint[]; info: HoldInfo };
}

/**
 * How long this task's jobs hold their key, as a moving average (for timing a parked job's safety net by
 * its place in line). Only measured for `reschedule` tasks.
 */
class HoldTime {
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
 * milliseconds on a busy server, and a job that arrives early only waits (measured: 4 ms made hand-offs slower
 * than 10, and 10 slower than 20).
 */
const PREWAKE_LEAD_MS = 20;
/** Tasks whose holds usually last longer than this wake their line at the release only. */
const PREWAKE_MAX_HOLD_MS = 1000;

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

/** The abort signal a locked task sees, and its promise form. */
interface LockedAbort {
  readonly lost: AbortSignal;
  readonly signal: AbortSignal;
  readonly promise: Promise<void>;
}

/**
 * The task's abort signal fires on graphile-worker's own abort (the worker's signal, shared by its jobs) and
 * when the lock session is lost (one signal per connection, shared by its holds). Both are long-lived and
 * shared, so their combination is made once per worker and connection, not per job: a job pays for a
 * spread of its helpers and nothing else.
 */
class LockedAborts {
  private readonly byWorker = new WeakMap<object, LockedAbort>();
  private readonly noWorkerSignal = {};

  helpers(helpers: JobHelpers, hold: Hold): JobHelpers {
    const lost = hold.sessionSignal;
    const workerSignal: AbortSignal | undefined = helpers.abortSignal;
    const owner = workerSignal ?? this.noWorkerSignal;
    let abort = this.byWorker.get(owner);
    if (abort?.lost !== lost) {
      abort = combine(lost, workerSignal);
      this.byWorker.set(owner, abort);
    }
    return { ...helpers, abortSignal: abort.signal, abortPromise: abort.promise };
  }
}

function combine(lost: AbortSignal, workerSignal: AbortSignal | undefined): LockedAbort {
  const controller = new AbortController();
  const sources = workerSignal ? [workerSignal, lost] : [lost];
  const onAbort = (event: Event) => {
    for (const source of sources) source.removeEventListener("abort", onAbort);
    controller.abort((event.target as AbortSignal).reason);
  };
  const aborted = sources.find((source) => source.aborted);
  if (aborted) controller.abort(aborted.reason);
  else for (const source of sources) source.addEventListener("abort", onAbort, { once: true });
  const { signal } = controller;
  const promise = new Promise<void>((_resolve, reject) => {
    if (signal.aborted) reject(signal.reason);
    else signal.addEventListener("abort", () => reject(signal.reason), { once: true });
  });
  promise.catch(() => undefined);
  return { lost, signal, promise };
}

/** The shortest delay of a deferred job's copy: it runs as soon as the session is back anyway. */
const DEFER_MIN_MS = 1000;
/** The longest pause between two tries to give a job back whose first try went unanswered. */
const DEFER_RETRY_MAX_MS = 1000;

/** Resolves after `ms`, or rejects with the signal's reason when it aborts first. */
function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason as Error);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason as Error);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

function isSessionUnavailable(error: unknown): error is Error {
  return (
    error instanceof Error &&
    (error as { code?: unknown }).code === ErrorCodes.LOCK_SESSION_UNAVAILABLE
  );
}

/** PostgreSQL could not take the job's lock for want of resources (its lock table is full): session.ts. */
function isLockTableFull(error: unknown): error is Error {
  return (
    error instanceof Error && (error as { code?: unknown }).code === ErrorCodes.LOCK_TABLE_FULL
  );
}

/**
 * Copies of deferred jobs, made runnable at once when the lock session is back (their `runAt` is a safety net
 * should this process not see it back). One wait for the session at a time, whatever the number of copies.
 */
class DeferredCopies {
  private readonly ids = new Set<string>();
  private waiting = false;
  constructor(private readonly ctx: LocksContext) {}

  add(id: string, helpers: JobHelpers): void {
    this.ids.add(id);
    if (this.waiting) return;
    this.waiting = true;
    void this.runWhenReady(helpers);
  }

  private async runWhenReady(helpers: JobHelpers): Promise<void> {
    try {
      for (;;) {
        const ready = await this.ctx.session.connection.whenReady(
          Math.max(DEFER_MIN_MS, this.ctx.lockSessionWaitMs),
        );
        if (this.ctx.session.connection.state === "closed") return;
        if (!ready) continue;
        const ids = [...this.ids];
        this.ids.clear();
        try {
          await helpers.withPgClient((client) => client.query(this.ctx.sql.runDeferred, [ids]));
        } catch (error) {
          // (their run_at still comes)
          helpers.logger.warn(
            `Could not run deferred jobs ${ids.join(", ")} now: ${String(error)}`,
            {
              error,
            },
          );
        }
        if (this.ids.size === 0) return;
      }
    } finally {
      this.waiting = false;
      this.ids.clear();
    }
  }
}

export function makeExclusiveTask<TPayload>(
  ctx: LocksContext,
  taskIdentifier: string,
  task: (payload: TPayload, helpers: JobHelpers) => unknown,
  options: ResolvedExclusiveOptions<TPayload>,
): ExclusiveTask<TPayload> {
  const conflicts = new ConflictCounter();
  // A custom key function is called through callKeyFunction, which checks what it returns and turns its
  // failures into errors naming the task; the payload itself is checked where it comes from the caller.
  const custom = options.keyPath !== "payload";
  const keysOf = (payload: TPayload) =>
    custom
      ? slotKeys(
          taskIdentifier,
          callKeyFunction(options.key, "key", taskIdentifier, payload),
          options.limit,
          null,
        )
      : slotKeys(taskIdentifier, payload, options.limit);
  // A payload read back from PostgreSQL's JSON is JSON-safe by construction. A key function that throws on
  // it fails the job (graphile-worker retries it) with an error naming the job, task and function.
  const keysOfJob = (job: Job) =>
    slotKeys(
      taskIdentifier,
      custom
        ? callKeyFunction(options.key, "key", taskIdentifier, job.payload, `job ${job.id}: `)
        : job.payload,
      options.limit,
      null,
    );
  const holdInfo = (job: Job, slots: readonly bigint[]): HoldInfo =>
    options.onConflict !== "reschedule"
      ? { taskIdentifier, jobId: job.id, reschedule: false }
      : {
          taskIdentifier,
          jobId: job.id,
          reschedule: true,
          wakeKey: slots[0]!,
          // Early wakes for single keys (a semaphore's next job may find any of its slots free).
          prewakeAfterMs: slots.length === 1 ? holdTime.prewakeAfterMs() : null,
          releaseWaitMs: holdTime.releaseWaitMs(),
        };

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
        const now = Date.now();
        const earliest = new Date(now + Math.round(base * (1 - jitter * Math.random())));
        // The safety net is later for a job further back in line (see park_job in sql/000001.sql).
        const latest = new Date(now + maxDelay);
        const parked = await helpers.withPgClient(async (client) => {
          const { rows } = await client.query<{ id: string; run_at: Date }>(ctx.sql.parkJob, [
            job.id,
            earliest.toISOString(),
            lockKey.toString(),
            holdTime.estimateMs(),
            latest.toISOString(),
            ctx.session.connection.pid,
          ]);
          const row = rows[0];
          // The holder may have released between our attempt and the park's commit: then wake it now. The
          // park has committed, so this is best effort: should it fail, the copy's safety net still runs it,
          // and the job must not fail (its row gave up its retries, and would stay behind as a failed job).
          if (row) {
            try {
              await client.query(ctx.sql.wakeIfFree, [
                slots.map(String),
                lockKey.toString(),
                job.id,
              ]);
            } catch (error) {
              helpers.logger.warn(
                `Could not wake the line of lock ${lockKey} after parking job ${job.id} (its copy runs by its safety net): ${String(error)}`,
                { error },
              );
              // The connection's state is uncertain: it goes, rather than back to the pool for the completion.
              await (client as { end(): Promise<void> }).end().catch(() => undefined);
            }
          }
          return row;
        });
        if (!parked) throw new Error(`Could not reschedule job ${job.id}: it no longer exists`);
        const { id: newJobId, run_at: runAt } = parked;
        const delayMs = runAt.getTime() - now;
        helpers.logger.debug(
          `Rescheduled job ${job.id} as ${newJobId} in ${delayMs}ms: lock ${lockKey} is held`,
        );
        ctx.emit("job:rescheduled", { taskIdentifier, lockKey, job, newJobId, runAt, delayMs });
        return;
      }
    }
  };

  const deferred = new DeferredCopies(ctx);
  const aborts = new LockedAborts();
  const holdTime = new HoldTime();
  const timed = options.onConflict === "reschedule";
  const listening = () => ctx.listening("lock:released");

  /** Runs the task while `hold` is held, then releases it. */
  const runHeld = async (hold: Hold, payload: unknown, helpers: JobHelpers) => {
    if (hold.info.reschedule) conflicts.clear(hold.info.wakeKey.toString());
    if (ctx.listening("lock:acquired"))
      ctx.emit("lock:acquired", { taskIdentifier, lockKey: hold.key, job: helpers.job });
    const measured = timed || listening();
    const started = measured ? performance.now() : 0;
    try {
      const value = await task(payload as TPayload, aborts.helpers(helpers, hold));
      // graphile-worker awaits an array of promises after the task returns; keep the lock until they settle.
      if (Array.isArray(value)) await Promise.allSettled(value);
      return value as ReturnType<Task>;
    } finally {
      // The unlock goes in the lock session's next statement; the job need not wait for it. Until it lands,
      // the key is still held (PostgreSQL enforces that, and this process counts it as held), so nothing
      // can overlap; a late unlock of a lost session is a no-op. (Waiting for it before returning, as
      // que-locks does, measured no better, at A1:20 of the latency section: 0.919 of plain graphile-worker
      // (median of ten runs) against 0.920 (five), and 0.011 behind que-locks rather than 0.003 ahead.)
      const heldMs = measured ? performance.now() - started : 0;
      if (timed) holdTime.record(heldMs);
      if (!listening()) hold.releaseQuietly();
      else {
        const job = helpers.job;
        void hold
          .release()
          .then(({ outcome }) =>
            ctx.emit("lock:released", { taskIdentifier, lockKey: hold.key, job, outcome, heldMs }),
          );
      }
    }
  };

  /**
   * Gives a job back to the queue without counting its attempt: its copy runs at `runAt`, or (`whenBack`)
   * when the session is back. A try whose answer did not come (the queue's database is out of reach, or the
   * connection died around the commit) may have given the job back all the same, so the job never runs
   * after one: the give-back is asked again (`defer_job` answers a job already given back with its copy)
   * until it is answered, or the worker aborts.
   */
  const defer = async (
    job: Job,
    helpers: JobHelpers,
    error: Error,
    whenBack: boolean,
  ): Promise<void> => {
    const runAt = new Date(Date.now() + Math.max(DEFER_MIN_MS, ctx.lockSessionWaitMs));
    let newJobId: string | null;
    ctx.outage.givingBack++;
    try {
      for (let tries = 1; ; tries++) {
        try {
          newJobId = await helpers.withPgClient(async (client) => {
            try {
              const { rows } = await client.query<{ id: string | null }>(ctx.sql.deferJob, [
                job.id,
                runAt.toISOString(),
                ctx.session.connection.pid,
              ]);
              return rows[0]?.id ?? null;
            } catch (error) {
              // (a connection in an uncertain state goes, rather than back to the pool)
              await (client as { end(): Promise<void> }).end().catch(() => undefined);
              throw error;
            }
          });
          break;
        } catch (deferError) {
          if (tries === 1) {
            helpers.logger.warn(
              `Could not give job ${job.id} back to the queue (trying again; the job does not run meanwhile): ${String(deferError)}`,
              { error: deferError },
            );
          }
          if (helpers.abortSignal?.aborted) throw deferError;
          await sleep(Math.min(DEFER_RETRY_MAX_MS, 50 * 2 ** tries), helpers.abortSignal);
        }
      }
    } finally {
      ctx.outage.givingBack--;
    }
    if (newJobId === null) throw new Error(`Could not defer job ${job.id}: it no longer exists`);
    helpers.logger.info(
      `Deferred job ${job.id} as ${newJobId} (no attempt counted): ${error.message}`,
    );
    ctx.emit("job:deferred", { taskIdentifier, job, newJobId, runAt, error });
    if (whenBack) deferred.add(newJobId, helpers);
  };

  /**
   * Takes the job's key, waiting out an unavailable lock session for up to `lockSessionWait`; null when the
   * job went back to the queue instead (it never runs unlocked, and an outage never costs it an attempt). A
   * job whose lock PostgreSQL could not take for want of lock memory goes back at once, to run again
   * `lockSessionWait` later: the session is up, so its copy is not made runnable early (it would only meet
   * the full table again).
   */
  const acquireThroughOutage = async (
    job: Job,
    helpers: JobHelpers,
    slots: bigint[],
  ): Promise<AcquireResult | null> => {
    const deadline = performance.now() + ctx.lockSessionWaitMs;
    for (;;) {
      try {
        return await ctx.session.acquire(slots, holdInfo(job, slots));
      } catch (error) {
        if (helpers.abortSignal?.aborted) throw error;
        if (isLockTableFull(error)) {
          await defer(job, helpers, error, false);
          return null;
        }
        if (!isSessionUnavailable(error)) throw error;
        const left = deadline - performance.now();
        if (left > 0) {
          ctx.outage.waitingForSession++;
          const ready = await ctx.session.connection
            .whenReady(left)
            .finally(() => ctx.outage.waitingForSession--);
          if (ready) continue;
        }
        await defer(job, helpers, error, true);
        return null;
      }
    }
  };

  const acquireAndRun = async (payload: unknown, helpers: JobHelpers) => {
    const { job } = helpers;
    const slots = keysOfJob(job);
    const result = await acquireThroughOutage(job, helpers, slots);
    if (result === null) return;
    if (!result.acquired) return onConflict(job, helpers, slots, result.local);
    return runHeld(result.hold, payload, helpers);
  };

  /**
   * Runs a job whose lock-ahead came back: with its lock, or trying again if the key was held then, or if
   * the lock went with its connection while the job waited in the local queue (it never runs unlocked).
   */
  const runPrefetched = (result: AcquireResult | null, payload: unknown, helpers: JobHelpers) =>
    result?.acquired && !result.hold.lost
      ? runHeld(result.hold, payload, helpers)
      : acquireAndRun(payload, helpers);

  const wrapped = (payload: unknown, helpers: JobHelpers): Promise<ReturnType<Task>> => {
    // With lock-ahead the key was derived (and usually taken) when the job was fetched.
    const prefetched = ctx.prefetched(helpers.job.id);
    if (!prefetched) return acquireAndRun(payload, helpers);
    if (prefetched.settled) return runPrefetched(prefetched.result, payload, helpers);
    return prefetched.promise.then((result) => runPrefetched(result, payload, helpers));
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
