/**
 * Rate-limited and debounced enqueues: option resolution (task definition, then the enqueue's own, which
 * replaces it whole) and their keys. The options and their validation are options.ts's; the rules
 * themselves, and their serialization per key, are sql/000005.sql's.
 *
 * The key material is readable and versioned, like the unique key's:
 *
 *     gwl:v1:enqueue-rate:<JSON group>:<canonical JSON of the key value>
 *     gwl:v1:debounce:<JSON group>:<canonical JSON of the key value>
 *
 * and the key is `gwl:r:` (rate) or `gwl:d:` (debounce) + the SHA-256 hex of it. The group is the task
 * identifier unless `group` shares keys across tasks; the value is what the option's `key` returns, else
 * the value of the exclusive task's `key`, else the whole payload.
 */
import { InvalidArgumentError } from "../errors.js";
import { KEY_VERSION, callKeyFunction, canonicalJson, sha256Hex } from "../key.js";
import {
  assertDebounceAlone,
  type DebounceOptions,
  type EnqueueRateOptions,
  type UniqueOptions,
} from "../options.js";
import type { TaskSpec } from "graphile-worker";

/** A rate-limited enqueue, resolved. */
export interface ResolvedRate {
  key: string;
  limit: number;
  periodMs: number;
}

/** A debounced enqueue, resolved. */
export interface ResolvedDebounce {
  key: string;
  delayMs: number;
  maxWaitMs: number;
  leading: boolean;
}

export interface ResolvedLimits {
  rate: ResolvedRate | null;
  debounce: ResolvedDebounce | null;
}

/**
 * The readable string an `enqueueRate` key is hashed from. A null `path` skips the JSON check of `value`
 * (the caller made it).
 */
export function enqueueRateKeyMaterial(
  group: string,
  value: unknown,
  path: string | null = "value",
): string {
  return `gwl:${KEY_VERSION}:enqueue-rate:${JSON.stringify(group)}:${canonicalJson(value, path)}`;
}

/** The readable string a `debounce` key is hashed from; `path` as for {@link enqueueRateKeyMaterial}. */
export function debounceKeyMaterial(
  group: string,
  value: unknown,
  path: string | null = "value",
): string {
  return `gwl:${KEY_VERSION}:debounce:${JSON.stringify(group)}:${canonicalJson(value, path)}`;
}

/** The key of an `enqueueRate` group (the task identifier by default) and key value. */
export function enqueueRateKey(
  group: string,
  value: unknown,
  path: string | null = "value",
): string {
  return `gwl:r:${sha256Hex(enqueueRateKeyMaterial(group, value, path))}`;
}

/** The key of a `debounce` group (the task identifier by default) and key value. */
export function debounceKey(group: string, value: unknown, path: string | null = "value"): string {
  return `gwl:d:${sha256Hex(debounceKeyMaterial(group, value, path))}`;
}

/** The value a key is derived from: the option's `key`, else the exclusive task's key value, else the payload. */
function keyValue(
  option: { key?: (payload: never) => unknown },
  name: "enqueueRate.key" | "debounce.key",
  taskIdentifier: string,
  payload: unknown,
  exclusiveKey: { value: unknown } | undefined,
): unknown {
  if (option.key) return callKeyFunction(option.key, name, taskIdentifier, payload);
  return exclusiveKey ? exclusiveKey.value : payload;
}

/**
 * Merges a task's `enqueueRate` and `debounce` with an enqueue's (an enqueue's option replaces the task's,
 * `false` bypasses it), checks what they cannot be combined with, and derives the keys. The payload and the
 * exclusive key value were checked by the caller; the options, by validateUniqueOptions. Throws before
 * anything is written.
 */
export function resolveLimits(
  taskIdentifier: string,
  payload: unknown,
  definition: UniqueOptions<never> | undefined,
  spec: (UniqueOptions<never> & TaskSpec) | undefined,
  exclusiveKey: { value: unknown } | undefined,
  unique: boolean,
): ResolvedLimits {
  const rate: EnqueueRateOptions<never> | false | undefined =
    spec?.enqueueRate !== undefined ? spec.enqueueRate : definition?.enqueueRate;
  const debounce: DebounceOptions<never> | false | undefined =
    spec?.debounce !== undefined ? spec.debounce : definition?.debounce;
  if (!rate && !debounce) return { rate: null, debounce: null };
  const where = `addJob of '${taskIdentifier}'`;
  const customKey = spec?.jobKey !== undefined || spec?.jobKeyMode !== undefined;
  if (customKey) {
    throw new InvalidArgumentError(
      `${where}: \`jobKey\`/\`jobKeyMode\` cannot be combined with \`${rate ? "enqueueRate" : "debounce"}\`; pass \`${rate ? "enqueueRate" : "debounce"}: false\` to use your own job key`,
    );
  }
  if (debounce) {
    assertDebounceAlone(
      { debounce, enqueueRate: rate, unique: unique ? "queued" : undefined },
      where,
    );
    if (spec?.runAt !== undefined) {
      throw new InvalidArgumentError(
        `${where}: \`runAt\` cannot be combined with \`debounce\` (the debounce decides when the job runs)`,
      );
    }
  }
  return {
    rate: rate
      ? {
          key: enqueueRateKey(
            rate.group ?? taskIdentifier,
            keyValue(rate, "enqueueRate.key", taskIdentifier, payload, exclusiveKey),
            null,
          ),
          limit: rate.limit,
          periodMs: rate.period,
        }
      : null,
    debounce: debounce
      ? {
          key: debounceKey(
            debounce.group ?? taskIdentifier,
            keyValue(debounce, "debounce.key", taskIdentifier, payload, exclusiveKey),
            null,
          ),
          delayMs: debounce.delay,
          maxWaitMs: debounce.maxWait,
          leading: debounce.leading ?? false,
        }
      : null,
  };
}
