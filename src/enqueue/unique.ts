/**
 * Unique jobs: option resolution (task definition, then per-enqueue overrides) and the unique key. The
 * options themselves, and their validation, are options.ts's.
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
import {
  validateUniqueOptions,
  type DuplicateStrategy,
  type UniqueOptions,
  type UniqueScope,
} from "../options.js";

// (the enqueue path's modules take the unique option types from here, beside their resolution)
export type { DuplicateStrategy, UniqueOptions, UniqueScope } from "../options.js";

/** A resolved enqueue: either no uniqueness, or its key and rules. */
export interface ResolvedUnique {
  key: string;
  scope: UniqueScope | null;
  windowSeconds: number | null;
  onDuplicate: DuplicateStrategy;
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
