/**
 * The library's own schema: numbered files in `sql/` (000001.sql, ...), applied in order, each once, in
 * one transaction under a transaction-level advisory lock, so concurrent starts of many workers are safe.
 *
 * Before anything else it checks graphile-worker's schema: that it is installed, and that its migration
 * level is one this library was tested with. The library reads and writes graphile-worker's private job
 * table (`_private_jobs`, not public API) in its enqueue functions (`enqueue_job` and `enqueue_jobs`) and
 * in the `reschedule` strategy (`reschedule_job`, all in sql/000001.sql), and every entry point of `makeLocks` migrates, and so checks, before its first statement.
 */
import { readdir, readFile } from "node:fs/promises";
import type { Pool, PoolClient } from "pg";
import { ErrorCodes, LocksError, UntestedWorkerSchemaError } from "./errors.js";
import { hashKey } from "./key.js";
import { assertSchemaName, escapeIdentifier } from "./sql.js";

const SQL_DIR = new URL("../sql/", import.meta.url);

export interface MigrateOptions {
  pgPool: Pool;
  /** This library's schema. @defaultValue `"graphile_worker_locks"` */
  schema?: string;
  /** graphile-worker's schema. @defaultValue `"graphile_worker"` */
  workerSchema?: string;
  /**
   * Whether to go ahead when graphile-worker's schema is at a migration level this library was not tested
   * with (see {@link TESTED_WORKER_SCHEMAS}), instead of refusing with an `UntestedWorkerSchemaError`. The
   * library writes into graphile-worker's private job table, whose shape may change with any release: only
   * set it after checking that version yourself. @defaultValue `false`
   */
  allowUntestedWorkerSchema?: boolean;
}

/**
 * The graphile-worker versions this library is tested with, by the migration level each leaves in its
 * schema (the highest id of `<workerSchema>.migrations`).
 */
export const TESTED_WORKER_SCHEMAS: ReadonlyArray<{ version: string; level: number }> = [
  { version: "0.17.3", level: 19 },
  { version: "0.18.0", level: 20 },
];

/** What `migrate` found of graphile-worker's schema. */
export interface WorkerSchemaCheck {
  /** graphile-worker's migration level (0 without a migrations table). */
  level: number;
  /** Whether the level is one of {@link TESTED_WORKER_SCHEMAS}. */
  tested: boolean;
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

/**
 * Checks graphile-worker's schema, then applies the migrations this database has not had yet. Safe to call
 * concurrently from many processes.
 */
export async function migrate(options: MigrateOptions): Promise<void> {
  await migrateChecked(options);
}

/** `migrate`, answering what it found of graphile-worker's schema. */
export async function migrateChecked(options: MigrateOptions): Promise<WorkerSchemaCheck> {
  const schema = options.schema ?? "graphile_worker_locks";
  const workerSchema = options.workerSchema ?? "graphile_worker";
  assertSchemaName("schema", schema);
  assertSchemaName("workerSchema", workerSchema);
  const migrations = await loadMigrations();
  const client = await options.pgPool.connect();
  try {
    const check = await checkWorkerSchema(client, workerSchema);
    if (!check.tested && !options.allowUntestedWorkerSchema) {
      throw new UntestedWorkerSchemaError(workerSchema, check.level, TESTED_WORKER_SCHEMAS);
    }
    await runMigrations(client, migrations, schema, workerSchema);
    return check;
  } finally {
    client.release();
  }
}

/** Whether graphile-worker's schema is installed (else throws), and at which migration level. */
async function checkWorkerSchema(
  client: PoolClient,
  workerSchema: string,
): Promise<WorkerSchemaCheck> {
  const w = escapeIdentifier(workerSchema);
  const { rows } = await client.query<{ jobs: boolean; migrations: boolean }>(
    "select to_regclass($1) is not null as jobs, to_regclass($2) is not null as migrations",
    [`${w}._private_jobs`, `${w}.migrations`],
  );
  if (!rows[0]?.jobs) {
    throw new LocksError(
      ErrorCodes.SCHEMA_MISSING,
      `graphile-worker's schema '${workerSchema}' is not installed in this database: run graphile-worker's migrations first (graphile-worker's run(), runMigrations() and makeWorkerUtils() do it)`,
    );
  }
  let level = 0;
  if (rows[0].migrations) {
    const found = await client.query<{ level: number | null }>(
      `select max(id)::int as level from ${w}.migrations`,
    );
    level = found.rows[0]?.level ?? 0;
  }
  return { level, tested: TESTED_WORKER_SCHEMAS.some((t) => t.level === level) };
}

/**
 * A migration's text for these schemas. Placeholders are replaced by a function (a replacement string
 * would read `$&`, `$'`, `` $` `` and `$$` in a name as patterns), outside `--` comments (a name may hold a
 * line break), and the `$$` that delimit function bodies become a dollar-quote tag that neither name
 * contains (a name may hold `$$`).
 */
function migrationText(text: string, schema: string, workerSchema: string): string {
  const s = escapeIdentifier(schema);
  const w = escapeIdentifier(workerSchema);
  let tag = "$gwl$";
  for (let n = 1; s.includes(tag) || w.includes(tag); n++) tag = `$gwl${n}$`;
  return text.replace(/--[^\n]*|\$\$|:GWL_SCHEMA\b|:GRAPHILE_WORKER_SCHEMA\b/g, (match) => {
    if (match.startsWith("--")) return match;
    if (match === "$$") return tag;
    return match === ":GWL_SCHEMA" ? s : w;
  });
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
    const { rows } = await client.query<{ id: number }>(`select id from ${s}.migrations`);
    const applied = new Set(rows.map((r) => r.id));
    for (const migration of migrations) {
      if (applied.has(migration.id)) continue;
      await client.query(migrationText(migration.text, schema, workerSchema));
      await client.query(`insert into ${s}.migrations (id) values ($1)`, [migration.id]);
    }
    await client.query("commit");
  } catch (error) {
    await client.query("rollback").catch(() => undefined);
    throw error;
  }
}
