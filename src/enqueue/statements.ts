/**
 * The enqueue statements: an `EnqueuePlan` (enqueue.ts) as the parameters of one statement, and its rows
 * as `AddJobResult`s. A job with a job key of the caller's goes through graphile-worker's public `add_job`;
 * every other job (unique or not) through this library's `enqueue_job` / `enqueue_jobs` (sql/000001.sql),
 * or, under a rate or a debounce, `enqueue_job_limited` / `enqueue_jobs_limited` (sql/000005.sql),
 * which insert into graphile-worker's job table directly (enqueue.ts says why). Both answer rows of one
 * shape: the item's place (bulk only), its outcome, its job's task and the job's columns. The preemptive
 * check is part of the same statement: a condition that does not depend on the function's result, which
 * PostgreSQL evaluates once, before calling it. It only reads pg_locks.
 */
import type { Job } from "graphile-worker";
import { InvalidArgumentError, rethrowExplained } from "../errors.js";
import { advisoryParts, type LimitKeys } from "../key.js";
import type { AddJobSpec } from "../options.js";
import type { Sql } from "../sql.js";
import type { AddJobResult } from "../types.js";
import type { DuplicateStrategy, ResolvedUnique, UniqueScope } from "./unique.js";
import type { ResolvedLimits } from "./limits.js";

export interface Queryable {
  query<R extends object>(config: {
    text: string;
    values?: unknown[];
    name?: string;
  }): Promise<{ rows: R[] }>;
}

/** `db`, whose errors from a pooler without prepared statements say which options to change. */
function explaining(db: Queryable): Queryable {
  return {
    query: <R extends object>(config: Parameters<Queryable["query"]>[0]) =>
      db.query<R>(config).catch(rethrowExplained),
  };
}

/** One enqueue, resolved: what to add, which lock to check first, and its uniqueness. */
export interface EnqueuePlan {
  taskIdentifier: string;
  payload: unknown;
  spec: AddJobSpec | undefined;
  /** The lock's slot keys when the preemptive check applies (a single limit). */
  lockKeys: readonly bigint[] | null;
  /** Every limit's keys when the preemptive check applies to a task with several limits. */
  limitKeys?: readonly LimitKeys[] | null;
  unique: ResolvedUnique | null;
  /**
   * A job of a `reschedule` task (one slot, not unique, no `runAt`): its key, and how long it may wait in
   * line before its safety net fetches it (the task's `reschedule.maxDelay`). In a bulk enqueue, such a job
   * after the first of its key is added waiting in line (enqueue_jobs in sql/000001.sql). A job with
   * several limits has as many lines as it has limits of one slot (`keys`, in order; `key` is the first): in a
   * bulk enqueue it waits in the first of them that an earlier job of the batch has taken the front of.
   */
  line?: { key: bigint; keys?: readonly bigint[]; safetyNetMs: number } | null;
  /**
   * A superseding enqueue (`supersede`): the key (slot 0) whose older jobs the new job supersedes, in the
   * same statement (no preemptive check then).
   */
  supersede?: bigint | null;
  /** Its rate and debounce, if any (such a job has no line). */
  limits?: ResolvedLimits;
}

/** Whether a plan goes through the rate-limited and debounced path (sql/000005.sql). */
function isLimited(plan: EnqueuePlan): boolean {
  return !!(plan.limits?.rate || plan.limits?.debounce);
}

/** pg_locks coordinates of keys, as the `lockAvailable` statement takes them. */
function lockCoordinates(keys: readonly bigint[]): [number[], number[], number] {
  const parts = keys.map(advisoryParts);
  return [parts.map((p) => p.classid), parts.map((p) => p.objid), keys.length];
}

export async function lockAvailable(
  db: Queryable,
  sql: Sql,
  keys: readonly bigint[],
): Promise<boolean> {
  const { rows } = await explaining(db).query<{ available: boolean }>(
    sql.statement("lock_available", sql.lockAvailable, lockCoordinates(keys)),
  );
  return rows[0]!.available;
}

