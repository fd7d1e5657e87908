/**
 * A task's rules as a preset or a task file declares them (`worker.locks.tasks.<name>`, or a task file's
 * `locks` export), their validation, and their registration on a `Locks` instance.
 */
import type { Task } from "graphile-worker";
import { InvalidArgumentError } from "../errors.js";
import { jobLimitKeys, type LimitKeys } from "../key.js";
import { lockKeyValue } from "../key.js";
import { rateKeyOf } from "../rates/options.js";
import type { Locks } from "../types.js";
import {
  resolveExclusiveOptions,
  validateUniqueOptions,
  type ExclusiveOptions,
  type UniqueOptions,
} from "../options.js";

/**
 * The rules of one task in `worker.locks.tasks` (or a task file's `locks` export): every option of
 * `locks.exclusive`, plus `exclusive`.
 */
export interface TaskLocksOptions<TPayload = unknown> extends ExclusiveOptions<TPayload> {
  /**
   * Whether the task's jobs take a lock (`locks.exclusive`), or only have their enqueues deduplicated
   * (`locks.unique`).
   * @defaultValue `false` when the entry sets only enqueue options (`unique`, `uniqueFor`, `uniqueKey`,
   * `uniqueGroup`, `uniqueByQueue`, `onDuplicate`, `enqueueRate`, `debounce`), `true` otherwise (an empty
   * entry is exclusive)
   */
  exclusive?: boolean;
}

/** `worker.locks.tasks`: each task's rules, typed by `GraphileWorker.Tasks` where the task is declared there. */
export type TaskLocksOptionsMap = {
  [K in keyof GraphileWorker.Tasks]?: TaskLocksOptions<GraphileWorker.Tasks[K]>;
} & {
  // eslint-disable-next-line @typescript-eslint/no-explicit-any -- an undeclared task's payload is whatever its rules say
  [taskIdentifier: string]: TaskLocksOptions<any> | undefined;
};

const UNIQUE_KEYS = [
  "unique",
  "uniqueFor",
  "uniqueKey",
  "uniqueGroup",
  "uniqueByQueue",
  "onDuplicate",
  "enqueueRate",
  "debounce",
] as const;
const EXCLUSIVE_KEYS = [
  "onConflict",
  "key",
  "limit",
  "lockGroup",
  "limits",
  "preemptive",
  "reschedule",
  "supersede",
  "rate",
  "lock",
  "pausable",
] as const;
const KNOWN_KEYS = new Set<string>(["exclusive", ...UNIQUE_KEYS, ...EXCLUSIVE_KEYS]);

/** Where a task's rules come from, for error messages. */
export type RulesSource = string;

/**
 * Checks one task's rules, throwing an `InvalidArgumentError` that names the task, where its rules come
 * from, and the option.
 */
export function validateTaskRules(
  taskIdentifier: string,
  rules: unknown,
  source: RulesSource,
): asserts rules is TaskLocksOptions {
  const where = `${source} for task '${taskIdentifier}'`;
  if (!rules || typeof rules !== "object" || Array.isArray(rules)) {
    throw new InvalidArgumentError(`${where} must be an object, got ${String(rules)}`);
  }
  for (const name of Object.keys(rules)) {
    if (!KNOWN_KEYS.has(name)) {
      throw new InvalidArgumentError(
        `${where}: unknown option \`${name}\` (known: ${[...KNOWN_KEYS].join(", ")})`,
      );
    }
  }
  const { exclusive, ...options } = rules as TaskLocksOptions;
  if (exclusive !== undefined && typeof exclusive !== "boolean") {
    throw new InvalidArgumentError(
      `${where}: \`exclusive\` must be a boolean, got ${String(exclusive)}`,
    );
  }
  try {
    if (isExclusive(rules as TaskLocksOptions)) resolveExclusiveOptions(options, undefined);
    else validateUniqueOptions(options as UniqueOptions<never>, "task options");
  } catch (error) {
    if (error instanceof InvalidArgumentError) {
      throw new InvalidArgumentError(`${where}: ${error.message}`, { cause: error });
    }
    throw error;
  }
}

