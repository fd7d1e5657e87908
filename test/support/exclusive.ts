/**
 * The shared setup of the exclusive-execution test files: one database per file, worker utilities, and
 * helpers that create locks instances, runners and external holders which are cleaned up after each test
 * (with every job and waiter).
 */
import { makeWorkerUtils, type Runner, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { afterAll, afterEach, beforeAll } from "vitest";
import { makeLocks, type Locks } from "../../src/index.js";
import { useTestDatabase } from "./db.js";
import { quietLogger, startRunner } from "./runner.js";

/** `clear`: more SQL run after each test, once its cleanups ran (e.g. truncating recorded executions). */
export function useExclusiveHarness(clear = "") {
  const db = useTestDatabase();
  const cleanups: Array<() => Promise<unknown>> = [];
  const h = {
    db,
    cleanups,
    /** graphile-worker's utilities on the file's database. */
    utils: undefined as unknown as WorkerUtils,

    newLocks(options: Partial<Parameters<typeof makeLocks>[0]> = {}): Locks {
      const locks = makeLocks({ connectionString: db.url, logger: quietLogger, ...options });
      cleanups.push(() => locks.release());
      return locks;
    },

    async runner(options: Parameters<typeof startRunner>[0]): Promise<Runner> {
      const r = await startRunner(options);
      cleanups.push(() => r.stop());
      return r;
    },

    /** A client on a connection of its own to the file's database, ended after the test. */
    async connect(): Promise<pg.Client> {
      const client = new pg.Client({ connectionString: db.url });
      await client.connect();
      cleanups.push(() => client.end());
      return client;
    },

    /**
     * Calls `sent` with the client of every lock statement sent from now on (only a lock session sends
     * them), until the returned function or the test's end stops it.
     */
    watchLockStatements(sent: (client: pg.Client) => void): () => void {
      const original = pg.Client.prototype.query;
      const stop = () => {
        pg.Client.prototype.query = original;
      };
      cleanups.push(async () => stop());
      pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
        const config = args[0] as { name?: string } | undefined;
        if (typeof config === "object" && config?.name?.startsWith("gwl_lock_")) sent(this);
        return (original as (...a: unknown[]) => unknown).apply(this, args);
      } as typeof original;
      return stop;
    },

    /** Holds an advisory key on a connection of its own, as another process would. */
    async holdExternally(key: bigint): Promise<{ release(): Promise<void> }> {
      const client = new pg.Client({ connectionString: db.url });
      await client.connect();
      await client.query("select pg_advisory_lock($1)", [key.toString()]);
      let done = false;
      const release = async () => {
        if (done) return;
        done = true;
        await client.end();
      };
      cleanups.push(release);
      return { release };
    },

    async jobRows() {
      const { rows } = await db.pool().query<{
        id: string;
        attempts: number;
        max_attempts: number;
        run_at: Date;
        key: string | null;
        last_error: string | null;
        locked_by: string | null;
        payload: unknown;
        priority: number;
        queue_name: string | null;
        flags: Record<string, true> | null;
      }>(
        `select j.id::text, j.attempts, j.max_attempts, j.run_at, j.key, j.last_error, j.locked_by, j.payload,
                j.priority, q.queue_name, j.flags
         from graphile_worker._private_jobs j left join graphile_worker._private_job_queues q on q.id = j.job_queue_id
         order by j.id`,
      );
      return rows;
    },

    /** Marks a job as fetched by a worker, as graphile-worker's fetch would (for SQL-level tests). */
    markFetched: (id: string) =>
      db
        .pool()
        .query(
          "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1 where id = $1",
          [id],
        ),

    /**
     * Parks job `id` behind `key` as a worker's `reschedule` would (fetched, copied with its safety net at
     * `runAt`, the original completed); resolves the copy's id.
     */
    async parkFetched(id: string, key: string, runAt: string): Promise<string> {
      await h.markFetched(id);
      const { rows } = await db
        .pool()
        .query<{ id: string }>(
          "select id::text as id from graphile_worker_locks.park_job($1, $2, $3, interval '0', $2, null)",
          [id, runAt, key],
        );
      await db.pool().query("delete from graphile_worker._private_jobs where id = $1", [id]);
      return rows[0]!.id;
    },

    /** A query on the helper pool (for SQL-level tests). */
    q: <R extends object>(text: string, values: unknown[] = []) =>
      db.pool().query<R & pg.QueryResultRow>(text, values),

    /** How many parked jobs wait for a key. */
    parkedCount: async () =>
      Number(
        (await db.pool().query("select count(*) from graphile_worker_locks.waiters")).rows[0].count,
      ),
  };

  beforeAll(async () => {
    h.utils = await makeWorkerUtils({ connectionString: db.url });
  });
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
    await db
      .pool()
      .query(
        `delete from graphile_worker._private_jobs; delete from graphile_worker_locks.waiters; ${clear}`,
      );
  });
  afterAll(async () => {
    await h.utils?.release();
  });
  return h;
}
