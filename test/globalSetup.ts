/**
 * Starts PostgreSQL (see scripts/postgres.ts) and prepares a template database with graphile-worker's
 * schema, this library's schema and the tables the tests record into. Each test file clones it (see
 * test/support/db.ts), which takes milliseconds.
 */
import { randomBytes } from "node:crypto";
import { Logger, runMigrations } from "graphile-worker";
import pg from "pg";
import type { TestProject } from "vitest/node";
import { databaseUrl, startPostgres } from "../scripts/postgres.js";
import { migrate } from "../src/migrate.js";
import { dropDatabase, withAdmin } from "./support/admin.js";

declare module "vitest" {
  export interface ProvidedContext {
    /** URL of the server (its `postgres` database); for administrative connections. */
    baseUrl: string;
    /** Name of the prepared template database. */
    templateDatabase: string;
  }
}

const TEST_TABLES = `
  create table public.test_executions (
    id bigserial primary key,
    job_id bigint,
    task text,
    lock_key text,
    worker text,
    attempts int,
    started_at timestamptz not null default clock_timestamp(),
    ended_at timestamptz,
    note text
  );
  create table public.test_events (
    id bigserial primary key,
    job_id bigint,
    kind text not null,
    lock_key text,
    worker text,
    at timestamptz not null default clock_timestamp(),
    detail jsonb
  );
`;

/** graphile-worker's logger, quiet except for warnings and errors. */
const quietLogger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") console.warn(`[graphile-worker] ${message}`);
});

/**
 * Runs `start`, failing with its error if something it set off throws asynchronously (an 'error' event of
 * a child process nobody listens to, say). Such an error would otherwise end vitest's process, while it is
 * still in its global setup, with exit code 1 and no message at all.
 */
async function failingLoudly<T>(what: string, start: () => Promise<T>): Promise<T> {
  let onUncaught: ((error: unknown) => void) | undefined;
  const uncaught = new Promise<never>((_resolve, reject) => {
    onUncaught = (error) => reject(new Error(`${what}: ${String(error)}`, { cause: error }));
    process.on("uncaughtException", onUncaught);
  });
  try {
    return await Promise.race([start(), uncaught]);
  } catch (error) {
    console.error(`[test setup] ${(error as Error).message}`);
    throw error;
  } finally {
    process.off("uncaughtException", onUncaught!);
  }
}

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const server = await failingLoudly("PostgreSQL could not be started", () => startPostgres());
  // On a shared server, a unique name keeps parallel runs apart.
  const templateDatabase = process.env.TEST_DATABASE_URL
    ? `gwl_template_${randomBytes(4).toString("hex")}`
    : "gwl_template";
  const teardown = async (): Promise<void> => {
    try {
      await withAdmin(server.url, (admin) => dropDatabase(admin, templateDatabase));
    } finally {
      await server.stop();
    }
  };

  try {
    await withAdmin(server.url, async (admin) => {
      await dropDatabase(admin, templateDatabase);
      await admin.query(`create database ${pg.escapeIdentifier(templateDatabase)}`);
    });
    const url = databaseUrl(server.url, templateDatabase);
    await runMigrations({ connectionString: url, logger: quietLogger });
    const pool = new pg.Pool({ connectionString: url, max: 2, application_name: "gwl-test-setup" });
    pool.on("error", () => undefined);
    try {
      await migrate({ pgPool: pool });
      await pool.query(TEST_TABLES);
    } finally {
      await pool.end();
    }
    // A database with connections cannot serve as a template.
    await withAdmin(server.url, (admin) => closeConnections(admin, templateDatabase));
  } catch (error) {
    await teardown().catch(() => undefined);
    throw error;
  }

  project.provide("baseUrl", server.url);
  project.provide("templateDatabase", templateDatabase);
  return teardown;
}

async function closeConnections(admin: pg.Client, database: string): Promise<void> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const { rows } = await admin.query<{ pid: number }>(
      `select pid, pg_terminate_backend(pid)
         from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()`,
      [database],
    );
    if (rows.length === 0) return;
    if (Date.now() > deadline) {
      throw new Error(`connections to ${database} do not go away: pids ${rows.map((r) => r.pid)}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}
