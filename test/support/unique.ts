/**
 * The shared setup of the unique-job test files: one database per file, worker utilities, one locks
 * instance, and clients cleaned up after each test (with every job and unique window).
 */
import { makeWorkerUtils, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { afterAll, afterEach, beforeAll } from "vitest";
import { makeLocks, type Locks } from "../../src/index.js";
import { useTestDatabase, waitFor } from "./db.js";
import { quietLogger } from "./runner.js";

export function useUniqueHarness() {
  const db = useTestDatabase();
  const cleanups: Array<() => Promise<unknown>> = [];
  const h = {
    db,
    cleanups,
    /** graphile-worker's utilities on the file's database. */
    utils: undefined as unknown as WorkerUtils,
    /** The file's locks instance. */
    locks: undefined as unknown as Locks,

    /** A connection of its own, closed after the test. */
    async client(): Promise<pg.Client> {
      const c = new pg.Client({ connectionString: db.url });
      await c.connect();
      cleanups.push(() => c.end());
      return c;
    },

    async jobCount(where = "true"): Promise<number> {
      const { rows } = await db
        .pool()
        .query<{ n: number }>(`select count(*)::int as n from graphile_worker.jobs where ${where}`);
      return rows[0]!.n;
    },

    /** Waits until `pid` is blocked on a lock (so a race is really happening, not just sequential calls). */
    async blocked(pid: number): Promise<void> {
      await waitFor(
        async () => {
          const { rows } = await db
            .pool()
            .query("select 1 from pg_locks where pid = $1 and not granted", [pid]);
          return rows.length > 0;
        },
        { message: `backend ${pid} to wait on a lock` },
      );
    },

    pidOf: (c: pg.Client) => (c as unknown as { processID: number }).processID,
  };

  beforeAll(async () => {
    h.utils = await makeWorkerUtils({ connectionString: db.url, logger: quietLogger });
    h.locks = makeLocks({ connectionString: db.url, logger: quietLogger });
  });
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
    await db
      .pool()
      .query(
        "delete from graphile_worker._private_jobs; delete from graphile_worker_locks.unique_windows",
      );
  });
  afterAll(async () => {
    await h.locks?.release();
    await h.utils?.release();
  });
  return h;
}
