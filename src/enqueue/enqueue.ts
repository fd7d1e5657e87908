/**
 * Enqueueing, from a call to its answer: `makeEnqueuer` plans each job (its lock keys for the preemptive
 * check, its uniqueness, its rate and debounce (enqueue/limits.ts), its place in a line) from the task's
 * rules, validating everything before anything is written; sends the statement (enqueue/statements.ts);
 * reports duplicates, replacements, drops, rate refusals and debounces as events; and turns what the database refused into typed errors (`UniqueConflictError` for
 * `onDuplicate: "raise"`, deadlocks of a bulk enqueue retried on the pool).
 *
 * The insert path. Jobs without a job key of the caller's go into graphile-worker's job table through this
 * library's `enqueue_job` / `enqueue_jobs` (sql/000001.sql), not through graphile-worker's `add_job` /
 * `add_jobs`: uniqueness needs the insert and the unique-key check in one statement (a row lock on the key,
 * then the insert), which `add_job` cannot be given; and the direct insert is faster than the public path
 * even for a plain job (`npm run bench -- enqueue`; the figures are in bench/README.md). The price is a
 * dependency on graphile-worker's private tables: migrate.ts refuses a graphile-worker schema it was not
 * tested with (TESTED_WORKER_SCHEMAS) unless told otherwise, and the tests run against each tested version. A job with a job key of the caller's still goes through
 * `add_job`, which owns job-key semantics.
 */
import type { Job, TaskSpec } from "graphile-worker";
import type { Pool, PoolClient, Client } from "pg";
import type { LocksContext } from "../context.js";
import { InvalidArgumentError, UniqueConflictError } from "../errors.js";
import {
  assertIdentifier,
  assertJsonSafe,
  jobLimitKeys,
  jobLockKeys,
  keyFlag,
  lockFlag,
  lockKeyValue,
  resolveLimit,
  slotKeys,
  type LimitKeys,
} from "../key.js";
import type { AddJobSpec, ResolvedExclusiveOptions } from "../options.js";
import type { Sql } from "../sql.js";
import {
  addJob,
  addJobs,
  limitsHeld,
  batchIndexOf,
  supersededTasks,
  lockAvailable,
  type EnqueuePlan,
  type Queryable,
} from "./statements.js";
import { resolveLimits } from "./limits.js";
import type { AddJobResult, AddJobsItem } from "../types.js";
import { resolveUnique, type UniqueOptions } from "./unique.js";

/** What is known about a task identifier on a `Locks` instance. */
export interface TaskRules {
  exclusive: ResolvedExclusiveOptions<never> | null;
  unique: UniqueOptions<never>;
}

export interface EnqueuerOptions {
  pool: Pool;
  sql: Sql;
  /** The rules of each task defined on the instance (read at each enqueue). */
  rules: ReadonlyMap<string, TaskRules>;
  /** The rules of a task with none of its own: `defaults` resolved. */
  defaultExclusive: ResolvedExclusiveOptions<never>;
  /** Resolves once the schema is installed; undefined when it is known to be. */
  ready(): Promise<void> | undefined;
  emit: LocksContext["emit"];
  warn(message: string, error: unknown): void;
}

export interface Enqueuer {
  addJob(
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
  ): Promise<AddJobResult>;
  addJobs(
    items: readonly AddJobsItem[],
    options: { pgClient?: PoolClient | Client } | undefined,
  ): Promise<AddJobResult[]>;
  /** The slot keys a job of this task with this payload takes (of its first limit, with several). */
  keysOf(taskIdentifier: string, payload: unknown): bigint[];
  /** The keys of every limit of a job of this task with this payload (one entry for a single limit). */
  limitKeysOf(taskIdentifier: string, payload: unknown): LimitKeys[];
  lockAvailable(keys: readonly bigint[]): Promise<boolean>;
  /** How many slots of each limit are held right now (by any session). */
  limitsHeld(limits: readonly LimitKeys[]): Promise<number[]>;
  /** Removes expired `uniqueFor` windows, rate logs and debounce rows now; resolves how many. */
  sweep(): Promise<number>;
}

/**
 * How often an enqueue with a `uniqueFor` window, a rate or a debounce also removes expired windows, rate
 * logs and debounce rows.
 */
const SWEEP_INTERVAL_MS = 60_000;

const DEADLOCK_DETECTED = "40P01";
const DEADLOCK_RETRIES = 5;
/** The SQLSTATE of enqueue_jobs's `onDuplicate: "raise"`: HINT the item's place (from 1), DETAIL the job. */
const UNIQUE_RAISED = "GWLUQ";

