/**
 * The enqueue statements: an `EnqueuePlan` (enqueue.ts) as the parameters of one statement, and its rows
 * as `AddJobResult`s. A job with a job key of the caller's goes through graphile-worker's public `add_job`;
 * every other job (unique or not) through this library's `enqueue_job` / `enqueue_jobs` (sql/000001.sql),
 * which insert into graphile-worker's job table directly (enqueue.ts says why). The preemptive check is
 * part of the same statement: a condition that does not depend on the function's result, which PostgreSQL
 * evaluates once, before calling it. It only reads pg_locks.
 */
import type { Job } from "graphile-worker";
import { InvalidArgumentError, rethrowExplained } from "../errors.js";
import { advisoryParts } from "../key.js";
import type { AddJobSpec } from "../options.js";
import type { Sql } from "../sql.js";
import type { AddJobResult } from "../types.js";
import type { ResolvedUnique, UniqueScope } from "./unique.js";

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
  /** The lock's slot keys when the preemptive check applies. */
  lockKeys: readonly bigint[] | null;
  unique: ResolvedUnique | null;
  /**
   * A job of a `reschedule` task (one slot, not unique, no `runAt`): its key, and how long it may wait in
   * line before its safety net fetches it (the task's `reschedule.maxDelay`). In a bulk enqueue, such a job
   * after the first of its key is added waiting in line (enqueue_jobs in sql/000001.sql).
   */
  line?: { key: bigint; safetyNetMs: number } | null;
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

type JobRow = Job & { outcome?: string };

/**
 * graphile-worker's flags object for a unique job, as JSON: the caller's flags plus the one that records the
 * job's scope on its row (the window's end is added by the database, from its own clock); null for none.
 */
function uniqueFlagsJson(
  flags: readonly string[] | undefined,
  unique: ResolvedUnique | null,
): string | null {
  if (!flags?.length) return unique?.scope ? SCOPE_FLAGS_JSON[unique.scope] : null;
  const object: Record<string, true> = {};
  for (const flag of flags) object[flag] = true;
  if (unique?.scope) object[`gwl:unique:${unique.scope}`] = true;
  return JSON.stringify(object);
}

/** The flags of a unique job without flags of the caller's, one per scope, serialized once. */
const SCOPE_FLAGS_JSON: Readonly<Record<UniqueScope, string>> = {
  queued: JSON.stringify({ "gwl:unique:queued": true }),
  active: JSON.stringify({ "gwl:unique:active": true }),
  exists: JSON.stringify({ "gwl:unique:exists": true }),
};

function toJob(row: JobRow, taskIdentifier: string): Job | null {
  const { outcome: _outcome, ...job } = row;
  if (job.id === null) return null;
  // (a row the library added has no task identifier of its own: it is the item's)
  job.task_identifier ??= taskIdentifier;
  return job;
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
  if (unique || (spec?.jobKey === undefined && spec?.jobKeyMode === undefined)) {
    name = lockKeys ? "add_unique_checked" : "add_unique";
    text = sql.addUniqueJob(lockKeys !== null);
    values.push(
      // (none: the JSON text null)
      uniqueFlagsJson(spec?.flags, unique) ?? "null",
      unique?.key ?? null,
      unique?.scope ?? null,
      unique?.windowSeconds ?? null,
      unique?.onDuplicate ?? null,
    );
  } else {
    name = lockKeys ? "add_job_checked" : "add_job";
    text = lockKeys ? sql.addJobIfAvailable : sql.addJob;
    values.push(spec?.flags ?? null, spec?.jobKey ?? null, spec?.jobKeyMode ?? null);
  }
  if (lockKeys) values.push(...lockCoordinates(lockKeys));
  const { rows } = await explaining(db).query<JobRow>(sql.statement(name, text, values));
  const row = rows[0];
  if (!row) return { job: null, outcome: "dropped" };
  return {
    job: toJob(row, plan.taskIdentifier),
    outcome: (row.outcome as AddJobResult["outcome"] | undefined) ?? "added",
  };
}

/**
 * Many enqueues in one statement, deduplicated within the batch (the first of a key wins) and against
 * existing jobs. No preemptive check. Results in input order.
 */
