/**
 * What the lock session knows of supersessions (`supersede`): a superseding enqueue notifies every lock
 * session, at its commit, that the jobs of a key older than the new one are superseded (`gwl_supersede`,
 * sql/000003.sql). The session aborts the holds of such jobs at once (session.ts); this module remembers the
 * notice for a while, so that a job already fetched when the enqueue committed, which takes the key or meets
 * it held only afterwards, is ended as superseded too instead of running or parking ahead of the new job.
 *
 * A notice that does not arrive (the session was reconnecting when it was sent, so it holds nothing the
 * notice was about) stops nothing: the new job waits its turn in the key's line, as any `reschedule` job.
 */

/** How long a notice is remembered: longer than any fetched job takes to reach its key. */
const REMEMBER_MS = 60_000;

export interface SupersedeNotice {
  /** The key (slot 0 of the task's key), as text. */
  key: string;
  /** The superseding job's id: the key's jobs with a lower id are superseded. */
  by: bigint;
}

/** Reads a notification's payload (`<key>:<job id>`); null when it is not one. */
export function parseSupersedeNotice(payload: string): SupersedeNotice | null {
  const match = /^(-?\d+):(\d+)$/.exec(payload);
  return match ? { key: match[1]!, by: BigInt(match[2]!) } : null;
}

export class Supersessions {
  /** The newest superseding job of each key noticed, and when (`performance.now()`), oldest notice first. */
  private readonly byKey = new Map<string, { by: bigint; at: number }>();

  record(notice: SupersedeNotice): void {
    const now = performance.now();
    const known = this.byKey.get(notice.key);
    this.byKey.delete(notice.key);
    this.byKey.set(notice.key, {
      by: known && known.by > notice.by ? known.by : notice.by,
      at: now,
    });
    for (const [key, entry] of this.byKey) {
      if (now - entry.at < REMEMBER_MS) break;
      this.byKey.delete(key);
    }
  }

  /** The id of the job that superseded job `jobId` of `key`, if a notice said so lately; else null. */
  supersededBy(key: string, jobId: string): string | null {
    if (this.byKey.size === 0) return null;
    const entry = this.byKey.get(key);
    if (!entry || performance.now() - entry.at >= REMEMBER_MS) return null;
    return BigInt(jobId) < entry.by ? entry.by.toString() : null;
  }
}
