/**
 * The library's own schema: numbered files in `sql/` (000001.sql, ...), applied in order, each once, in
 * one transaction under a transaction-level advisory lock, so concurrent starts of many workers are safe.
 */
import { readdir, readFile } from "node:fs/promises";
import type { Pool, PoolClient } from "pg";
import { ErrorCodes, LocksError } from "./errors.js";
import { hashKey } from "./key.js";
import { escapeIdentifier } from "./sql.js";

const SQL_DIR = new URL("../sql/", import.meta.url);

export interface MigrateOptions {
  pgPool: Pool;
  /** This library's schema. @defaultValue `"graphile_worker_locks"` */
  schema?: string;
  /** graphile-worker's schema. @defaultValue `"graphile_worker"` */
  workerSchema?: string;
}

interface Migration {
  id: number;
  text: string;
}

const UNDEFINED_TABLE = "42P01";
const INVALID_SCHEMA_NAME = "3F000";

let cachedMigrations: Promise<Migration[]> | undefined;

function loadMigrations(): Promise<Migration[]> {
  cachedMigrations ??= (async () => {
    const files = (await readdir(SQL_DIR)).filter((f) => /^\d{6}\.sql$/.test(f)).sort();
    return Promise.all(
      files.map(async (file) => ({
        id: Number.parseInt(file.slice(0, 6), 10),
        text: await readFile(new URL(file, SQL_DIR), "utf8"),
      })),
    );
  })();
  return cachedMigrations;
}

/** Applies the migrations this database has not had yet. Safe to call concurrently from many processes. */
export async function migrate(options: MigrateOptions): Promise<void> {
  const schema = options.schema ?? "graphile_worker_locks";
  const workerSchema = options.workerSchema ?? "graphile_worker";
  const migrations = await loadMigrations();
  const client = await options.pgPool.connect();
  try {
    await runMigrations(client, migrations, schema, workerSchema);
  } finally {
    client.release();
  }
}

async function runMigrations(
  client: PoolClient,
  migrations: Migration[],
  schema: string,
  workerSchema: string,
): Promise<void> {
  const s = escapeIdentifier(schema);
  // Fast path: everything applied already (the common case on every worker start).
  const latest = await client
    .query<{ latest: number | null }>(`select max(id) as latest from ${s}.migrations`)
    .then((r) => r.rows[0]?.latest ?? 0)
    .catch((error: { code?: string }) => {
      if (error.code === UNDEFINED_TABLE || error.code === INVALID_SCHEMA_NAME) return 0;
      throw error;
    });
  const lastAvailable = migrations.at(-1)?.id ?? 0;
  if (latest >= lastAvailable) return;

  await client.query("begin");
  try {
    await client.query("select pg_advisory_xact_lock($1)", [
      hashKey(`gwl:migrate:${schema}`).toString(),
    ]);
    await client.query(`create schema if not exists ${s}`);
    await client.query(
      `create table if not exists ${s}.migrations (
         id int primary key,
         applied_at timestamptz not null default now()
       )`,
    );
    const { rows: found } = await client.query<{ ok: boolean }>(
      "select to_regclass($1) is not null as ok",
      [`${escapeIdentifier(workerSchema)}._private_jobs`],
    );
    if (!found[0]?.ok) {
      throw new LocksError(
        ErrorCodes.SCHEMA_MISSING,
        `graphile-worker's schema '${workerSchema}' is not installed in this database: run graphile-worker's migrations first (graphile-worker's run(), runMigrations() and makeWorkerUtils() do it)`,
      );
    }
    const { rows } = await client.query<{ id: number }>(`select id from ${s}.migrations`);
    const applied = new Set(rows.map((r) => r.id));
    for (const migration of migrations) {
      if (applied.has(migration.id)) continue;
      const text = migration.text
        .replaceAll(":GWL_SCHEMA", s)
        .replaceAll(":GRAPHILE_WORKER_SCHEMA", escapeIdentifier(workerSchema));
      await client.query(text);
      await client.query(`insert into ${s}.migrations (id) values ($1)`, [migration.id]);
    }
    await client.query("commit");
  } catch (error) {
    await client.query("rollback").catch(() => undefined);
    throw error;
  }
}
