/**
 * Canonical key derivation (pure). A key is derived from a readable, versioned string
 *
 *     gwl:v1:<kind>:<key space>:<canonical JSON>
 *
 * where the key space is the task identifier, or the group that several tasks share (`lockGroup`, a
 * limit's `group`, `uniqueGroup`), so that their key values meet.
 * hashed with SHA-256; the first 8 bytes, read as a signed big-endian integer, are the bigint that
 * PostgreSQL's advisory lock functions take. Changing any part of this derivation changes every key in a
 * running system, so the version is part of the string and the tests pin known values.
 *
 * The canonical JSON is `fast-json-stable-stringify` of the value (object keys sorted). Before that, the
 * value is checked so that what the worker later receives from PostgreSQL yields the same key: values that
 * JSON cannot carry faithfully are rejected with an error naming their path.
 */
import * as crypto from "node:crypto";
import stringify from "fast-json-stable-stringify";
import { InvalidArgumentError } from "./errors.js";

/** The derivation version; part of every key's material. */
export const KEY_VERSION = "v1";

function describePath(root: string, segments: ReadonlyArray<string | number>): string {
  let path = root;
  for (const key of segments) {
    if (typeof key === "number") path += `[${key}]`;
    else path += /^[A-Za-z_$][\w$]*$/.test(key) ? `.${key}` : `[${JSON.stringify(key)}]`;
  }
  return path;
}

/**
 * Throws an {@link InvalidArgumentError} naming the first place in `value` that JSON cannot carry
 * faithfully: BigInt, functions, symbols, non-finite numbers, `undefined` inside arrays or at the top, and
 * cycles. `undefined` object properties are allowed: JSON drops them, and so does the key.
 */
export function assertJsonSafe(value: unknown, path = "payload"): void {
  // Paths are only spelled out when something is wrong: this runs on every enqueue.
  const segments: Array<string | number> = [];
  const ancestors: object[] = [];
  const fail = (what: string): never => {
    throw new InvalidArgumentError(`${describePath(path, segments)} ${what}`);
  };
  const visit = (input: unknown, inObject: boolean): void => {
    let node = input;
    if (
      node !== null &&
      typeof node === "object" &&
      typeof (node as { toJSON?: unknown }).toJSON === "function"
    ) {
      node = (node as { toJSON: () => unknown }).toJSON();
    }
    switch (typeof node) {
      case "string":
      case "boolean":
        return;
      case "number":
        if (!Number.isFinite(node))
          fail(`is ${node}, which JSON cannot carry (it would become null)`);
        return;
      case "undefined":
        if (!inObject) fail("is undefined, which JSON cannot carry (it would become null)");
        return;
      case "bigint":
        return fail("is a BigInt, which JSON cannot carry; convert it to a string");
      case "function":
        return fail("is a function, which JSON cannot carry");
      case "symbol":
        return fail("is a symbol, which JSON cannot carry");
      case "object": {
        if (node === null) return;
        if (ancestors.includes(node)) fail("is a circular reference, which JSON cannot carry");
        ancestors.push(node);
        if (Array.isArray(node)) {
          for (let i = 0; i < node.length; i++) {
            segments.push(i);
            visit(node[i], false);
            segments.pop();
          }
        } else {
          for (const key of Object.keys(node)) {
            segments.push(key);
            visit((node as Record<string, unknown>)[key], true);
            segments.pop();
          }
        }
        ancestors.pop();
        return;
      }
    }
  };
  visit(value, false);
}

/** Sorted-keys JSON of `value`, after {@link assertJsonSafe} (skipped with a null path: already checked). */
export function canonicalJson(value: unknown, path: string | null = "payload"): string {
  if (path !== null) assertJsonSafe(value, path);
  return stringify(value);
}

