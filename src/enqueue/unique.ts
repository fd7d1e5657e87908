/**
 * Unique jobs: option resolution (task definition, then per-enqueue overrides) and the unique key.
 *
 * The key material is readable and versioned, like the lock key's:
 *
 *     gwl:v1:unique:<JSON group>:<JSON queue name, or *>:<canonical JSON of the key value>
 *
 * and the key is `gwl:u:` + the SHA-256 hex of it, stored as the job's graphile-worker job key, whose unique
 * index then decides every race. The group is the task identifier unless `uniqueGroup` shares keys across
 * tasks; the queue name is part of the key only with `uniqueByQueue` (as Faktory does).
 */
import { InvalidArgumentError } from "../errors.js";
import { KEY_VERSION, callKeyFunction, canonicalJson, sha256Hex } from "../key.js";

const UNIQUE_SCOPES = ["queued", "active", "exists"] as const;
/**
 * How long an existing job refuses a duplicate:
 * - `queued`: until it starts running.
 * - `active`: until it succeeds or fails for good (refused while queued, running, or waiting to retry).
 * - `exists`: while graphile-worker has its row, permanently failed included.
 */
export type UniqueScope = (typeof UNIQUE_SCOPES)[number];

const DUPLICATE_STRATEGIES = ["reject", "raise", "replace"] as const;
/**
 * What an enqueue does when a job with its unique key already refuses it:
 * - `reject`: add nothing; the result carries the existing job and `outcome: "duplicate"`.
 * - `raise`: throw a `UniqueConflictError` carrying the existing job.
 * - `replace`: update the existing job's payload, `runAt` and `priority` if it has not started
 *   (`outcome: "replaced"`); if it has, behave as `reject`.
 */
export type DuplicateStrategy = (typeof DUPLICATE_STRATEGIES)[number];

export interface UniqueOptions<TPayload = unknown> {
  /** The uniqueness scope, or `false` for none (per enqueue: bypasses the task's uniqueness). @defaultValue none */
  unique?: UniqueScope | false;
  /**
   * A window in seconds, counted from the job's `runAt` (so a scheduled delay counts). With a scope it bounds
   * the scope; alone, duplicates are refused until it expires, whatever became of the job. @defaultValue none
   */
  uniqueFor?: number | null;
  /** What identifies a duplicate. @defaultValue the task's `key` option if it is exclusive, else the whole payload */
  uniqueKey?: (payload: TPayload) => unknown;
  /** Shares unique keys across tasks that name the same group. @defaultValue the task identifier */
  uniqueGroup?: string;
  /** Whether the queue name is part of the unique key. @defaultValue `false` */
  uniqueByQueue?: boolean;
  /** @defaultValue `"reject"` */
  onDuplicate?: DuplicateStrategy;
}

/** A resolved enqueue: either no uniqueness, or its key and rules. */
export interface ResolvedUnique {
  key: string;
  scope: UniqueScope | null;
  windowSeconds: number | null;
  onDuplicate: DuplicateStrategy;
}