/** How many slots of each limit some session holds now, in the order of `limits`. */
export async function limitsHeld(
  db: Queryable,
  sql: Sql,
  limits: readonly LimitKeys[],
): Promise<number[]> {
  const keys = limits.flatMap((l) => l.slots);
  const [classids, objids] = lockCoordinates(keys);
  const limitOf = limits.flatMap((l, i) => l.slots.map(() => i));
  const { rows } = await explaining(db).query<{ i: number; held: number }>(
    sql.statement("limits_held", sql.limitsHeld, [classids, objids, limitOf]),
  );
  const held = limits.map(() => 0);
  for (const row of rows) held[row.i] = row.held;
  return held;
}

/**
 * A row of an enqueue statement: the item's place (from 1; bulk only), its outcome (none from
 * graphile-worker's add_job: added) and the job's columns, all null for no job.
 */
type EnqueueRow = Job & {
  ord?: number;
  outcome?: string;
  superseded?: Array<{ id: string; task: string | null }> | null;
};

/**
 * The task of each job a superseding enqueue removed (`AddJobResult.superseded`, in its order): the removed
 * job's own, which a lock group may make another than the enqueued job's.
 */
const removedTasks = new WeakMap<AddJobResult, readonly (string | null)[]>();

/** The tasks of the jobs in `result.superseded`, in its order (null where the task is not known). */
export function supersededTasks(result: AddJobResult): readonly (string | null)[] {
  return removedTasks.get(result) ?? [];
}

/**
 * graphile-worker's flags object for a job: the caller's flags plus, for a unique job, the one that records
 * its scope on its row (the window's end is added by the database, from its own clock); null for none.
 */
function jobFlags(
  flags: readonly string[] | undefined,
  unique: ResolvedUnique | null,
): Record<string, true> | null {
  if (!flags?.length) return unique?.scope ? SCOPE_FLAGS[unique.scope] : null;
  const object: Record<string, true> = {};
  for (const flag of flags) object[flag] = true;
  if (unique?.scope) object[`gwl:unique:${unique.scope}`] = true;
  return object;
}

/**
 * A job's flags as a statement parameter: their JSON object, or SQL null for none (never the JSON value
 * null, which graphile-worker's flags column would keep as a non-object).
 */
function flagsParam(
  flags: readonly string[] | undefined,
  unique: ResolvedUnique | null,
): string | null {
  const object = jobFlags(flags, unique);
  return object === null ? null : JSON.stringify(object);
}

/** The flags of a unique job without flags of the caller's, one per scope. */
const SCOPE_FLAGS: Readonly<Record<UniqueScope, Readonly<Record<string, true>>>> = {
  queued: { "gwl:unique:queued": true },
  active: { "gwl:unique:active": true },
  exists: { "gwl:unique:exists": true },
};

/** A row's outcome and job (the row without its `ord` and `outcome`). */
function toResult(row: EnqueueRow, taskIdentifier: string): AddJobResult {
  const { ord: _ord, outcome = "added", superseded, ...job } = row;
  if (job.id === null) return { job: null, outcome: outcome as AddJobResult["outcome"] };
  // (a row of graphile-worker's add_job has no task identifier of its own: it is the item's)
  job.task_identifier ??= taskIdentifier;
  const result: AddJobResult = { job, outcome: outcome as AddJobResult["outcome"] };
  if (superseded) {
    result.superseded = superseded.map((r) => r.id);
    removedTasks.set(
      result,
      superseded.map((r) => r.task),
    );
  }
  return result;
}

