/**
 * `locks.canStart`: whether a job of a task with a payload could take its lock now, and if not, which of its
 * limits is full. Advisory and side-effect free: it reads PostgreSQL's lock table (every session's holds,
 * this process's included) and never takes a lock, so the answer may be stale by the time a job runs.
 */
import type { LimitKeys } from "../key.js";
import type { PausedBlocker, RateBlocker } from "../rates/status.js";

/** A limit of the job with no free slot. */
export interface LimitBlocker {
  kind: "limit";
  /** The limit's place in the task's `limits` (0 for a task with a single limit). */
  index: number;
  /** Its key space: its `group`, the task's `lockGroup`, or the task identifier. */
  group: string;
  /** Its key (slot 0), as `pg_locks` and the holder registry show it. */
  lockKey: bigint;
  /** Its number of slots for this key value. */
  limit: number;
  /** How many of them are held. */
  held: number;
}

/** What stops a job from starting now. */
export type Blocker = LimitBlocker | RateBlocker | PausedBlocker;

/** The answer of `canStart`: `ok` when nothing stops the job, else what does. */
export interface CanStartResult {
  ok: boolean;
  blockers: Blocker[];
}

/** The limits of `limits` that are full, given how many slots of each are `held`. */
export function limitBlockers(
  limits: readonly LimitKeys[],
  held: readonly number[],
): LimitBlocker[] {
  const blockers: LimitBlocker[] = [];
  limits.forEach((limit, index) => {
    const count = held[index] ?? 0;
    if (count >= limit.slots.length) {
      blockers.push({
        kind: "limit",
        index,
        group: limit.group,
        lockKey: limit.slots[0]!,
        limit: limit.slots.length,
        held: count,
      });
    }
  });
  return blockers;
}

/** Whether a job whose limits are `limits` could start now (see the module's header). */
export async function canStart(
  limits: readonly LimitKeys[],
  limitsHeld: (limits: readonly LimitKeys[]) => Promise<number[]>,
): Promise<CanStartResult> {
  const blockers = limitBlockers(limits, await limitsHeld(limits));
  return { ok: blockers.length === 0, blockers };
}
