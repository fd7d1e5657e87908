/**
 * Turns at a rate key within one process: at most one start statement of a key taking turns is in flight
 * from this process, the others wait here, jobs that come for a reserved slot (their copy carries the
 * `gwl:rate` flag) ahead of fresh ones. (The gate sends only fresh jobs' first statements through here.) The statements of a key take turns on the key's row in PostgreSQL anyway; waiting
 * here instead keeps a process's fresh jobs (each only to reserve a later slot) from queueing on that row
 * ahead of a job whose slot has come.
 */

/** The flag rate_start puts on a copy given back over its rate (sql/000004.sql). */
export const RESERVED_FLAG = "gwl:rate";

interface Key {
  busy: boolean;
  reserved: Array<() => void>;
  fresh: Array<() => void>;
}

export class Turns {
  private readonly keys = new Map<string, Key>();

  /** Runs `fn` in its turn at `key`; `reserved`: the job comes for a reserved slot (it goes first). */
  async run<T>(key: string, reserved: boolean, fn: () => Promise<T>): Promise<T> {
    let entry = this.keys.get(key);
    if (!entry) {
      entry = { busy: false, reserved: [], fresh: [] };
      this.keys.set(key, entry);
    }
    if (entry.busy) {
      await new Promise<void>((resolve) => (reserved ? entry.reserved : entry.fresh).push(resolve));
    }
    entry.busy = true;
    try {
      return await fn();
    } finally {
      const next = entry.reserved.shift() ?? entry.fresh.shift();
      if (next) next();
      else {
        entry.busy = false;
        this.keys.delete(key);
      }
    }
  }
}