export async function addJob(db: Queryable, sql: Sql, plan: EnqueuePlan): Promise<AddJobResult> {
  const { unique, lockKeys, spec } = plan;
  // Both statements take the job's columns first, in the same places ($1-$6).
  const values: unknown[] = [
    plan.taskIdentifier,
    JSON.stringify(plan.payload ?? {}),
    spec?.queueName ?? null,
    spec?.runAt ? spec.runAt.toISOString() : null,
    spec?.maxAttempts ?? null,
    spec?.priority ?? null,
  ];
  let name: string;
  let text: string;
  // Without a job key of the caller's, the library's own direct insert (enqueue_job, which bypasses
  // uniqueness for a null key); with one, graphile-worker's add_job, which owns job keys.
  if (isLimited(plan)) {
    const { rate, debounce } = plan.limits!;
    name = lockKeys ? "enqueue_job_limited_checked" : "enqueue_job_limited";
    text = sql.enqueueJobLimited(lockKeys !== null);
    values.push(
      flagsParam(spec?.flags, unique),
      unique?.key ?? null,
      unique?.scope ?? null,
      unique?.windowSeconds ?? null,
      unique?.onDuplicate ?? null,
      rate?.key ?? null,
      rate?.limit ?? null,
      rate?.periodMs ?? null,
      debounce?.key ?? null,
      debounce?.delayMs ?? null,
      debounce?.maxWaitMs ?? null,
      debounce?.leading ?? null,
    );
  } else if (unique || (spec?.jobKey === undefined && spec?.jobKeyMode === undefined)) {
    const superseding = plan.supersede != null;
    name = superseding
      ? "enqueue_job_superseding"
      : lockKeys
        ? "enqueue_job_checked"
        : "enqueue_job";
    text = sql.enqueueJob(lockKeys !== null, superseding);
    values.push(
      flagsParam(spec?.flags, unique),
      unique?.key ?? null,
      unique?.scope ?? null,
      unique?.windowSeconds ?? null,
      unique?.onDuplicate ?? null,
    );
  } else {
    name = lockKeys ? "add_job_with_job_key_checked" : "add_job_with_job_key";
    text = lockKeys ? sql.addJobWithJobKeyIfAvailable : sql.addJobWithJobKey;
    values.push(spec?.flags ?? null, spec?.jobKey ?? null, spec?.jobKeyMode ?? null);
  }
  if (lockKeys) values.push(...lockCoordinates(lockKeys));
  else if (plan.supersede != null) values.push(plan.supersede.toString());
  const { rows } = await explaining(db).query<EnqueueRow>(sql.statement(name, text, values));
  const row = rows[0];
  if (!row) return { job: null, outcome: "dropped" };
  return toResult(row, plan.taskIdentifier);
}

/**
 * One item of a bulk enqueue: a job_spec (sql/000001.sql) that names its task and queue by place (from 1).
 * A field left undefined is left out of the JSON, which the database reads as null.
 */
interface BulkItem {
  task: number;
  queue: number | undefined;
  payload: unknown;
  run_at: string | undefined;
  max_attempts: number | undefined;
  priority: number | undefined;
  flags: Readonly<Record<string, true>> | undefined;
  unique_key: string | undefined;
  scope: UniqueScope | undefined;
  window_seconds: number | undefined;
  on_duplicate: DuplicateStrategy | undefined;
  first: true | undefined;
  park_ms: number | undefined;
}

/**
 * Many enqueues in one statement, deduplicated within the batch (the first of a key wins) and against
 * existing jobs. No preemptive check. Results in input order.
 */