/**
 * A bulk enqueue, tried again when PostgreSQL broke a deadlock by aborting it. The batch takes its keys in
 * key order (enqueue_jobs in sql/000001.sql), which rules out the deadlocks of two batches inserting keys in
 * opposite orders; what remains is rare (a batch's second pass over keys that an older job freed
 * meanwhile). On the pool the statement is its own transaction, so an aborted one wrote nothing and is safe
 * to repeat; on the caller's client it may be part of the caller's transaction, which the abort ended, so
 * the error is theirs.
 */
async function addJobsRetryingDeadlocks(
  db: Queryable,
  sql: Sql,
  plans: readonly EnqueuePlan[],
  ownTransaction: boolean,
): Promise<AddJobResult[]> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await addJobs(db, sql, plans);
    } catch (error) {
      const code = (error as { code?: string }).code;
      if (!ownTransaction || code !== DEADLOCK_DETECTED || attempt > DEADLOCK_RETRIES) throw error;
    }
  }
}

/**
 * Whether an enqueue supersedes the older jobs of its key: `spec.supersede`, else the task's `supersede`.
 * Refused (before anything is written) on a task not defined with `onConflict: "reschedule"` here, and with
 * a job key of the caller's.
 */
function superseding(
  taskIdentifier: string,
  exclusive: ResolvedExclusiveOptions<never> | null,
  spec: AddJobSpec | undefined,
): boolean {
  const supersede = spec?.supersede ?? exclusive?.supersede ?? false;
  if (typeof supersede !== "boolean") {
    throw new InvalidArgumentError(
      `task '${taskIdentifier}': \`supersede\` must be a boolean, got ${typeof supersede}`,
    );
  }
  if (!supersede) return false;
  if (exclusive?.onConflict !== "reschedule") {
    throw new InvalidArgumentError(
      `task '${taskIdentifier}': \`supersede\` needs a task defined on this instance with \`onConflict: "reschedule"\` (the new job waits for the one it stops), ` +
        (exclusive
          ? `got \`onConflict: "${exclusive.onConflict}"\``
          : "and it is not exclusive here"),
    );
  }
  if (spec?.jobKey !== undefined || spec?.jobKeyMode !== undefined) {
    throw new InvalidArgumentError(
      `task '${taskIdentifier}': \`supersede\` cannot be combined with a \`jobKey\` of yours`,
    );
  }
  return true;
}

/** An enqueue's spec as events show it: without its client. */
function publicSpec(spec: AddJobSpec | undefined): TaskSpec | undefined {
  if (!spec) return undefined;
  const { pgClient: _client, ...rest } = spec;
  return rest;
}