/** Throws an {@link InvalidArgumentError} unless `taskIdentifier` is a string with something besides whitespace. */
export function assertIdentifier(taskIdentifier: unknown): asserts taskIdentifier is string {
  if (typeof taskIdentifier !== "string" || taskIdentifier.trim().length === 0) {
    throw new InvalidArgumentError(
      `\`taskIdentifier\` must be a non-empty string that is not only whitespace, got ${JSON.stringify(taskIdentifier) ?? String(taskIdentifier)}`,
    );
  }
}

/** The options whose functions turn a payload into a key, as errors name them. */
export type KeyFunctionName = "key" | "uniqueKey" | "enqueueRate.key" | "debounce.key" | "rate.key";

/**
 * Calls a task's `key` or `uniqueKey` function on a payload and checks that JSON can carry what it returns.
 * A function that throws, or returns such a value, is an {@link InvalidArgumentError} naming the task and
 * the function, after `context` (such as `job 42: `), with the original error as its `cause`.
 */
export function callKeyFunction(
  fn: (payload: never) => unknown,
  name: KeyFunctionName,
  taskIdentifier: string,
  payload: unknown,
  context = "",
): unknown {
  const fail = (what: string, error: unknown): never => {
    throw new InvalidArgumentError(
      `${context}\`${name}\` of task '${taskIdentifier}' ${what}: ${error instanceof Error ? error.message : String(error)}`,
      { cause: error },
    );
  };
  let value: unknown;
  try {
    value = fn(payload as never);
  } catch (error) {
    fail("threw", error);
  }
  try {
    assertJsonSafe(value, `${name}(payload)`);
  } catch (error) {
    fail("returned a value JSON cannot carry", error);
  }
  return value;
}

/**
 * The readable string a lock key is hashed from, in the key space `taskIdentifier` (a task identifier, or a
 * lock group). Exposed for debugging and documentation.
 */
export function lockKeyMaterial(
  taskIdentifier: string,
  value: unknown,
  path: string | null = "payload",
): string {
  assertIdentifier(taskIdentifier);
  return `gwl:${KEY_VERSION}:lock:${taskIdentifier}:${canonicalJson(value, path)}`;
}

/** `crypto.hash` (Node.js 20.12 and later): the same digest without a Hash object, faster (see bench/README.md, section "Key digest"). */
const oneShotHash = (
  crypto as { hash?: (algorithm: string, data: string, encoding: "binary" | "hex") => string }
).hash;

/**
 * SHA-256 of `material` (as UTF-8), as a string: hex, or "binary" (latin1: one character per byte).
 * Strings, not a Buffer: a Buffer's memory is allocated outside the JavaScript heap, which made the digest
 * cost more and gave the garbage collector more to do, on every job (see bench/README.md, section "Key
 * digest").
 */
function sha256(material: string, encoding: "binary" | "hex"): string {
  return oneShotHash
    ? oneShotHash("sha256", material, encoding)
    : crypto.createHash("sha256").update(material, "utf8").digest(encoding);
}

/**
 * The advisory lock key of a task identifier and payload (or whatever the task's `key` option returns).
 *
 * @example lockKey("charge_card", { userId: 1 }) // a signed 64-bit bigint
 */
export function lockKey(taskIdentifier: string, value: unknown): bigint {
  return hashKey(lockKeyMaterial(taskIdentifier, value));
}

/**
 * The advisory keys of a semaphore of `limit` slots. Slot 0 is {@link lockKey} itself, so raising a limit
 * from 1 keeps the key of the first slot.
 */
export function slotKeys(
  taskIdentifier: string,
  value: unknown,
  limit: number,
  path: string | null = "payload",
): bigint[] {
  const material = lockKeyMaterial(taskIdentifier, value, path);
  const keys = [hashKey(material)];
  for (let slot = 1; slot < limit; slot++) keys.push(hashKey(`${material}#slot:${slot}`));
  return keys;
}

/** A limit that depends on the key: how many jobs of a key value may run at once. */
export type LimitFunction = (keyValue: never) => number;

