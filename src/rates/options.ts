/**
 * The `rate` option of an exclusive task (throttle per key), `lock` and `pausable`: their types, defaults
 * and validation, and the derivation of a job's rate key.
 */
import { InvalidArgumentError } from "../errors.js";
import { callKeyFunction, canonicalJson, hashKey, KEY_VERSION } from "../key.js";

/**
 * At most `limit` starts of a key in any `period`, across every process, on the database's clock: every
 * half-open window [t, t + period) holds at most `limit` starts. A job over the rate goes back to the queue,
 * without an attempt counted, to run when a slot frees, in its order among the key's waiting jobs.
 */
export interface RateOptions<TPayload = unknown> {
  /** How many starts of a key any window of `period` may hold (an integer ≥ 1). */
  limit: number;
  /** The window, in milliseconds (≥ 1). */
  period: number;
  /**
   * What identifies the key the rate counts: the value whose canonical JSON makes it.
   * @defaultValue the task's `key` option (the whole payload without one); `() => null` for one rate per task
   */
  key?: (payload: TPayload) => unknown;
  /** Tasks naming the same group share their rate keys. @defaultValue the task identifier */
  group?: string;
  /**
   * Smoothing: at most `burst` starts in any window of `period × burst / limit` too (an integer from 1 to
   * `limit`). `burst: 1` spaces starts at least `period / limit` apart.
   * @defaultValue `limit` (no constraint beyond the rate's own)
   */
  burst?: number;
}

export interface ResolvedRate {
  limit: number;
  period: number;
  burst: number;
  group: string | null;
  key: ((payload: never) => unknown) | null;
}

/** Checks `rate` (null when not set). Errors name the option (`rate.limit`, ...). */
export function resolveRate(rate: unknown): ResolvedRate | null {
  if (rate === undefined || rate === null) return null;
  if (typeof rate !== "object" || Array.isArray(rate)) {
    throw new InvalidArgumentError(
      `\`rate\` must be an object { limit, period, key?, group?, burst? }, got ${String(rate)}`,
    );
  }
  const known = new Set(["limit", "period", "key", "group", "burst"]);
  for (const name of Object.keys(rate)) {
    if (!known.has(name)) {
      throw new InvalidArgumentError(
        `\`rate\`: unknown option \`${name}\` (known: ${[...known].join(", ")})`,
      );
    }
  }
  const { limit, period, key, group, burst } = rate as RateOptions;
  if (typeof limit !== "number" || !Number.isInteger(limit) || limit < 1) {
    throw new InvalidArgumentError(
      `\`rate.limit\` must be a positive integer, got ${String(limit)}`,
    );
  }
  if (typeof period !== "number" || !Number.isFinite(period) || period < 1) {
    throw new InvalidArgumentError(
      `\`rate.period\` must be a number of milliseconds of at least 1, got ${String(period)}`,
    );
  }
  const b = burst ?? limit;
  if (typeof b !== "number" || !Number.isInteger(b) || b < 1 || b > limit) {
    throw new InvalidArgumentError(
      `\`rate.burst\` must be an integer from 1 to \`rate.limit\` (${limit}), got ${String(burst)}`,
    );
  }
  if (key !== undefined && typeof key !== "function") {
    throw new InvalidArgumentError(
      `\`rate.key\` must be a function of the payload, got ${typeof key}`,
    );
  }
  if (group !== undefined && (typeof group !== "string" || group.length === 0)) {
    throw new InvalidArgumentError(
      `\`rate.group\` must be a non-empty string, got ${String(group)}`,
    );
  }
  return {
    limit,
    period,
    burst: b,
    group: group ?? null,
    key: (key as ((payload: never) => unknown) | undefined) ?? null,
  };
}

/** The readable string a rate key is hashed from: `gwl:v1:rate:<group>:<canonical JSON>`. */
export function rateKeyMaterial(group: string, value: unknown): string {
  return `gwl:${KEY_VERSION}:rate:${group}:${canonicalJson(value, null)}`;
}

/** A rate key and its readable material. */
export interface RateKey {
  key: bigint;
  material: string;
}

/**
 * The rate key of a payload: `rate.key(payload)` (called as `callKeyFunction` does, naming `rate.key`), or
 * `lockValue()` (the task's own key value) without one, in `rate.group` or the task's.
 */
export function rateKeyOf(
  taskIdentifier: string,
  rate: ResolvedRate,
  payload: unknown,
  lockValue: () => unknown,
  jobId?: string,
): RateKey {
  const value = rate.key
    ? callKeyFunction(
        rate.key,
        "rate.key",
        taskIdentifier,
        payload,
        jobId === undefined ? "" : `job ${jobId}: `,
      )
    : lockValue();
  const material = rateKeyMaterial(rate.group ?? taskIdentifier, value);
  return { key: hashKey(material), material };
}
