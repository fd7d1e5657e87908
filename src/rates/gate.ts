/**
 * The start of a job of a task with a `rate` or `pausable: true`, and the snooze and pause a task throws.
 * Each is one statement on graphile-worker's connection (`helpers.withPgClient`): the start's statement
 * (rate_admit, sql/000011.sql, which decides as rate_start in sql/000004.sql when the key is not simply
 * below its rate) admits the job or gives it back to the queue in the same transaction, so a job over its
 * rate or under a pause costs one round trip either way. A job whose rate rides in its lock statement
 * (`ride`, lock_rated in sql/000012.sql) sends none when its key is below its rate.
 */
import { setTimeout as delay } from "node:timers/promises";
import type { Job, JobHelpers } from "graphile-worker";
import type { LocksContext } from "../context.js";
import { NotPausableError, PauseError, SnoozeError, type PauseScope } from "../errors.js";
import type { ResolvedExclusiveOptions } from "../options.js";
import type { RateRide, RodeStart } from "../session/holds.js";
import type { RateKey } from "./options.js";
import type { RateStatements } from "./statements.js";
import { RESERVED_FLAG, Turns } from "./turns.js";

/** The keys of one job as the gate sees them. */
export interface GateKeys {
  /** Its rate key, when the task has a rate. */
  rate: RateKey | null;
  /** Its lock key (slot 0 of its key), which a pause of scope "key" stops. */
  lockKey: bigint;
  /** The readable material of its lock key's value (named in `status`). */
  lockMaterial: () => string;
}

interface StartRow {
  admitted: boolean;
  at: Date;
  /** `at` in microseconds since the epoch (a Date holds milliseconds): what a refund names. */
  at_us: string;
  copy_id: string | null;
  reason: "rate" | "paused" | "wait" | "free" | null;
  now: Date;
}

/**
 * A job whose slot is at most this near waits for it in its worker, holding its reservation, rather than
 * going back to the queue (one more statement instead of one more fetch).
 */
const RATE_WAIT_MS = 250;
/**
 * A job that comes for its reserved slot and finds it later than planned (the jobs before it started late)
 * waits this long for it before it goes back to the queue again.
 */
const RATE_WAIT_RESERVED_MS = 1000;
/** A job given back over its rate becomes runnable this much before its slot, and waits for it as above. */
export const RATE_LEAD_MS = 20;
/**
 * A job waiting for its reserved slot asks again this much ahead of it, and the start statement holds it
 * until the slot, on the key's row: so it starts at its slot even when the statement is slow to get there.
 */
const RATE_HOLD_MS = 250;
/**
 * The process that gave a copy back wakes it this much before its slot: a busy server's statements and a
 * worker's fetch then happen before the slot, and the copy waits for it in its worker (a copy with an
 * execution lock waits before it takes its lock: see `admit`'s probe).
 */
export const RATE_WAKE_AHEAD_MS = 500;
/**
 * A copy whose slot, planned again when its process wakes it (the jobs ahead of it started later than
 * planned), is further away than this is not woken: its run_at moves to its new slot, and it is woken
 * `RATE_WAKE_AHEAD_MS` ahead of that (wakes.ts, wake_reserved_planned in sql/000010.sql).
 */
export const RATE_WAKE_DEFER_MS = RATE_WAKE_AHEAD_MS + 250;

/**
 * Runs statement `text` (called `name`) on the job's pool connection, prepared there unless prepared
 * statements are off (ctx.poolQuery: a call of a function of many parameters costs more to parse and plan
 * than to run; bench/README.md, "Rates"). A connection whose state is uncertain is ended.
 */
async function query<T>(
  ctx: LocksContext,
  helpers: JobHelpers,
  name: string,
  text: string,
  values: unknown[],
): Promise<T | undefined> {
  return helpers.withPgClient(async (client) => {
    try {
      const { rows } = await ctx.poolQuery<T & Record<string, unknown>>(client, name, text, values);
      return rows[0];
    } catch (error) {
      await (client as { end(): Promise<void> }).end().catch(() => undefined);
      throw error;
    }
  });
}