/** One limit of a task: its key function, its number of slots (or a function of the key value), its group. */
export interface LimitRule {
  key(payload: never): unknown;
  /** `"payload"` when the key is the payload itself, else `"key(payload)"`. */
  keyPath: string;
  limit: number | LimitFunction;
  /** The key space its keys are derived in. @defaultValue the task identifier */
  group?: string | undefined;
}

/**
 * What derives a task's lock keys: its resolved `exclusive` options (`key`, `keyPath`, `limit`,
 * `lockGroup`), and with several limits (`limits`, two or more) each one's rules instead.
 */
export interface KeyRules {
  key(payload: never): unknown;
  /** `"payload"` when the key is the payload itself, else `"key(payload)"`. */
  keyPath: string;
  limit: number | LimitFunction;
  /** The key space of the task's keys. @defaultValue the task identifier */
  lockGroup?: string | undefined;
  /** Two or more limits, each taken by every job (all or nothing); null for the single limit above. */
  limits?: readonly LimitRule[] | null;
}

/**
 * The number of slots of a key value: `limit` itself, or what the limit function returns for the value. A
 * function that throws or returns anything but a positive integer is an {@link InvalidArgumentError} naming
 * `option` (`limit`, `limits[1].limit`) and the task, after `context` (such as `job 42: `).
 */
export function resolveLimit(
  limit: number | LimitFunction,
  taskIdentifier: string,
  keyValue: unknown,
  option = "limit",
  context = "",
): number {
  if (typeof limit === "number") return limit;
  let value: unknown;
  try {
    value = limit(keyValue as never);
  } catch (error) {
    throw new InvalidArgumentError(
      `${context}\`${option}\` of task '${taskIdentifier}' threw for key ${canonicalJson(keyValue, null)}: ${error instanceof Error ? error.message : String(error)}`,
      { cause: error },
    );
  }
  if (typeof value !== "number" || !Number.isInteger(value) || value < 1) {
    throw new InvalidArgumentError(
      `${context}\`${option}\` of task '${taskIdentifier}' must return a positive integer, got ${String(value)} for key ${canonicalJson(keyValue, null)}`,
    );
  }
  return value;
}

/**
 * What a job's lock keys are derived from under `rules`: the payload itself, or what the task's `key`
 * returns, called through {@link callKeyFunction} (a failure names the task, after `job <jobId>: ` when
 * `jobId` is given). The payload is checked as JSON-safe unless `trusted` (already checked, or read back
 * from PostgreSQL's JSON).
 */
export function lockKeyValue(
  taskIdentifier: string,
  rules: Pick<KeyRules, "key" | "keyPath">,
  payload: unknown,
  jobId?: string,
  trusted = false,
): unknown {
  if (rules.keyPath !== "payload") {
    const context = jobId === undefined ? "" : `job ${jobId}: `;
    return callKeyFunction(rules.key, "key", taskIdentifier, payload, context);
  }
  if (!trusted) assertJsonSafe(payload);
  return payload;
}

/**
 * The lock keys (semaphore slots, {@link slotKeys}) of a job of `taskIdentifier` with `payload` under
 * `rules`, in the task's lock group: the one derivation the task wrapper, the enqueuer and the CLI share. See
 * {@link lockKeyValue}. With several limits, the slots of the first ({@link jobLimitKeys} has them all).
 */
export function jobLockKeys(
  taskIdentifier: string,
  rules: KeyRules,
  payload: unknown,
  jobId?: string,
  trusted = false,
): bigint[] {
  if (rules.limits) return jobLimitKeys(taskIdentifier, rules, payload, jobId, trusted)[0]!.slots;
  const value = lockKeyValue(taskIdentifier, rules, payload, jobId, trusted);
  const context = jobId === undefined ? "" : `job ${jobId}: `;
  const limit = resolveLimit(rules.limit, taskIdentifier, value, "limit", context);
  return slotKeys(rules.lockGroup ?? taskIdentifier, value, limit, null);
}

