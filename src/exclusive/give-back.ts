/**
 * Jobs given back to the queue through an outage of the lock session: a job waits out an unavailable
 * session for up to `lockSessionWait`, then goes back to the queue without counting its attempt (deferred:
 * `defer_job`), and its copy runs as soon as the session is back. It never runs unlocked, and an outage
 * never costs it an attempt.
 */
import { setTimeout as delay } from "node:timers/promises";
import type { Job, JobHelpers } from "graphile-worker";
import type { LocksContext } from "../context.js";
import { ErrorCodes } from "../errors.js";
import type { AcquireResult, HoldInfo, RateRide } from "../session/holds.js";

/** The shortest delay of a deferred job's copy: it runs as soon as the session is back anyway. */
const DEFER_MIN_MS = 1000;
/** The longest pause between two tries to give a job back whose first try went unanswered. */
const DEFER_RETRY_MAX_MS = 1000;

export function isSessionUnavailable(error: unknown): error is Error {
  return (
    error instanceof Error &&
    (error as { code?: unknown }).code === ErrorCodes.LOCK_SESSION_UNAVAILABLE
  );
}

/** PostgreSQL could not take the job's lock for want of resources (its lock table is full): session/book.ts. */
export function isLockTableFull(error: unknown): error is Error {
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
        const ready = await this.ctx.session.whenReady(
          Math.max(DEFER_MIN_MS, this.ctx.lockSessionWaitMs),
        );
        // A session closed or refused for good does not come back: the copies run at their `runAt`. (Its
        // `whenReady` answers at once then, so waiting again would never leave this loop.)
        const { state } = this.ctx.session;
        if (state === "closed" || state === "refused") return;
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

/** The give-back of one task's jobs. */
export class GiveBack {
  private readonly deferred: DeferredCopies;

  constructor(
    private readonly ctx: LocksContext,
    private readonly taskIdentifier: string,
  ) {
    this.deferred = new DeferredCopies(ctx);
  }

  /**
   * Takes the job's key, waiting out an unavailable lock session for up to `lockSessionWait`; null when the
   * job went back to the queue instead (it never runs unlocked, and an outage never costs it an attempt). A
   * job whose lock PostgreSQL could not take for want of lock memory goes back at once, to run again
   * `lockSessionWait` later: the session is up, so its copy is not made runnable early (it would only meet
   * the full table again).
   */
  async acquire(
    job: Job,
    helpers: JobHelpers,
    slots: bigint[],
    holdInfo: (job: Job, slots: readonly bigint[]) => HoldInfo,
    limits?: ReadonlyArray<readonly bigint[]>,
    ride?: RateRide,
  ): Promise<AcquireResult | null> {
    const { ctx } = this;
    const deadline = performance.now() + ctx.lockSessionWaitMs;
    for (;;) {
      try {
        return await ctx.session.acquire(slots, holdInfo(job, slots), limits, ride);
      } catch (error) {
        if (helpers.abortSignal?.aborted) throw error;
        if (isLockTableFull(error)) {
          await this.defer(job, helpers, error, false);
          return null;
        }
        if (!isSessionUnavailable(error)) throw error;
        const left = deadline - performance.now();
        if (left > 0) {
          ctx.outage.waitingForSession++;
          const ready = await ctx.session
            .whenReady(left)
            .finally(() => ctx.outage.waitingForSession--);
          if (ready) continue;
        }
        await this.defer(job, helpers, error, true);
        return null;
      }
    }
  }

  /**
   * Gives a job back to the queue without counting its attempt: its copy runs at `runAt`, or (`whenBack`)
   * when the session is back. A try whose answer did not come (the queue's database is out of reach, or the
   * connection died around the commit) may have given the job back all the same, so the job never runs
   * after one: the give-back is asked again (`defer_job` answers a job already given back with its copy)
   * until it is answered, or the worker aborts.
   */
  private async defer(
    job: Job,
    helpers: JobHelpers,
    error: Error,
    whenBack: boolean,
  ): Promise<void> {
    const { ctx, taskIdentifier } = this;
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
                ctx.session.pid,
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
          // (a worker that aborts meanwhile stops asking: the job fails with the give-back's error)
          await delay(Math.min(DEFER_RETRY_MAX_MS, 50 * 2 ** tries), undefined, {
            signal: ctx.aborts.workerSignal(helpers),
          }).catch(() => {
            throw deferError;
          });
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
    if (whenBack) this.deferred.add(newJobId, helpers);
  }
}