/** Tells `rate:admitted` listeners that `job` started at `at` under its rate key. */
function emitAdmitted(
  ctx: LocksContext,
  taskIdentifier: string,
  rateKey: RateKey,
  job: Job,
  at: Date,
) {
  if (ctx.listening("rate:admitted"))
    ctx.emit("rate:admitted", { taskIdentifier, rateKey: rateKey.key, job, at });
}

/**
 * A start counted by the probe of a job with a lock and a rate (its key was at most half used): the job
 * starts once it holds its lock (`confirm`), or, if it does not start (it met its lock held, or ended
 * before its task was called), its start is taken back (`refund`).
 */
export class CountedStart {
  private settled = false;

  constructor(
    private readonly ctx: LocksContext,
    private readonly taskIdentifier: string,
    private readonly job: Job,
    private readonly rateKey: RateKey,
    private readonly at: Date,
    private readonly atUs: string,
  ) {}

  /** The job's task is about to be called: the start stands. */
  confirm(): void {
    if (this.settled) return;
    this.settled = true;
    emitAdmitted(this.ctx, this.taskIdentifier, this.rateKey, this.job, this.at);
  }

  /**
   * The job did not start: its start leaves the log. A refund that fails leaves the start counted (the key
   * then admits one start fewer in that period), logged.
   */
  async refund(helpers: JobHelpers): Promise<void> {
    if (this.settled) return;
    this.settled = true;
    try {
      await query(this.ctx, helpers, "rate_refund", this.ctx.sql.rates.rateRefund, [
        this.rateKey.key.toString(),
        this.atUs,
      ]);
    } catch (error) {
      helpers.logger.warn(
        `Could not take back the start of job ${this.job.id}, which did not start (it stays counted): ${String(error)}`,
      );
    }
  }
}

/** How many keys `RateGate.throttled` remembers before it forgets them all. */
const THROTTLED_KEYS_MAX = 10_000;

export class RateGate {
  private readonly sql: RateStatements;
  private readonly turns = new Turns();
  /**
   * Rate keys that refused a job of this process lately, with the time (performance.now) until which their
   * jobs ask the rate before they take their lock, rather than in their lock statement (`ride`): such a key
   * would mostly answer that the rate must decide first, a lock statement spent for nothing.
   */
  private readonly throttled = new Map<string, number>();

  constructor(
    private readonly ctx: LocksContext,
    private readonly taskIdentifier: string,
    private readonly options: ResolvedExclusiveOptions<never>,
  ) {
    this.sql = ctx.sql.rates;
  }

  /** Whether the task's starts go through the gate at all. */
  static needed(options: ResolvedExclusiveOptions<never>): boolean {
    return options.rate !== null || options.pausable;
  }

  /**
   * The rate to ask in the job's lock statement (lock_rated, sql/000012.sql), or null when the job asks it
   * first (probe): a copy that comes for a reserved slot, or a job of a key that refused one lately.
   */
  ride(job: Job, keys: GateKeys): RateRide | null {
    const rate = this.options.rate;
    if (!rate || !keys.rate) return null;
    if ((job.flags as Record<string, unknown> | null)?.[RESERVED_FLAG]) return null;
    const key = keys.rate.key.toString();
    const until = this.throttled.get(key);
    if (until !== undefined) {
      if (performance.now() < until) return null;
      this.throttled.delete(key);
    }
    return {
      rateKey: key,
      label: keys.rate.material,
      limit: rate.limit,
      periodMs: rate.period,
      burst: rate.burst,
      pauseKeys: this.pauseKeys(keys),
    };
  }