export function makeEnqueuer(options: EnqueuerOptions): Enqueuer {
  const { pool, sql, rules: definitions, defaultExclusive, emit } = options;

  let lastSweep = Date.now();
  const maybeSweep = () => {
    if (Date.now() - lastSweep < SWEEP_INTERVAL_MS) return;
    lastSweep = Date.now();
    pool
      .query({ text: sql.sweepUniqueWindows })
      .catch((error: unknown) => options.warn("sweeping unique windows failed", error));
    pool
      .query({ text: sql.sweepEnqueueLimits })
      .catch((error: unknown) => options.warn("sweeping rate logs and debounces failed", error));
  };

  /** Resolves an enqueue, validating everything before anything is written. */
  const plan = (
    taskIdentifier: string,
    payload: unknown,
    spec: AddJobSpec | undefined,
    preemptiveCheck?: boolean,
  ): EnqueuePlan => {
    assertIdentifier(taskIdentifier);
    assertJsonSafe(payload);
    const definition = definitions.get(taskIdentifier);
    const exclusive = definition?.exclusive ?? null;
    const supersede = superseding(taskIdentifier, exclusive, spec);
    // (a superseding job waits for the job it stops: never dropped up front)
    const preemptive = supersede
      ? false
      : (preemptiveCheck ?? spec?.preemptive ?? (exclusive ? exclusive.preemptive : false));
    // An exclusive task's key is evaluated at every enqueue, whether a check uses it or not, so that a key
    // function that fails does so before anything is written (and not only once a worker runs the job).
    const rules = exclusive ?? (preemptive ? defaultExclusive : null);
    const keyOfPayload = rules
      ? { value: lockKeyValue(taskIdentifier, rules, payload, undefined, true) }
      : null;
    // Several limits: every limit's key and limit function is evaluated (and checked) here too; the
    // preemptive check reads them all (see addJob below).
    const limitKeys = rules?.limits
      ? jobLimitKeys(taskIdentifier, rules, payload, undefined, true)
      : null;
    const limit =
      rules && !rules.limits ? resolveLimit(rules.limit, taskIdentifier, keyOfPayload!.value) : 0;
    const reschedules = exclusive?.onConflict === "reschedule";
    const flagged = reschedules && !limitKeys && limit === 1;
    const keys =
      rules && !limitKeys && (preemptive || flagged)
        ? slotKeys(rules.lockGroup ?? taskIdentifier, keyOfPayload!.value, limit, null)
        : null;
    const lockKeys = preemptive ? keys : null;
    const unique = resolveUnique(
      taskIdentifier,
      payload,
      definition?.unique,
      spec,
      exclusive ? keyOfPayload! : undefined,
    );
    const limits = resolveLimits(
      taskIdentifier,
      payload,
      definition?.unique,
      spec,
      exclusive ? keyOfPayload! : undefined,
      unique !== null,
    );
    const limited = limits.rate !== null || limits.debounce !== null;
    if (supersede && limited) {
      throw new InvalidArgumentError(
        `task '${taskIdentifier}': \`supersede\` cannot be combined with \`enqueueRate\` or \`debounce\` (a superseding job is always added)`,
      );
    }
    // A job that waits its turn carries its key as a flag, for runners that skip held keys at fetch.
    let line: EnqueuePlan["line"] = null;
    if (flagged) {
      const key = keys![0]!;
      // (with no safety net to speak of, a job added parked would be fetched at once: no line then)
      const safetyNetMs = exclusive.reschedule.maxDelay;
      if (!unique && !limited && !spec?.runAt && safetyNetMs >= 1000) line = { key, safetyNetMs };
      spec = { ...spec, flags: [...(spec?.flags ?? []), lockFlag(key)] };
    } else if (exclusive?.onConflict === "reschedule" && limitKeys) {
      // Several limits: the lines of its limits of one slot (a limit of several slots has no line order,
      // and a job added waiting in its line would leave its other slots idle).
      const keys = limitKeys.filter((l) => l.slots.length === 1).map((l) => l.slots[0]!);
      const safetyNetMs = exclusive.reschedule.maxDelay;
      if (keys.length > 0 && !unique && !limited && !spec?.runAt && safetyNetMs >= 1000)
        line = { key: keys[0]!, keys, safetyNetMs };
    }
    // The first slot of the key (of its first limit, with several): what a superseding enqueue names, and,
    // as a flag on a job of a `reschedule` task that `lockFlag` does not name, how one finds it waiting.
    const firstSlot = () =>
      keys?.[0] ??
      limitKeys?.[0]?.slots[0] ??
      slotKeys(rules!.lockGroup ?? taskIdentifier, keyOfPayload!.value, 1, null)[0]!;
    if (reschedules && !flagged && exclusive.lock) {
      spec = { ...spec, flags: [...(spec?.flags ?? []), keyFlag(firstSlot())] };
    }
    return {
      taskIdentifier,
      payload,
      spec,
      lockKeys,
      limitKeys: preemptive ? limitKeys : null,
      unique,
      line,
      limits,
      supersede: supersede ? firstSlot() : null,
    };
  };

  /** Tells listeners what became of a job that was not simply added. */
  const report = (result: AddJobResult, p: EnqueuePlan) => {
    const { taskIdentifier, payload, spec } = p;
    switch (result.outcome) {
      case "dropped":
        emit("enqueue:dropped", {
          taskIdentifier,
          lockKey: p.lockKeys![0]!,
          payload,
          spec: publicSpec(spec),
        });
        break;
      case "duplicate":
        emit("enqueue:duplicate", {
          taskIdentifier,
          uniqueKey: p.unique!.key,
          payload,
          job: result.job,
        });
        break;
      case "replaced":
        emit("enqueue:replaced", {
          taskIdentifier,
          uniqueKey: p.unique!.key,
          payload,
          job: result.job!,
        });
        break;
      case "rateLimited":
        emit("job:rateLimited", {
          taskIdentifier,
          rateKey: p.limits!.rate!.key,
          payload,
          spec: publicSpec(spec),
        });
        break;
      case "debounced":
        emit("job:debounced", {
          taskIdentifier,
          debounceKey: p.limits!.debounce!.key,
          payload,
          job: result.job!,
        });
        break;
      case "added":
        if (result.superseded) {
          const tasks = supersededTasks(result);
          for (const [i, jobId] of result.superseded.entries()) {
            emit("job:superseded", {
              // (the removed job's own task: a lock group may make it another than the new job's)
              taskIdentifier: tasks[i] ?? taskIdentifier,
              lockKey: p.supersede!,
              jobId,
              byJobId: result.job!.id,
              state: "waiting",
              job: null,
            });
          }
        }
        break;
    }
  };

  /** A bulk enqueue's `onDuplicate: "raise"` (GWLUQ) as the UniqueConflictError it stands for. */
  const uniqueRaised = async (
    error: unknown,
    plans: readonly EnqueuePlan[],
    ownTransaction: boolean,
  ): Promise<unknown> => {
    const e = error as { code?: string; detail?: string; hint?: string };
    if (e.code !== UNIQUE_RAISED) return error;
    const p = plans[batchIndexOf(plans, Number(e.hint))]!;
    const existingJobId = e.detail || null;
    // (the caller's transaction is aborted: the existing job is only read on the pool)
    const existing =
      existingJobId && ownTransaction
        ? ((await pool.query<Job>(sql.jobById, [existingJobId])).rows[0] ?? null)
        : null;
    return new UniqueConflictError(p.taskIdentifier, p.unique!.key, existingJobId, existing, {
      cause: error,
    });
  };

  return {
    async addJob(taskIdentifier, payload, spec) {
      const p = plan(taskIdentifier, payload, spec);
      // (every enqueue statement calls this library's functions, unique or not)
      const migrating = options.ready();
      if (migrating) await migrating;
      const db: Queryable = spec?.pgClient ?? pool;
      if (p.limitKeys) {
        // Several limits: dropped up front when any of them is full. A read before the insert (the single
        // limit's check is part of its insert statement); either way the check is advisory, and the lock
        // statement when the job runs is what decides.
        const held = await limitsHeld(db, sql, p.limitKeys);
        const full = held.findIndex((n, i) => n >= p.limitKeys![i]!.slots.length);
        if (full >= 0) {
          const dropped: AddJobResult = { job: null, outcome: "dropped" };
          report(dropped, { ...p, lockKeys: p.limitKeys[full]!.slots });
          return dropped;
        }
      }
      const result = await addJob(db, sql, p);
      report(result, p);
      if (p.unique?.windowSeconds || p.limits?.rate || p.limits?.debounce) maybeSweep();
      if (result.outcome === "duplicate" && p.unique?.onDuplicate === "raise") {
        throw new UniqueConflictError(
          taskIdentifier,
          p.unique.key,
          result.job?.id ?? null,
          result.job,
        );
      }
      return result;
    },

    async addJobs(items, addOptions) {
      if (!Array.isArray(items))
        throw new InvalidArgumentError(`\`addJobs\` takes an array, got ${typeof items}`);
      const plans = items.map((item, index) => {
        if (!item || typeof item !== "object") {
          throw new InvalidArgumentError(
            `addJobs: item ${index} must be an object, got ${String(item)}`,
          );
        }
        // The item is its own spec (its `identifier` and `payload` are not read as options); a bulk
        // enqueue has no preemptive check. What is wrong with an item names its index; the cause is the
        // original error (a key function's own, when it threw).
        try {
          return plan(item.identifier, item.payload, item, false);
        } catch (error) {
          if (!(error instanceof InvalidArgumentError)) throw error;
          throw new InvalidArgumentError(`addJobs: item ${index}: ${error.message}`, {
            cause: error.cause ?? error,
          });
        }
      });
      const migrating = options.ready();
      if (migrating) await migrating;
      const ownTransaction = !addOptions?.pgClient;
      let results: AddJobResult[];
      try {
        results = await addJobsRetryingDeadlocks(
          addOptions?.pgClient ?? pool,
          sql,
          plans,
          ownTransaction,
        );
      } catch (error) {
        throw await uniqueRaised(error, plans, ownTransaction);
      }
      results.forEach((result, index) => report(result, plans[index]!));
      if (plans.some((p) => p.unique?.windowSeconds || p.limits?.rate || p.limits?.debounce))
        maybeSweep();
      return results;
    },

    keysOf(taskIdentifier, payload) {
      assertIdentifier(taskIdentifier);
      const rules = definitions.get(taskIdentifier)?.exclusive ?? defaultExclusive;
      return jobLockKeys(taskIdentifier, rules, payload);
    },

    limitKeysOf(taskIdentifier, payload) {
      assertIdentifier(taskIdentifier);
      const rules = definitions.get(taskIdentifier)?.exclusive ?? defaultExclusive;
      return jobLimitKeys(taskIdentifier, rules, payload);
    },

    async limitsHeld(limits) {
      const migrating = options.ready();
      if (migrating) await migrating;
      return limitsHeld(pool, sql, limits);
    },

    async lockAvailable(keys) {
      const migrating = options.ready();
      if (migrating) await migrating;
      return lockAvailable(pool, sql, keys);
    },

    async sweep() {
      await options.ready();
      lastSweep = Date.now();
      const windows = await pool.query<{ removed: number }>(sql.sweepUniqueWindows);
      const limits = await pool.query<{ removed: number }>(sql.sweepEnqueueLimits);
      const starts = await pool.query<{ removed: number }>(sql.sweepStartRates);
      return windows.rows[0]!.removed + limits.rows[0]!.removed + starts.rows[0]!.removed;
    },
  };
}
