/**
 * What the rates look like now, read-only: each throttled key's use of its current period and its next
 * free slot, each paused key (for `status`, in the API and the CLI), and why a job of a payload could not
 * start now because of a rate or a pause (the `rate` and `paused` blockers of `canStart`).
 */
import type { Job } from "graphile-worker";
import type { ResolvedExclusiveOptions } from "../options.js";
import { jobLockKeys, lockKeyValue } from "../key.js";
import { rateKeyOf } from "./options.js";
import type { RateStatements } from "./statements.js";

/** Something that runs a query: a pool or a client. */
interface Queryable {
  query<R extends Record<string, unknown>>(text: string, values: unknown[]): Promise<{ rows: R[] }>;
}

/** A throttled key: a start in its current period, or jobs waiting for a slot. */
export interface ThrottledKey {
  rateKey: bigint;
  /** Its readable name: `gwl:v1:rate:<group>:<canonical JSON>`. */
  label: string;
  limit: number;
  /** ms */
  period: number;
  /** Starts in the last `period` (up to now). */
  used: number;
  /** Jobs given back over the rate that wait for their reserved slot. */
  waiting: number;
  /** When the next slot frees for a job that comes now (after the slots reserved by the waiting jobs). */
  nextAt: Date;
}

/** A key paused by a task (`PauseError`), until `until`. */
export interface PausedKey {
  pauseKey: bigint;
  /** Its readable name: a rate key's (`gwl:v1:rate:...`) or a lock key's (`gwl:v1:lock:...`). */
  label: string;
  until: Date;
}

/** Why a job could not start now because of its rate: every slot of the current period is used or reserved. */
export interface RateBlocker {
  kind: "rate";
  /** The rate's group (its task identifier without `rate.group`). */
  group: string;
  rateKey: bigint;
  limit: number;
  period: number;
  used: number;
  waiting: number;
  /** When a job that comes now would start. */
  nextAt: Date;
}

/** Why a job could not start now because its key is paused. */
export interface PausedBlocker {
  kind: "paused";
  pauseKey: bigint;
  until: Date;
}

interface ThrottledRow extends Record<string, unknown> {
  rate_key: string;
  label: string;
  limit: number;
  period: number;
  used: number;
  waiting: number;
  next_at: Date;
  now: Date;
}

/** The throttled keys (all, or those of `keys`) and their `now`, the database's clock. */
export async function readThrottled(
  db: Queryable,
  sql: RateStatements,
  keys: readonly bigint[] | null,
): Promise<Array<ThrottledKey & { now: Date }>> {
  const { rows } = await db.query<ThrottledRow>(sql.throttled, [keys ? keys.map(String) : null]);
  return rows.map((r) => ({
    rateKey: BigInt(r.rate_key),
    label: r.label,
    limit: r.limit,
    period: r.period,
    used: r.used,
    waiting: r.waiting,
    nextAt: r.next_at,
    now: r.now,
  }));
}

/** The keys paused now (all, or those of `keys`). */
export async function readPaused(
  db: Queryable,
  sql: RateStatements,
  keys: readonly bigint[] | null,
): Promise<PausedKey[]> {
  const { rows } = await db.query<{ pause_key: string; label: string; until: Date }>(sql.paused, [
    keys ? keys.map(String) : null,
  ]);
  return rows.map((r) => ({ pauseKey: BigInt(r.pause_key), label: r.label, until: r.until }));
}

/**
 * The rate and pause blockers of a job of `taskIdentifier` with `payload` under `rules`: none when it could
 * start now as far as its rate and pauses go. Advisory: another job may take the slot first.
 */
export async function rateBlockers(
  db: Queryable,
  sql: RateStatements,
  taskIdentifier: string,
  rules: ResolvedExclusiveOptions<never>,
  payload: unknown,
): Promise<Array<RateBlocker | PausedBlocker>> {
  if (!rules.rate && !rules.pausable) return [];
  const lockKey = jobLockKeys(taskIdentifier, rules, payload)[0]!;
  const rate = rules.rate
    ? rateKeyOf(taskIdentifier, rules.rate, payload, () =>
        lockKeyValue(taskIdentifier, rules, payload as Job["payload"]),
      )
    : null;
  const blockers: Array<RateBlocker | PausedBlocker> = [];
  if (rules.pausable) {
    const paused = await readPaused(db, sql, rate ? [rate.key, lockKey] : [lockKey]);
    for (const p of paused) blockers.push({ kind: "paused", pauseKey: p.pauseKey, until: p.until });
  }
  if (rate && rules.rate) {
    const [row] = await readThrottled(db, sql, [rate.key]);
    if (row && row.nextAt > row.now) {
      blockers.push({
        kind: "rate",
        group: rules.rate.group ?? taskIdentifier,
        rateKey: rate.key,
        limit: rules.rate.limit,
        period: rules.rate.period,
        used: row.used,
        waiting: row.waiting,
        nextAt: row.nextAt,
      });
    }
  }
  return blockers;
}