export async function addJobs(
  db: Queryable,
  sql: Sql,
  allPlans: readonly EnqueuePlan[],
): Promise<AddJobResult[]> {
  if (allPlans.length === 0) return [];
  // Rate-limited and debounced items go one by one after the others (enqueue_jobs_limited): `order` is the
  // batch as the database answers it, the others first, each with its place in `allPlans`.
  const indexed = allPlans.map((plan, index) => ({ plan, index }));
  const limited = indexed.filter((o) => isLimited(o.plan));
  const others = indexed.filter((o) => !isLimited(o.plan));
  const order = [...others, ...limited];
  const plans = others.map((o) => o.plan);
  // Tasks and queues go once each; an item names them by their place (from 1).
  const tasks = new Map<string, number>();
  const queues = new Map<string, number>();
  const placeOf = (places: Map<string, number>, name: string) => {
    let place = places.get(name);
    if (place === undefined) places.set(name, (place = places.size + 1));
    return place;
  };
  // The first scoped item of each key is tried set-based; the database answers the rest one by one.
  const firstOfKey = new Set<string>();
  // A line only where two jobs of a batch share a key: each key's first job (its front) stays runnable, the
  // others are added waiting in line. Each names its place among the items without a unique key.
  const fronts = new Set<bigint>();
  let plain = 0;
  const parkPos: number[] = [];
  const parkKeys: string[] = [];
  // The key each item supersedes, in the database's answer order (null: none).
  const supersedes = order.map((o) => o.plan.supersede?.toString() ?? null);
  const superseding = supersedes.some((k) => k !== null);
  allPlans.forEach(({ spec }, index) => {
    if (spec?.jobKey !== undefined || spec?.jobKeyMode !== undefined) {
      throw new InvalidArgumentError(
        `addJobs: item ${index} has a \`jobKey\`; use graphile-worker's own addJobs for jobs with your own job keys`,
      );
    }
  });
  const items = plans.map((plan): BulkItem => {
    const { spec, unique } = plan;
    const item: BulkItem = {
      task: placeOf(tasks, plan.taskIdentifier),
      queue: spec?.queueName != null ? placeOf(queues, spec.queueName) : undefined,
      ...itemColumns(plan),
      on_duplicate: unique && unique.onDuplicate !== "reject" ? unique.onDuplicate : undefined,
      first: undefined,
      park_ms: undefined,
    };
    if (unique) {
      if (unique.scope && !firstOfKey.has(unique.key)) {
        firstOfKey.add(unique.key);
        item.first = true;
      }
    } else {
      plain++;
      if (plan.line) {
        const keys = plan.line.keys ?? [plan.line.key];
        // (a superseding job is never added waiting: the front it would wait behind is one it removes)
        const behind = plan.supersede == null ? keys.find((key) => fronts.has(key)) : undefined;
        if (behind !== undefined) {
          item.park_ms = plan.line.safetyNetMs;
          parkPos.push(plain);
          parkKeys.push(behind.toString());
        } else for (const key of keys) fronts.add(key);
      }
    }
    return item;
  });
  const values: unknown[] = [
    JSON.stringify(items),
    items.length,
    firstOfKey.size,
    [...tasks.keys()],
    [...queues.keys()],
    parkPos.length > 0 ? parkPos : null,
    parkPos.length > 0 ? parkKeys : null,
  ];
  if (limited.length) values.push(JSON.stringify(limited.map((o) => limitedItem(o.plan))));
  if (superseding) values.push(supersedes);
  const name = `${limited.length ? "enqueue_jobs_limited" : "enqueue_jobs"}${superseding ? "_superseding" : ""}`;
  const { rows } = await explaining(db).query<EnqueueRow>(
    limited.length
      ? sql.statement(name, sql.enqueueJobsLimited(superseding), values)
      : sql.statement(name, sql.enqueueJobs(superseding), values),
  );
  if (rows.length !== allPlans.length) {
    throw new Error(
      `graphile-worker-locks: the bulk enqueue answered ${rows.length} rows for ${allPlans.length} items`,
    );
  }
  const results: AddJobResult[] = new Array(allPlans.length);
  for (const row of rows) {
    const index = order[row.ord! - 1]!.index;
    results[index] = toResult(row, allPlans[index]!.taskIdentifier);
  }
  return results;
}

/**
 * The place in the database's answer of each item of a batch: the same as in the batch, unless it has
 * rate-limited or debounced items, which come after the others. Maps a GWLUQ hint back to its item.
 */
export function batchIndexOf(plans: readonly EnqueuePlan[], ord: number): number {
  const places = [...plans.keys()];
  const order = [
    ...places.filter((i) => !isLimited(plans[i]!)),
    ...places.filter((i) => isLimited(plans[i]!)),
  ];
  return order[ord - 1]!;
}

/** The columns a batch item has in both bulk statements: its job's, and its unique rules' (undefined: null). */
function itemColumns(plan: EnqueuePlan) {
  const { spec, unique } = plan;
  return {
    payload: plan.payload ?? {},
    run_at: spec?.runAt ? spec.runAt.toISOString() : undefined,
    max_attempts: spec?.maxAttempts ?? undefined,
    priority: spec?.priority ?? undefined,
    flags: jobFlags(spec?.flags, unique) ?? undefined,
    unique_key: unique?.key,
    scope: unique?.scope ?? undefined,
    window_seconds: unique?.windowSeconds ?? undefined,
  };
}

/** A rate-limited or debounced item of a batch, as enqueue_jobs_limited reads it (undefined: null). */
function limitedItem(plan: EnqueuePlan) {
  const { spec, unique } = plan;
  const { rate, debounce } = plan.limits!;
  return {
    identifier: plan.taskIdentifier,
    queue_name: spec?.queueName ?? undefined,
    ...itemColumns(plan),
    on_duplicate: unique?.onDuplicate,
    rate_key: rate?.key,
    rate_limit: rate?.limit,
    rate_period_ms: rate?.periodMs,
    debounce_key: debounce?.key,
    delay_ms: debounce?.delayMs,
    max_wait_ms: debounce?.maxWaitMs,
    leading_edge: debounce?.leading,
  };
}