/** Whether an entry makes the task exclusive (see `TaskLocksOptions.exclusive`). */
function isExclusive(rules: TaskLocksOptions): boolean {
  if (rules.exclusive !== undefined) return rules.exclusive;
  const set = (name: string) => (rules as Record<string, unknown>)[name] !== undefined;
  return EXCLUSIVE_KEYS.some(set) || !UNIQUE_KEYS.some(set);
}

/**
 * The key of a job when the rules name none: the payload without the `_cron` member that graphile-worker's
 * crontab adds to each run, so that every run of a crontab entry shares one key and a run never overlaps
 * the previous one.
 */
export function payloadWithoutCron(payload: unknown): unknown {
  if (!payload || typeof payload !== "object" || Array.isArray(payload) || !("_cron" in payload)) {
    return payload;
  }
  const { _cron: _ignored, ...rest } = payload as Record<string, unknown>;
  return rest;
}

/**
 * Merges a task file's `locks` export and the preset's entry for the same task: the preset's entry wins,
 * option by option (so an operator can override one option of a task without editing its file).
 */
export function mergeRules(
  fromFile: TaskLocksOptions | undefined,
  fromPreset: TaskLocksOptions | undefined,
): TaskLocksOptions | undefined {
  if (!fromFile && !fromPreset) return undefined;
  const merged: Record<string, unknown> = { ...fromFile };
  for (const [name, value] of Object.entries(fromPreset ?? {})) {
    if (value !== undefined) merged[name] = value;
  }
  return merged as TaskLocksOptions;
}

function withCronAwareKey(rules: TaskLocksOptions): ExclusiveOptions<never> {
  const { exclusive: _exclusive, ...options } = rules;
  return { ...options, key: options.key ?? payloadWithoutCron } as ExclusiveOptions<never>;
}

/** Wraps a task's function under its rules on `locks`. */
export function wrapTask(
  locks: Locks,
  taskIdentifier: string,
  task: Task,
  rules: TaskLocksOptions,
): Task {
  if (isExclusive(rules)) return locks.exclusive(taskIdentifier, task, withCronAwareKey(rules));
  const { exclusive: _exclusive, ...options } = rules;
  return locks.unique(taskIdentifier, task, options as UniqueOptions<never>);
}

/** Registers a task's rules without its function (for processes that only enqueue). */
export function defineTask(locks: Locks, taskIdentifier: string, rules: TaskLocksOptions): void {
  if (isExclusive(rules)) {
    locks.define(taskIdentifier, { ...withCronAwareKey(rules), exclusive: true });
  } else {
    const { exclusive: _exclusive, ...options } = rules;
    locks.define(taskIdentifier, { ...(options as UniqueOptions<never>), exclusive: false });
  }
}

/**
 * The advisory keys a job of this task with this payload takes under `rules` (and `worker.locks.defaults`),
 * as the wrapped task computes them; null when the rules are unique only (its jobs take no lock).
 */
export function ruledLockKeys(
  taskIdentifier: string,
  rules: TaskLocksOptions,
  payload: unknown,
  defaults: ExclusiveOptions | undefined,
): bigint[] | null {
  return ruledLimitKeys(taskIdentifier, rules, payload, defaults)?.flatMap((l) => l.slots) ?? null;
}

/** {@link ruledLockKeys} by limit, each with its group (one entry for a task with a single limit). */
export function ruledLimitKeys(
  taskIdentifier: string,
  rules: TaskLocksOptions,
  payload: unknown,
  defaults: ExclusiveOptions | undefined,
): LimitKeys[] | null {
  if (!isExclusive(rules)) return null;
  const resolved = resolveExclusiveOptions(withCronAwareKey(rules) as ExclusiveOptions, defaults);
  return jobLimitKeys(taskIdentifier, resolved, payload);
}

/**
 * The rate key of a job of this task with this payload under `rules` (and `worker.locks.defaults`), as the
 * wrapped task derives it; null without a rate.
 */
export function ruledRateKey(
  taskIdentifier: string,
  rules: TaskLocksOptions,
  payload: unknown,
  defaults: ExclusiveOptions | undefined,
): bigint | null {
  if (!isExclusive(rules)) return null;
  const resolved = resolveExclusiveOptions(withCronAwareKey(rules) as ExclusiveOptions, defaults);
  if (!resolved.rate) return null;
  return rateKeyOf(taskIdentifier, resolved.rate, payload, () =>
    lockKeyValue(taskIdentifier, resolved, payload),
  ).key;
}