export async function addJobs(
  db: Queryable,
  sql: Sql,
  plans: readonly EnqueuePlan[],
): Promise<AddJobResult[]> {
  if (plans.length === 0) return [];
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
  // The batch's JSON (an array of job_spec, sql/000001.sql), written item by item: fields left out are
  // read as null by the database, and a unique job's flags without flags of the caller's are one of three
  // constant texts.
  const items = plans.map((plan, index) => {
    const { spec, unique } = plan;
    if (spec?.jobKey !== undefined || spec?.jobKeyMode !== undefined) {
      throw new InvalidArgumentError(
        `addJobs: item ${index} has a \`jobKey\`; use graphile-worker's own addJobs for jobs with your own job keys`,
      );
    }
    let item = `{"task":${placeOf(tasks, plan.taskIdentifier)}`;
    if (spec?.queueName != null) item += `,"queue":${placeOf(queues, spec.queueName)}`;
    item += `,"payload":${JSON.stringify(plan.payload ?? {})}`;
    if (spec?.runAt) item += `,"run_at":${JSON.stringify(spec.runAt.toISOString())}`;
    if (spec?.maxAttempts != null) item += `,"max_attempts":${JSON.stringify(spec.maxAttempts)}`;
    if (spec?.priority != null) item += `,"priority":${JSON.stringify(spec.priority)}`;
    const flags = uniqueFlagsJson(spec?.flags, unique);
    if (flags !== null) item += `,"flags":${flags}`;
    if (unique) {
      item += `,"unique_key":${JSON.stringify(unique.key)}`;
      if (unique.scope) item += `,"scope":"${unique.scope}"`;
      if (unique.windowSeconds != null)
        item += `,"window_seconds":${JSON.stringify(unique.windowSeconds)}`;
      if (unique.onDuplicate !== "reject") item += `,"on_duplicate":"${unique.onDuplicate}"`;
      if (unique.scope && !firstOfKey.has(unique.key)) {
        firstOfKey.add(unique.key);
        item += `,"first":true`;
      }
    } else {
      plain++;
      if (plan.line) {
        if (fronts.has(plan.line.key)) {
          item += `,"park_ms":${JSON.stringify(plan.line.safetyNetMs)}`;
          parkPos.push(plain);
          parkKeys.push(plan.line.key.toString());
        } else fronts.add(plan.line.key);
      }
    }
    return item + "}";
  });
  const { rows } = await explaining(db).query<Job>(
    sql.statement("add_unique_flat", sql.addUniqueJobs, [
      `[${items.join(",")}]`,
      items.length,
      firstOfKey.size,
      [...tasks.keys()],
      [...queues.keys()],
      parkPos.length > 0 ? parkPos : null,
      parkPos.length > 0 ? parkKeys : null,
    ]),
  );
  const results: AddJobResult[] = new Array(plans.length);
  const trailer = rows.length > 0 && rows[rows.length - 1]!.id === null ? rows.pop()! : null;
  if (!trailer) {
    // Every item was added: its row, in the items' order.
    if (rows.length !== plans.length) {
      throw new Error(
        `graphile-worker-locks: the bulk enqueue answered ${rows.length} rows for ${plans.length} items`,
      );
    }
    for (let i = 0; i < rows.length; i++) {
      results[i] = { job: withTask(rows[i]!, plans[i]!.taskIdentifier), outcome: "added" };
    }
    return results;
  }
  // Otherwise the trailer places each row: its item, its outcome, and its job's task.
  const { ord, outcome, task } = trailer.payload as unknown as BulkTrailer;
  rows.forEach((row, i) => {
    const index = ord[i]! - 1;
    results[index] = {
      job: row.id === null ? null : withTask(row, task[i] ?? plans[index]!.taskIdentifier),
      outcome: outcome[i] as AddJobResult["outcome"],
    };
  });
  return results;
}

/** The last row of a bulk enqueue that did more than add every item (enqueue_jobs), one entry per row. */
interface BulkTrailer {
  ord: number[];
  outcome: string[];
  task: Array<string | null>;
}

/** A row of graphile-worker's job table as its `Job`: the row itself, with its task's identifier. */
function withTask(row: Job, taskIdentifier: string): Job {
  row.task_identifier = taskIdentifier;
  return row;
}
