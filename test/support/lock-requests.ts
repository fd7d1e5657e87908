/**
 * Lock requests and marked backends for tests that run the lock statement itself (`batchQuery`,
 * src/session/batch.ts) on a connection of their own, as a lock session would.
 */
import type pg from "pg";
import type { HoldInfo, LockRequest } from "../../src/session/holds.js";
import { CLAIM_BACKEND } from "../../src/sql.js";

/** The hold info of a job that is not `reschedule`. */
export const plainInfo: HoldInfo = { taskIdentifier: "t", jobId: "1", reschedule: false };

/** A request for `slots` (one key, or a semaphore's slots), nobody waiting on its answer. */
export function lockRequest(
  slots: string[],
  info: HoldInfo = plainInfo,
  extra: Partial<LockRequest> = {},
): LockRequest {
  return {
    slots,
    keys: slots.map(BigInt),
    info,
    resolve: () => undefined,
    reject: () => undefined,
    ...extra,
  };
}

/** A request of a job with several limits, each the given slots (the first its line). */
export function stackedRequest(limits: string[][], info: HoldInfo = plainInfo): LockRequest {
  return lockRequest(limits.flat(), info, { limits, lines: limits.map((l) => l[0]!) });
}

/**
 * Marks `client`'s backend with `mark` by the statement a lock session claims its backend with, and answers
 * its pid. Throws if the backend carries another mark.
 */
export async function markBackend(client: pg.Client, mark: string): Promise<number> {
  const { rows } = await client.query<{ pid: number; claimed: boolean }>(CLAIM_BACKEND, [mark]);
  if (!rows[0]!.claimed)
    throw new Error(`backend ${rows[0]!.pid} carries another mark than ${mark}`);
  return rows[0]!.pid;
}