  /**
   * The rate key of `keys` refused a job now, or a `reschedule` job met its key held: its next jobs ask it
   * first for a period (`ride`).
   */
  refused(keys: GateKeys): void {
    const rate = this.options.rate;
    if (!rate || !keys.rate) return;
    if (this.throttled.size >= THROTTLED_KEYS_MAX) this.throttled.clear();
    this.throttled.set(keys.rate.key.toString(), performance.now() + rate.period);
  }

  /** A start the job's lock statement counted with its key (`ride`). */
  counted(job: Job, keys: GateKeys, start: RodeStart): CountedStart {
    return new CountedStart(this.ctx, this.taskIdentifier, job, keys.rate!, start.at, start.atUs);
  }

  /** The keys whose pause stops this job. */
  private pauseKeys(keys: GateKeys): string[] {
    if (!this.options.pausable) return [];
    return keys.rate
      ? [keys.rate.key.toString(), keys.lockKey.toString()]
      : [keys.lockKey.toString()];
  }

  /**
   * Whether `job` starts now. If not, it has been given back to the queue (its copy runs when its slot frees
   * or its key's pause ends; no attempt counted) and the task must return without running.
   *
   * `probe`: the job has not taken its execution lock yet. It is given back, or waits for a near slot, as
   * above. Where it would start, and its key is at most half used (sql/000011.sql), its start is counted
   * and answered as a `CountedStart`: the job takes its lock, then confirms it, or refunds it if it does not
   * start. Otherwise it is only answered true and nothing is counted: it takes its lock and is admitted for
   * real. So a job the rate refuses never holds its key's lock, which the job whose slot has come would
   * meet (and park behind).
   */
  async admit(
    job: Job,
    helpers: JobHelpers,
    keys: GateKeys,
    probe = false,
  ): Promise<boolean | CountedStart> {
    const { ctx, taskIdentifier } = this;
    const rate = this.options.rate;
    // A job of a task with a lock and a rate probed before it took its lock (exclusive.ts), and holds it.
    const probed = !probe && this.options.lock && rate !== null;
    const reserved = Boolean((job.flags as Record<string, unknown> | null)?.[RESERVED_FLAG]);
    // Only a job that may come for a near reserved slot has its statement wait for the slot (p_hold); the
    // others' statements take the key's row at once.
    const values = (waited: boolean) => [
      job.id,
      keys.rate?.key.toString() ?? null,
      keys.rate?.material ?? null,
      rate?.limit ?? null,
      rate ? `${rate.period} milliseconds` : null,
      rate?.burst ?? null,
      this.pauseKeys(keys),
      ctx.session.pid,
      `${RATE_WAIT_MS} milliseconds`,
      `${RATE_WAIT_RESERVED_MS} milliseconds`,
      `${RATE_LEAD_MS} milliseconds`,
      `${reserved || waited ? RATE_HOLD_MS : 0} milliseconds`,
      probe,
      probed,
    ];
    const turn = keys.rate?.key.toString();
    // A fresh job takes its turn at its key (turns.ts); a job that comes for its reserved slot, or asks
    // again for a near one, goes straight to the database: its statement may wait there for its slot, and
    // must not hold up the process's other jobs of the key meanwhile. So does a job that probed and holds
    // its lock: its slot has come, and the key's next job must not meet its lock.
    let waited = false;
    for (;;) {
      const admit = () =>
        query<StartRow>(ctx, helpers, "rate_admit", this.sql.rateAdmit, values(waited));
      const row = await (turn === undefined || reserved || waited || probed
        ? admit()
        : this.turns.run(turn, reserved, admit));
      if (!row) throw new Error(`The start of job ${job.id} was not answered`);
      if (row.reason === "free") return true;
      if (row.admitted && probe && keys.rate)
        return new CountedStart(ctx, taskIdentifier, job, keys.rate, row.at, row.at_us);
      if (row.admitted) {
        if (keys.rate) emitAdmitted(ctx, taskIdentifier, keys.rate, job, row.at);
        return true;
      }
      const delayMs = row.at.getTime() - row.now.getTime();
      if (row.reason === "wait") {
        // Its slot is near: wait here, holding its reservation, and ask again a little ahead of it.
        waited = true;
        await delay(Math.max(0, delayMs - RATE_HOLD_MS), undefined, {
          signal: this.ctx.aborts.workerSignal(helpers),
        });
        continue;
      }
      if (row.copy_id === null)
        throw new Error(`Could not give job ${job.id} back: it no longer exists`);
      if (row.reason === "rate") ctx.wakeIn(delayMs - RATE_WAKE_AHEAD_MS, row.copy_id);
      else ctx.wakeIn(delayMs);
      this.refused(keys);
      helpers.logger.debug(
        `Job ${job.id} ${row.reason === "paused" ? "meets a paused key" : "is over its rate"}: its copy ${row.copy_id} runs at ${row.at.toISOString()}`,
      );
      ctx.emit("job:throttled", {
        taskIdentifier,
        job,
        reason: row.reason === "paused" ? "paused" : "rate",
        newJobId: row.copy_id,
        runAt: row.at,
      });
      return false;
    }
  }

