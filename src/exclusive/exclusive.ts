/**
 * The task wrapper: takes the job's key on the lock session before the task runs and releases it after,
 * and applies the conflict strategy when the key is held. A task with a `rate` or a pause has its start
 * checked too (rates/gate.ts; with `lock: false`, only that; with a lock and a rate, the job asks the rate
 * before it takes its key, or in the same statement: `probeAndRun`, `rideAndRun`), and a snooze or pause it
 * throws is carried out.
 */
import type { Job, JobHelpers, Task } from "graphile-worker";
import { LockConflictError, SupersededError } from "../errors.js";
import type { LocksContext } from "../context.js";
import type { AcquireResult, Hold, HoldInfo } from "../session/holds.js";
import { jobLimitKeys, jobLockKeys, lockKeyMaterial, lockKeyValue } from "../key.js";
import { RateGate, type CountedStart, type GateKeys } from "../rates/gate.js";
import { rateKeyOf } from "../rates/options.js";
import { GiveBack } from "./give-back.js";
import { ConflictCounter, HoldTime } from "./hold-time.js";
import type { AddJobSpec, ResolvedExclusiveOptions } from "../options.js";
import type { ExclusiveTask } from "../types.js";

/** An exclusive task as this library sees it: the public task, and how lock-ahead locks its jobs. */
export interface ExclusiveTaskImpl<TPayload = unknown> extends ExclusiveTask<TPayload> {
  /** How lock-ahead locks a fetched job of this task. */
  readonly lockPlan: (job: Job) => LockPlan;
  /** Whether a job of this task fetched in a batch waits in its key's line when it meets the key held. */
  readonly waitsInLine: boolean;
}

/**
 * How a job takes its lock: its slots and hold info, and for a job with several limits each limit's slots
 * (`slots` are then each limit's slot 0, its line).
 */
interface LockPlan {
  slots: bigint[];
  info: HoldInfo;
  limits?: bigint[][];
}

/**
 * How long a finished job waits, at most, for the answer that starts the job of this process it hands its key
 * or slot to (`Hold.handsOffHere`). It returns to graphile-worker after that answer, so that its completion
 * and its worker's next fetch do not compete for the server and the event loop with the hand-off's
 * statement (figures: bench/README.md, section "A finished job behind its hand-off"). The bound only
 * matters on a stalled connection, whose loss answers the release.
 */
const HAND_OFF_WAIT_MAX_MS = 1000;

/**
 * How long a job fetched in a batch that met its key held waits at its worker, in its key's line, for the
 * key (`waitInLine`), before it parks like any other job: also the most it keeps its worker from the other
 * jobs of its local queue. Long enough for a batch of another process's jobs of the key, fetched before it,
 * to go first (figures: bench/README.md, section "A hot key in a local queue, waiting in line").
 */
const LINE_WAIT_MS = 1000;

/** Resolves with `hold`'s release answer, or after HAND_OFF_WAIT_MAX_MS. */
function handOffAnswered(hold: Hold): Promise<unknown> {
  let timer: NodeJS.Timeout | undefined;
  return Promise.race([
    hold.release(),
    new Promise((resolve) => (timer = setTimeout(resolve, HAND_OFF_WAIT_MAX_MS))),
  ]).finally(() => clearTimeout(timer));
}

/** The answer of a job whose hold was lost before its task started: it did not run. */
const LOST_BEFORE_START: unique symbol = Symbol("lost before start");