/** The keys of one limit of a job: its group, and its slots (slot 0 first, whose line waiting jobs join). */
export interface LimitKeys {
  group: string;
  slots: bigint[];
}

/**
 * Every limit's keys of a job under `rules` (one entry for a single limit). Two limits of one job whose keys
 * would meet (same group and key value) are refused with an {@link InvalidArgumentError}: the job would wait
 * for itself.
 */
export function jobLimitKeys(
  taskIdentifier: string,
  rules: KeyRules,
  payload: unknown,
  jobId?: string,
  trusted = false,
): LimitKeys[] {
  if (!rules.limits) {
    return [
      {
        group: rules.lockGroup ?? taskIdentifier,
        slots: jobLockKeys(taskIdentifier, rules, payload, jobId, trusted),
      },
    ];
  }
  if (!trusted) assertJsonSafe(payload);
  const context = jobId === undefined ? "" : `job ${jobId}: `;
  const seen = new Map<string, number>();
  return rules.limits.map((rule, index) => {
    const value = lockKeyValue(taskIdentifier, rule, payload, jobId, true);
    const option = `limits[${index}].limit`;
    const limit = resolveLimit(rule.limit, taskIdentifier, value, option, context);
    const group = rule.group ?? taskIdentifier;
    const material = lockKeyMaterial(group, value, null);
    const before = seen.get(material);
    if (before !== undefined) {
      throw new InvalidArgumentError(
        `${context}\`limits[${before}]\` and \`limits[${index}]\` of task '${taskIdentifier}' give the same key (${material}): give the limits different groups`,
      );
    }
    seen.set(material, index);
    const slots = [hashKey(material)];
    for (let slot = 1; slot < limit; slot++) slots.push(hashKey(`${material}#slot:${slot}`));
    return { group, slots };
  });
}

/**
 * The graphile-worker job flag naming a job's lock key. Jobs of a `reschedule` task enqueued through the
 * library carry it, so that a runner given `forbiddenFlags: locks.forbiddenFlags` skips them while their key
 * is held in its process.
 */
export function lockFlag(key: bigint | string): string {
  return `gwl:lock:${key}`;
}

/**
 * The job flag naming the first slot of a job's key when `lockFlag` cannot be used: the jobs of a
 * `reschedule` task whose key has several slots, or that has several limits (its first limit's first slot).
 * A runner does not skip them (another slot may be free); a superseding enqueue finds them by it
 * (`supersede` in sql/000003.sql).
 */
export function keyFlag(key: bigint | string): string {
  return `gwl:key:${key}`;
}

/**
 * How PostgreSQL shows a one-bigint advisory lock in `pg_locks`: the high 32 bits in `classid`, the low 32
 * bits in `objid` (both unsigned), with `objsubid = 1`.
 */
export function advisoryParts(key: bigint): { classid: number; objid: number } {
  const unsigned = BigInt.asUintN(64, key);
  return { classid: Number(unsigned >> 32n), objid: Number(unsigned & 0xffffffffn) };
}

/** SHA-256 of `material` as lowercase hex. */
export function sha256Hex(material: string): string {
  return sha256(material, "hex");
}

/** SHA-256 of `material`, first 8 bytes (big-endian) as a signed 64-bit integer. */
export function hashKey(material: string): bigint {
  const d = sha256(material, "binary");
  const high =
    (d.charCodeAt(0) << 24) | (d.charCodeAt(1) << 16) | (d.charCodeAt(2) << 8) | d.charCodeAt(3);
  const low =
    ((d.charCodeAt(4) << 24) |
      (d.charCodeAt(5) << 16) |
      (d.charCodeAt(6) << 8) |
      d.charCodeAt(7)) >>>
    0;
  // (`high` is signed, so the result is too: two's complement, as readBigInt64BE reads it)
  return (BigInt(high) << 32n) | BigInt(low);
}
