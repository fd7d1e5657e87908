/**
 * The library's own schema: numbered files in `sql/` (000001.sql, ...), applied in order, each once, in
 * one transaction under a transaction-level advisory lock, so concurrent starts of many workers are safe.
 *
 * Concurrent starts. A session caches the catalog entries it looks up, including the absence of a name,
 * and sees other sessions' catalog changes only when a transaction starts (or it locks a table), not when
 * an advisory lock it waited for is granted. So nothing looks the library's schema up by name before the
 * lock: the fast path reads the catalogs with a plain query, and the migrating transaction takes the lock
 * as its first statement. A session whose cache is stale all the same (it looked the schema up earlier
 * for other reasons) meets the objects another session committed meanwhile as a duplicate: it rolls back
 * and tries again in a new transaction, as graphile-worker's migrations do; so does a transaction chosen
 * to fail a deadlock.
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

/**
 * SQLSTATEs of a migration racing another one: `unique_violation`, `duplicate_schema`, `duplicate_table`,
 * `duplicate_object` (another session created it first) and `deadlock_detected`.
 */
const RACE_CODES: readonly string[] = ["23505", "42P06", "42P07", "42710", "40P01"];
/** How many transactions a migration tries before it gives up on a race. */
const MIGRATE_ATTEMPTS = 8;

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
  // Fast path: everything applied already (the common case on every worker start).
  const lastAvailable = migrations.at(-1)?.id ?? 0;
  if ((await appliedLevel(client, schema)) >= lastAvailable) return;
  for (let attempt = 1; ; attempt++) {
    try {
      await applyPending(client, migrations, schema, workerSchema);
      return;
    } catch (error) {
      const code = (error as { code?: unknown }).code;
      if (typeof code !== "string" || !RACE_CODES.includes(code) || attempt >= MIGRATE_ATTEMPTS) {
        throw error;
      }
      // A duplicate: another session committed it, which a new transaction sees. A deadlock: this
      // transaction was the one chosen to fail. Go again, after a random pause that keeps the next
      // attempts of several sessions apart.
      await new Promise((resolve) => setTimeout(resolve, 20 + Math.random() * 100 * attempt));
    }
  }
}

/**
 * The highest migration applied (0: none, or no schema). The catalogs are read with a plain query: looking
 * the schema up by name while it is missing would leave its absence in this session's cache.
 */
async function appliedLevel(client: PoolClient, schema: string): Promise<number> {
  const { rows } = await client.query<{ installed: boolean }>(
    `select exists (
       select from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
       where n.nspname = $1 and c.relname = 'migrations' and c.relkind = 'r'
     ) as installed`,
    [schema],
  );
  if (!rows[0]?.installed) return 0;
  const found = await client.query<{ latest: number | null }>(
    `select max(id) as latest from ${escapeIdentifier(schema)}.migrations`,
  );
  return found.rows[0]?.latest ?? 0;
}

/** One transaction: the lock first, then every migration this database has not had yet. */
async function applyPending(
  client: PoolClient,
  migrations: Migration[],
  schema: string,
  workerSchema: string,
): Promise<void> {
  const s = escapeIdentifier(schema);
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