export function makeExclusiveTask<TPayload>(
  ctx: LocksContext,
  taskIdentifier: string,
  task: (payload: TPayload, helpers: JobHelpers) => unknown,
  options: ResolvedExclusiveOptions<TPayload>,
): ExclusiveTask<TPayload> {
  const conflicts = new ConflictCounter();
  // A payload from the caller is checked; a payload read back from PostgreSQL's JSON is JSON-safe by
  // construction (trusted). A key function that throws on it fails the job (graphile-worker retries it) with
  // an error naming the job, task and function.
  const keysOf = (payload: TPayload) => jobLockKeys(taskIdentifier, options, payload);
  const keysOfJob = (job: Job) => jobLockKeys(taskIdentifier, options, job.payload, job.id, true);
  // Keys that other tasks may share (a group): their lines may hold `reschedule` jobs of those tasks, which
  // the release wakes whatever this task's strategy.
  const shared =
    options.lockGroup !== undefined ||
    (options.limits?.some((l) => l.group !== undefined) ?? false);
  const holdInfo = (job: Job, slots: readonly bigint[]): HoldInfo =>
    options.onConflict !== "reschedule"
      ? shared
        ? { taskIdentifier, jobId: job.id, reschedule: false, wakeKeys: [slots[0]!] }
        : { taskIdentifier, jobId: job.id, reschedule: false }
      : {
          taskIdentifier,
          jobId: job.id,
          reschedule: true,
          wakeKey: slots[0]!,
          // Early wakes for single keys (a semaphore's next job may find any of its slots free).
          prewakeAfterMs: slots.length === 1 ? holdTime.prewakeAfterMs() : null,
          releaseWaitMs: holdTime.releaseWaitMs(),
        };

  // Of a job with several limits, the limits whose keys other tasks may share (a limit's group defaults to the
  // task's lockGroup, filled in by the options). A limit of this task's own key space has no line to wake
  // unless this task parks jobs in it, as for a task of one key.
  const sharedLimits = options.limits?.map((limit) => limit.group !== undefined) ?? [];

  /** The hold info of a job with several limits, whose lines are `lines` (each limit's slot 0). */
  const stackedInfo = (job: Job, lines: readonly bigint[]): HoldInfo =>
    options.onConflict !== "reschedule"
      ? {
          taskIdentifier,
          jobId: job.id,
          reschedule: false,
          wakeKeys: shared ? lines.filter((_, i) => sharedLimits[i]) : undefined,
        }
      : {
          taskIdentifier,
          jobId: job.id,
          reschedule: true,
          wakeKey: lines[0]!,
          wakeKeys: lines,
          // (no early wake: the job woken must find every limit free, not only the one it waited for)
          prewakeAfterMs: null,
          releaseWaitMs: holdTime.releaseWaitMs(),
        };

  const planOf = (job: Job): LockPlan => {
    if (!options.limits) {
      const slots = keysOfJob(job);
      return { slots, info: holdInfo(job, slots) };
    }
    const limits = jobLimitKeys(taskIdentifier, options, job.payload, job.id, true).map(
      (l) => l.slots,
    );
    const lines = limits.map((slots) => slots[0]!);
    return { slots: lines, info: stackedInfo(job, lines), limits };
  };

  /** `others`: for a job with several limits, every limit's slots (their lines are woken when free). */
  const onConflict = async (
    job: Job,
    helpers: JobHelpers,
    slots: readonly bigint[],
    local: boolean,
    others?: readonly (readonly bigint[])[],
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
        // A job fetched before a newer job of its key superseded it does not park ahead of that job.
        const by = ctx.session.supersededBy(lockKey, job.id);
        if (by !== null) {
          return ended(
            new SupersededError(taskIdentifier, lockKey, job.id, by),
            job,
            helpers,
            "starting",
          );
        }
        const { minDelay, maxDelay, jitter } = options.reschedule;
        const n = conflicts.next(lockKey.toString());
        const base = Math.min(maxDelay, minDelay * 2 ** Math.min(n, 30));
        const now = Date.now();
        const earliest = new Date(now + Math.round(base * (1 - jitter * Math.random())));
        // The safety net is later for a job further back in line (see park_job in sql/000001.sql).
        const latest = new Date(now + maxDelay);
        const parked = await helpers.withPgClient(async (client) => {
          const { rows } = await ctx.poolQuery<{ id: string; run_at: Date }>(
            client,
            "park_job",
            ctx.sql.parkJob,
            [
              job.id,
              earliest.toISOString(),
              lockKey.toString(),
              holdTime.estimateMs(),
              latest.toISOString(),
              ctx.session.pid,
            ],
          );
          const row = rows[0];
          // The holder may have released between our attempt and the park's commit: then wake it now. The
          // park has committed, so this is best effort: should it fail, the copy's safety net still runs it,
          // and the job must not fail (its row gave up its retries, and would stay behind as a failed job).
          if (row) {
            try {
              await ctx.poolQuery(client, "wake_if_free", ctx.sql.wakeIfFree, [
                slots.map(String),
                lockKey.toString(),
                job.id,
              ]);
              // With several limits, a job woken from the line of one limit that parks in the line of
              // another passes that wake on: each other limit with a free slot wakes its next waiter.
              for (const other of others ?? []) {
                if (other[0] === lockKey) continue;
                await ctx.poolQuery(client, "wake_if_free", ctx.sql.wakeIfFree, [
                  other.map(String),
                  other[0]!.toString(),
                  job.id,
                ]);
              }
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

  const giveBack = new GiveBack(ctx, taskIdentifier);
  // Starts through the gate (a rate, a pause); a snooze or pause the task throws is carried out there too.
  const gate = new RateGate(ctx, taskIdentifier, options as ResolvedExclusiveOptions<never>);
  const gated = RateGate.needed(options as ResolvedExclusiveOptions<never>);
  /** `lockKey`: the job's slot 0, when the caller has its slots already. */
  const gateKeys = (job: Job, lockKey = keysOfJob(job)[0]!): GateKeys => {
    const value = () => lockKeyValue(taskIdentifier, options, job.payload, job.id, true);
    return {
      rate: options.rate
        ? rateKeyOf(taskIdentifier, options.rate, job.payload, value, job.id)
        : null,
      lockKey,
      lockMaterial: () => lockKeyMaterial(options.lockGroup ?? taskIdentifier, value(), null),
    };
  };

  /**
   * Runs the task (admitted by the gate first, when the task has one and its probe did not count its start,
   * `counted`; a job it refuses has gone back to the queue), and carries out a snooze or pause it throws. A job whose `hold` was lost before its task started
   * (the lock session died after it took the key) does not start: LOST_BEFORE_START.
   */
  const runTask = async (
    payload: unknown,
    helpers: JobHelpers,
    taskHelpers: JobHelpers,
    hold?: Hold,
    counted?: CountedStart,
  ): Promise<unknown> => {
    const { job } = helpers;
    let keys: GateKeys | undefined;
    const keysOf = () => (keys ??= gateKeys(job));
    if (hold?.lost) return LOST_BEFORE_START;
    if (gated && !counted) {
      if (!(await gate.admit(job, helpers, keysOf()))) return;
      // (the session may have been lost while the gate answered)
      if (hold?.lost) return LOST_BEFORE_START;
    }
    counted?.confirm();
    try {
      const value = await task(payload as TPayload, taskHelpers);
      // graphile-worker awaits an array of promises after the task returns; keep the lock until they settle.
      if (Array.isArray(value)) await Promise.allSettled(value);
      return value as ReturnType<Task>;
    } catch (error) {
      if (await gate.thrown(error, job, helpers, keysOf())) return;
      throw error;
    }
  };
  const { aborts } = ctx;
  const holdTime = new HoldTime();
  const timed = options.onConflict === "reschedule";
  const listening = () => ctx.listening("lock:released");

  /**
   * A superseded job ends as completed, whatever its task did: an info log and `job:superseded`. Its key is
   * released by the caller, after this.
   */
  const ended = (
    reason: SupersededError,
    job: Job,
    helpers: JobHelpers,
    state: "running" | "starting",
  ): undefined => {
    helpers.logger.info(
      `Job ${job.id} was superseded by job ${reason.byJobId} of lock ${reason.lockKey}${state === "running" ? "" : " before it started"}; it ends as completed`,
    );
    ctx.emit("job:superseded", {
      taskIdentifier,
      lockKey: reason.lockKey,
      jobId: job.id,
      byJobId: reason.byJobId,
      state,
      job,
    });
    return undefined;
  };

  /**
   * Runs the task while `hold` is held, then releases it. A job of a `reschedule` task superseded meanwhile
   * (its signal aborted) ends as completed whether its task returned or threw; one superseded while it was
   * on its way to the key ends without running.
   */
  const runHeld = async (
    hold: Hold,
    payload: unknown,
    helpers: JobHelpers,
    counted?: CountedStart,
  ) => {
    const { info } = hold;
    if (info.reschedule) {
      if (info.wakeKeys) for (const key of info.wakeKeys) conflicts.clear(key.toString());
      else conflicts.clear(info.wakeKey.toString());
    }
    if (ctx.listening("lock:acquired"))
      ctx.emit("lock:acquired", { taskIdentifier, lockKey: hold.key, job: helpers.job });
    const measured = timed || listening();
    const started = measured ? performance.now() : 0;
    // (a job that ends without running says nothing of how long the task's jobs hold their key)
    let ran = true;
    try {
      if (info.reschedule) {
        const by = ctx.session.supersededBy(info.wakeKey, helpers.job.id);
        if (by !== null) {
          ran = false;
          const reason = new SupersededError(taskIdentifier, info.wakeKey, helpers.job.id, by);
          return ended(reason, helpers.job, helpers, "starting");
        }
      }
      let value: unknown;
      try {
        value = await runTask(payload, helpers, aborts.helpers(helpers, hold), hold, counted);
      } catch (error) {
        if (!hold.supersededBy) throw error;
      }
      if (value === LOST_BEFORE_START) {
        // Its abort would have come before the task could listen for it: the task never starts on a key
        // PostgreSQL has already freed. The job takes its key again, on the session that replaces the lost
        // one.
        ran = false;
        helpers.logger.info(
          `Job ${helpers.job.id} did not start: its lock session was lost after it took lock ${hold.key}; it takes its key again`,
        );
        return acquireAndRun(payload, helpers, counted);
      }
      if (hold.supersededBy) return ended(hold.supersededBy, helpers.job, helpers, "running");
      return value as ReturnType<Task>;
    } finally {
      if (info.reschedule) aborts.done(hold);
      // The unlock goes in the lock session's next statement; the job need not wait for it. Until it lands,
      // the key is still held (PostgreSQL enforces that, and this process counts it as held), so nothing
      // can overlap; a late unlock of a lost session is a no-op. (Waiting for it before returning, as
      // que-locks does, is no faster: see bench/README.md, section "Unlock without waiting".) A job that
      // hands its key or slot to a job waiting here waits for that answer (handOffAnswered).
      const heldMs = measured ? performance.now() - started : 0;
      if (timed && ran) holdTime.record(heldMs);
      if (!listening()) hold.releaseQuietly();
      else {
        const job = helpers.job;
        void hold
          .release()
          .then(({ outcome }) =>
            ctx.emit("lock:released", { taskIdentifier, lockKey: hold.key, job, outcome, heldMs }),
          );
      }
      if (hold.handsOffHere) await handOffAnswered(hold);
    }
  };

  const acquireAndRun = async (
    payload: unknown,
    helpers: JobHelpers,
    counted?: CountedStart,
    fetchedAhead = false,
  ): Promise<ReturnType<Task>> => {
    const { job } = helpers;
    if (options.limits) {
      // Several limits: the conflict strategy applies to the limit that was full (its slots, its line).
      const plan = planOf(job);
      const result = await giveBack.acquire(job, helpers, plan.slots, () => plan.info, plan.limits);
      if (result === null) return;
      if (!result.acquired)
        return onConflict(job, helpers, plan.limits![result.full ?? 0]!, result.local, plan.limits);
      return runHeld(result.hold, payload, helpers, counted);
    }
    const slots = keysOfJob(job);
    const result = await giveBack.acquire(job, helpers, slots, holdInfo);
    if (result === null) return;
    if (!result.acquired) {
      if (fetchedAhead && waitsInLine && slots.length === 1) {
        const waited = await waitInLine(job, helpers, slots);
        if (waited !== null && waited !== "timeout" && waited.acquired)
          return runHeld(waited.hold, payload, helpers, counted);
        const parked = await onConflict(job, helpers, slots, result.local);
        // (a job that waited its time out parked ahead of those behind it, which look at their line again)
        if (waited === "timeout") await lineChanged(helpers, slots[0]!);
        return parked;
      }
      return onConflict(job, helpers, slots, result.local);
    }
    return runHeld(result.hold, payload, helpers, counted);
  };

  /**
   * A job fetched in a batch of a local queue that met its key held waits at its worker with its place in
   * the key's line (join_line, sql/000014.sql), for at most LINE_WAIT_MS, rather than go back to the queue
   * and be fetched again: it tries the key whenever a release names it, or takes it in memory from a hold of
   * this process that woke it early. It does not wait where a job ahead of it in line is not fetched (that
   * job needs a worker), and looks again when a job ahead parks. Its hold, or null when it parks at once, or
   * "timeout" (it parks then, and those behind it look at their line again: `lineChanged`).
   */
  const waitInLine = async (job: Job, helpers: JobHelpers, slots: readonly bigint[]) => {
    const info = holdInfo(job, slots);
    if (!info.reschedule) return null;
    if (ctx.session.supersededBy(slots[0]!, job.id) !== null) return null;
    const waiter = ctx.session.lineWaiter(slots[0]!.toString(), job.id);
    const until = performance.now() + LINE_WAIT_MS;
    try {
      for (let first = true; ; first = false) {
        if (!first && performance.now() >= until) return "timeout";
        const ahead = await helpers.withPgClient(async (client) => {
          const { rows } = await ctx.poolQuery<{ ahead: number }>(
            client,
            "join_line",
            ctx.sql.joinLine,
            [slots[0]!.toString(), job.id, slots.map(String)],
          );
          return rows[0]?.ahead ?? 0;
        });
        if (ahead === -2) return null;
        const result = await ctx.session.waitInLine(waiter, slots, info, until, ahead === -1);
        if (result !== "recheck") return result;
      }
    } catch {
      return null;
    } finally {
      waiter.close();
    }
  };

  /** Tells the jobs waiting in `key`'s line at their workers, in every process, to look at it again. */
  const lineChanged = async (helpers: JobHelpers, key: bigint) => {
    try {
      await helpers.withPgClient((client) =>
        ctx.poolQuery(client, "line_changed", ctx.sql.lineChanged, [key.toString()]),
      );
    } catch {
      // (they look again when their own time is out)
    }
  };

  /**
   * Runs a job whose lock-ahead came back: with its lock, or trying again if the key was held then, or if
   * the lock went with its connection while the job waited in the local queue (it never runs unlocked).
   */
  const runLockedAhead = (result: AcquireResult | null, payload: unknown, helpers: JobHelpers) =>
    result?.acquired && !result.hold.lost
      ? runHeld(result.hold, payload, helpers)
      : acquireAndRun(payload, helpers, undefined, true);

  /**
   * A job of a task with a lock and a rate asks the rate first (a probe), and takes its lock only when its
   * slot has come. Where its key is at most half used, the probe counted its start: the job starts once it
   * holds its lock, and if it does not start (it met its lock held, or ended before its task was called),
   * its start is taken back. Otherwise the probe counted nothing, and the job is admitted for real once it
   * holds its lock (runTask). A job the rate refuses goes back to the queue, or waits for its near slot,
   * without ever holding its key.
   */
  const probeAndRun = async (payload: unknown, helpers: JobHelpers) => {
    const answer = await gate.admit(helpers.job, helpers, gateKeys(helpers.job), true);
    if (answer === false) return;
    if (answer === true) return acquireAndRun(payload, helpers);
    try {
      return await acquireAndRun(payload, helpers, answer);
    } finally {
      await answer.refund(helpers);
    }
  };
  const probed = options.lock && options.rate !== null;
  // A job of a single key (not a semaphore, no limits, no rate or pause) fetched in a batch waits in its key's
  // line at its worker when it meets the key held (`waitInLine`; a `limit` given as a function is decided by
  // the job's slots).
  const waitsInLine =
    options.lock &&
    options.onConflict === "reschedule" &&
    !options.limits &&
    (typeof options.limit === "function" || options.limit === 1) &&
    !gated;
  // A job of such a task with one slot and one limit asks its rate in its lock statement instead (lock_rated,
  // sql/000012.sql and 000013.sql): no round trip of its own.
  const rides = probed && !options.limits;

  /**
   * A job whose rate rides in its lock statement: where the rate lets it start now, it takes its key and its
   * start is counted there (and taken back if it does not start). Where the rate must decide first (a pause,
   * a reservation, no room; for a `reschedule` job also its rate's row busy, or its key held), the statement
   * took nothing, and the job asks the rate first (`probeAndRun`). A start the statement did not count (a
   * `drop` or `raise` job's row was busy, or the key passed in memory) is decided once the job holds its key
   * (runTask).
   */
  const rideAndRun = async (payload: unknown, helpers: JobHelpers) => {
    const { job } = helpers;
    const slots = keysOfJob(job);
    const keys = gateKeys(job, slots[0]!);
    const ride = slots.length === 1 ? gate.ride(job, keys) : null;
    if (!ride) return probeAndRun(payload, helpers);
    const result = await giveBack.acquire(job, helpers, slots, holdInfo, undefined, ride);
    if (result === null) return;
    if (!result.acquired) {
      if (!result.rateFirst) return onConflict(job, helpers, slots, result.local);
      gate.refused(keys);
      return probeAndRun(payload, helpers);
    }
    if (!result.counted) return runHeld(result.hold, payload, helpers);
    const counted = gate.counted(job, keys, result.counted);
    try {
      return await runHeld(result.hold, payload, helpers, counted);
    } finally {
      await counted.refund(helpers);
    }
  };

  const wrapped = (payload: unknown, helpers: JobHelpers): Promise<ReturnType<Task>> => {
    // A task without a lock: only its start is checked (rate, pause).
    if (!options.lock) return runTask(payload, helpers, helpers) as Promise<ReturnType<Task>>;
    // With lock-ahead the key was derived (and usually taken) when the job was fetched (never for a task
    // with a rate: its jobs ask the rate before they take their lock).
    const ahead = ctx.lockedAhead(helpers.job.id);
    const batched = ctx.fetchedInBatch(helpers.job.id);
    if (!ahead) {
      if (!probed) return acquireAndRun(payload, helpers, undefined, batched);
      return rides ? rideAndRun(payload, helpers) : probeAndRun(payload, helpers);
    }
    if (ahead.settled) return runLockedAhead(ahead.result, payload, helpers);
    return ahead.promise.then((result) => runLockedAhead(result, payload, helpers));
  };

  return Object.assign(wrapped as Task, {
    taskIdentifier,
    options,
    lockKey: (payload: TPayload) => keysOf(payload)[0]!,
    lockPlan: planOf,
    waitsInLine,
    lockAvailable: async (payload: TPayload) => {
      if (!options.limits) return ctx.lockAvailable(keysOf(payload));
      const limits = jobLimitKeys(taskIdentifier, options, payload);
      const held = await ctx.limitsHeld(limits);
      return held.every((n, i) => n < limits[i]!.slots.length);
    },
    addJob: (payload: TPayload, spec?: AddJobSpec) => ctx.addJob(taskIdentifier, payload, spec),
  }) as ExclusiveTask<TPayload>;
}