export function validateUniqueOptions(
  options: UniqueOptions<never> | undefined,
  where: string,
): void {
  if (!options) return;
  const { unique, uniqueFor, uniqueKey, uniqueGroup, uniqueByQueue, onDuplicate } = options;
  if (unique !== undefined && unique !== false && !UNIQUE_SCOPES.includes(unique)) {
    throw new InvalidArgumentError(
      `${where}: \`unique\` must be one of ${UNIQUE_SCOPES.map((s) => `"${s}"`).join(", ")} or false, got ${JSON.stringify(unique)}`,
    );
  }
  if (uniqueFor !== undefined && uniqueFor !== null) {
    if (typeof uniqueFor !== "number" || !Number.isFinite(uniqueFor) || uniqueFor <= 0) {
      throw new InvalidArgumentError(
        `${where}: \`uniqueFor\` must be a positive number of seconds, got ${String(uniqueFor)}`,
      );
    }
  }
  if (uniqueKey !== undefined && typeof uniqueKey !== "function") {
    throw new InvalidArgumentError(
      `${where}: \`uniqueKey\` must be a function of the payload, got ${typeof uniqueKey}`,
    );
  }
  if (uniqueGroup !== undefined && (typeof uniqueGroup !== "string" || uniqueGroup.length === 0)) {
    throw new InvalidArgumentError(
      `${where}: \`uniqueGroup\` must be a non-empty string, got ${String(uniqueGroup)}`,
    );
  }
  if (uniqueByQueue !== undefined && typeof uniqueByQueue !== "boolean") {
    throw new InvalidArgumentError(
      `${where}: \`uniqueByQueue\` must be a boolean, got ${typeof uniqueByQueue}`,
    );
  }
  if (onDuplicate !== undefined && !DUPLICATE_STRATEGIES.includes(onDuplicate)) {
    throw new InvalidArgumentError(
      `${where}: \`onDuplicate\` must be one of ${DUPLICATE_STRATEGIES.map((s) => `"${s}"`).join(", ")}, got ${JSON.stringify(onDuplicate)}`,
    );
  }
}

/** The job key of a unique job. A null `path` skips the JSON check of `value` (the caller made it). */
export function uniqueJobKey(
  group: string,
  value: unknown,
  queueName: string | null,
  path: string | null = "payload",
): string {
  return `gwl:u:${sha256Hex(uniqueKeyMaterial(group, value, queueName, path))}`;
}

export function uniqueKeyMaterial(
  group: string,
  value: unknown,
  queueName: string | null,
  path: string | null = "payload",
): string {
  const queue = queueName === null ? "*" : JSON.stringify(queueName);
  return `gwl:${KEY_VERSION}:unique:${JSON.stringify(group)}:${queue}:${canonicalJson(value, path)}`;
}

/**
 * Merges a task's unique options with an enqueue's, validates them, and derives the key: from `uniqueKey`,
 * else from the value of the exclusive task's `key` (`exclusiveKey`), else from the whole payload. Null when
 * the enqueue is not unique. Throws before anything is written.
 */
export function resolveUnique(
  taskIdentifier: string,
  payload: unknown,
  definition: UniqueOptions<never> | undefined,
  spec:
    | (UniqueOptions<never> & { queueName?: string; jobKey?: string; jobKeyMode?: string })
    | undefined,
  exclusiveKey: { value: unknown } | undefined,
): ResolvedUnique | null {
  validateUniqueOptions(spec, "addJob");
  if (spec?.unique === false) return null;
  const scope = spec?.unique ?? definition?.unique ?? null;
  const windowSeconds =
    spec?.uniqueFor === undefined ? (definition?.uniqueFor ?? null) : spec.uniqueFor;
  if (!scope && windowSeconds === null) return null;
  if (spec?.jobKey !== undefined || spec?.jobKeyMode !== undefined) {
    throw new InvalidArgumentError(
      `addJob: \`jobKey\`/\`jobKeyMode\` cannot be combined with a unique job of '${taskIdentifier}': the unique key is stored as the job key. Pass \`unique: false\` to use your own job key`,
    );
  }
  // The payload, and the value of an exclusive task's `key`, were checked by the caller; what a `uniqueKey`
  // function returns is checked here.
  const uniqueKey = spec?.uniqueKey ?? definition?.uniqueKey;
  const value = uniqueKey
    ? callKeyFunction(uniqueKey, "uniqueKey", taskIdentifier, payload)
    : exclusiveKey
      ? exclusiveKey.value
      : payload;
  const group = spec?.uniqueGroup ?? definition?.uniqueGroup ?? taskIdentifier;
  const byQueue = spec?.uniqueByQueue ?? definition?.uniqueByQueue ?? false;
  return {
    key: uniqueJobKey(group, value, byQueue ? (spec?.queueName ?? null) : null, null),
    scope: scope || null,
    windowSeconds,
    onDuplicate: spec?.onDuplicate ?? definition?.onDuplicate ?? "reject",
  };
}
