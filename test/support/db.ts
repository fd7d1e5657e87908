/**
 * A fresh database per test file, cloned from the template test/globalSetup.ts prepares, and checked for
 * leaked advisory locks and lock-session connections when the file is done.
 */
import { randomBytes } from "node:crypto";
import pg from "pg";
import { afterAll, beforeAll, expect, inject } from "vitest";
import { databaseUrl } from "../../scripts/postgres.js";
import { dropDatabase, withAdmin as withServerAdmin } from "./admin.js";

export interface TestDatabase {
  /** Connection URL of this file's database (available from `beforeAll` on). */
  readonly url: string;
  /** A pool (max 10) to this file's database, created on first use, closed after the file. */
  pool(): pg.Pool;
}

/** Application names of the connections this library opens start with this. */
const LIBRARY_APPLICATION_NAME = "graphile-worker-locks";
const LEAK_CHECK_MS = 3_000;

export function useTestDatabase(): TestDatabase {
  const name = `gwl_t_${randomBytes(6).toString("hex")}`;
  let url: string | undefined;
  let helperPool: pg.Pool | undefined;

  beforeAll(async () => {
    url = await createDatabase(name);
  });

  afterAll(async () => {
    if (url === undefined) return;
    try {
      const leaks = await withAdmin(async (admin) => {
        const deadline = Date.now() + LEAK_CHECK_MS;
        for (;;) {
          const found = await findLeaks(admin, name);
          if (found.length === 0 || Date.now() >= deadline) return found;
          await sleep(100);
        }
      });
      expect(leaks, `leaked from database ${name}:\n${leaks.join("\n")}`).toEqual([]);
    } finally {
      // pool.end() waits for clients a test never released: do not wait for it forever.
      const ended = helperPool?.end().catch(() => undefined);
      helperPool = undefined;
      await withAdmin(async (admin) => {
        await Promise.race([ended, sleep(1_000)]);
        await dropDatabase(admin, name);
      });
    }
  });

  return {
    get url(): string {
      if (url === undefined) {
        throw new Error("useTestDatabase(): the database exists from beforeAll on");
      }
      return url;
    },
    pool(): pg.Pool {
      if (!helperPool) {
        helperPool = new pg.Pool({
          connectionString: this.url,
          max: 10,
          application_name: "gwl-test-helper",
        });
        // Backends terminated at the end of the file (even under a client a test never released) must
        // not crash the worker with an unhandled 'error' event.
        helperPool.on("error", () => undefined);
        helperPool.on("connect", (client) => client.on("error", () => undefined));
      }
      return helperPool;
    },
  };
}

/** Creates database `name` from the template and returns its URL. */
async function createDatabase(name: string): Promise<string> {
  const template = inject("templateDatabase");
  await withAdmin(async (admin) => {
    for (let attempt = 1; ; attempt++) {
      try {
        await admin.query(
          `create database ${pg.escapeIdentifier(name)} template ${pg.escapeIdentifier(template)}`,
        );
        return;
      } catch (error) {
        // 55006: "source database ... is being accessed by other users"
        const busy =
          (error as { code?: string }).code === "55006" ||
          String((error as Error).message).includes("is being accessed by other users");
        if (!busy || attempt >= 10) throw error;
        await sleep(100 * attempt);
      }
    }
  });
  return databaseUrl(inject("baseUrl"), name);
}

/**
 * A database of its own for one test (created from the template, as a file's is), and its removal. For
 * what must start from nothing, such as a documentation snippet run as written.
 */
export async function freshDatabase(): Promise<{ url: string; drop(): Promise<void> }> {
  const name = `gwl_t_${randomBytes(6).toString("hex")}`;
  const url = await createDatabase(name);
  return { url, drop: () => withAdmin((admin) => dropDatabase(admin, name)) };
}

/** Advisory locks held in the database, and library connections still connected to it, as text. */
async function findLeaks(admin: pg.Client, database: string): Promise<string[]> {
  const locks = await admin.query<{
    pid: number;
    key: string;
    mode: string;
    granted: boolean;
    application_name: string | null;
  }>(
    `select l.pid, l.mode, l.granted,
            case l.objsubid
              when 1 then 'key ' || ((l.classid::int8 << 32) | l.objid::int8)
              else 'keys (' || l.classid || ', ' || l.objid || ')'
            end as key,
            a.application_name
       from pg_locks l left join pg_stat_activity a on a.pid = l.pid
      where l.locktype = 'advisory'
        and l.database = (select oid from pg_database where datname = $1)
      order by l.pid, l.classid, l.objid`,
    [database],
  );
  const sessions = await admin.query<{
    pid: number;
    application_name: string;
    state: string | null;
    query: string | null;
  }>(
    `select pid, application_name, state, left(query, 200) as query
       from pg_stat_activity
      where datname = $1 and starts_with(application_name, $2)
      order by pid`,
    [database, LIBRARY_APPLICATION_NAME],
  );
  return [
    ...locks.rows.map(
      (r) =>
        `advisory lock ${r.key} ${r.mode}${r.granted ? "" : " (waiting)"}` +
        ` held by pid ${r.pid} (${r.application_name ?? "unknown application"})`,
    ),
    ...sessions.rows.map(
      (r) =>
        `connection pid ${r.pid} "${r.application_name}" still open (${r.state ?? "?"}: ${r.query ?? ""})`,
    ),
  ];
}

function withAdmin<T>(fn: (client: pg.Client) => Promise<T>): Promise<T> {
  return withServerAdmin(inject("baseUrl"), fn);
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

export interface WaitForOptions {
  /** @defaultValue 20000 */
  timeoutMs?: number;
  /** @defaultValue 20 */
  intervalMs?: number;
  /** What is being waited for; named in the timeout error. */
  message?: string;
}

/** Calls `fn` every `intervalMs` until it returns something truthy, and returns that. Errors propagate. */
export async function waitFor<T>(
  fn: () => Promise<T | undefined | null | false>,
  { timeoutMs = 20_000, intervalMs = 20, message = "condition" }: WaitForOptions = {},
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await fn();
    if (value) return value;
    if (Date.now() >= deadline)
      throw new Error(`waitFor: timed out after ${timeoutMs} ms: ${message}`);
    await sleep(intervalMs);
  }
}

/** Waits until graphile-worker's queue (`graphile_worker.jobs`, as `pool` sees it) holds no job. */
export async function waitForNoJobs(
  pool: pg.Pool,
  { timeoutMs, message = "all jobs to finish" }: { timeoutMs: number; message?: string },
): Promise<void> {
  await waitFor(
    async () =>
      (await pool.query<{ n: number }>("select count(*)::int as n from graphile_worker.jobs"))
        .rows[0]!.n === 0,
    { timeoutMs, message },
  );
}

export interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T | PromiseLike<T>): void;
  reject(reason?: unknown): void;
}

export function deferred<T = void>(): Deferred<T> {
  let resolve!: (value: T | PromiseLike<T>) => void;
  let reject!: (reason?: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}