  /**
   * Carries out a `SnoozeError` or `PauseError` thrown by the task (true), or leaves any other error to
   * graphile-worker (false). A `PauseError` of a task that cannot pause fails the job with a
   * `NotPausableError`.
   */
  async thrown(error: unknown, job: Job, helpers: JobHelpers, keys: GateKeys): Promise<boolean> {
    const { ctx, taskIdentifier } = this;
    if (error instanceof SnoozeError) {
      const row = await query<{ copy_id: string | null; run_at: Date; now: Date }>(
        ctx,
        helpers,
        "snooze",
        this.sql.snooze,
        [job.id, `${error.ms} milliseconds`, ctx.session.pid],
      );
      if (!row?.copy_id) throw new Error(`Could not snooze job ${job.id}: it no longer exists`);
      ctx.wakeIn(row.run_at.getTime() - row.now.getTime());
      helpers.logger.debug(
        `Snoozed job ${job.id}: its copy ${row.copy_id} runs at ${row.run_at.toISOString()}`,
      );
      ctx.emit("job:snoozed", { taskIdentifier, job, newJobId: row.copy_id, runAt: row.run_at });
      return true;
    }
    if (!(error instanceof PauseError)) return false;
    if (!this.options.pausable) {
      throw new NotPausableError(
        taskIdentifier,
        "the task can pause only with a `rate` or `pausable: true` (its starts check for a pause then)",
        { cause: error },
      );
    }
    const scope: PauseScope = error.scope ?? (keys.rate ? "rate" : "key");
    if (scope === "rate" && !keys.rate) {
      throw new NotPausableError(taskIdentifier, 'it has no `rate` to pause (`scope: "rate"`)', {
        cause: error,
      });
    }
    const pauseKey = scope === "rate" ? keys.rate!.key : keys.lockKey;
    const label = scope === "rate" ? keys.rate!.material : keys.lockMaterial();
    const row = await query<{ copy_id: string | null; until: Date; now: Date }>(
      ctx,
      helpers,
      "pause",
      this.sql.pause,
      [job.id, pauseKey.toString(), label, `${error.ms} milliseconds`, ctx.session.pid],
    );
    if (!row?.copy_id) throw new Error(`Could not pause job ${job.id}: it no longer exists`);
    ctx.wakeIn(row.until.getTime() - row.now.getTime());
    helpers.logger.info(
      `Job ${job.id} paused ${label} until ${row.until.toISOString()}; its copy ${row.copy_id} runs then`,
    );
    ctx.emit("job:paused", {
      taskIdentifier,
      job,
      pauseKey,
      scope,
      newJobId: row.copy_id,
      until: row.until,
    });
    return true;
  }
}
