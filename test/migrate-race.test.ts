/**
 * `migrate` racing another session's migration of an empty database, the two interleaved by hand: the
 * test's session holds the migration lock and creates the library's schema while `migrate` waits for
 * that lock, on a connection that has just run graphile-worker's migrations (the connection the preset's
 * `postmigrate` gets). `migrate` must see what the other session committed, not fail on it as a duplicate.
 */
import { runMigrations } from "graphile-worker";
import pg from "pg";
import { describe, expect, it } from "vitest";
import { migrate } from "../src/index.js";
import { hashKey } from "../src/key.js";
import { waitFor } from "./support/db.js";
import { quietLogger } from "./support/runner.js";
import { MIGRATION_IDS, useScratchDatabases } from "./support/scratch.js";

const scratch = useScratchDatabases();
// (a pool of one connection: graphile-worker's migrations, `before` and `migrate` share it)
const SCHEMA = "graphile_worker_locks";

/**
 * On a new database with graphile-worker's schema: the test's session takes the migration lock, `migrate`
 * starts on a pool of one connection that ran graphile-worker's migrations and then ran `before`, and once
 * `migrate` waits for the lock the test's session creates the schema and commits. Returns how `migrate`
 * ended and the library's migrations then recorded.
 */
async function raceOnce(before?: string): Promise<{ error: unknown; applied: number[] }> {
  const url = await scratch.create();
  const pool = new pg.Pool({ connectionString: url, max: 1, application_name: "gwl-test-migrate" });
  pool.on("error", () => undefined);
  await runMigrations({ pgPool: pool, logger: quietLogger });
  if (before) await pool.query(before);
  const other = new pg.Client({ connectionString: url, application_name: "gwl-test-other" });
  await other.connect();
  try {
    await other.query("begin");
    await other.query("select pg_advisory_xact_lock($1)", [
      hashKey(`gwl:migrate:${SCHEMA}`).toString(),
    ]);
    const migrating = migrate({ pgPool: pool }).then(
      () => null,
      (error: unknown) => error,
    );
    await waitFor(
      async () => {
        const { rows } = await other.query<{ n: number }>(
          `select count(*)::int as n from pg_locks
           where locktype = 'advisory' and not granted
             and database = (select oid from pg_database where datname = current_database())`,
        );
        return rows[0]!.n === 1;
      },
      { message: "migrate to wait for the migration lock" },
    );
    await other.query(`create schema ${SCHEMA}`);
    await other.query("commit");
    const error = await migrating;
    const { rows } = await pool
      .query<{ id: number }>(`select id from ${SCHEMA}.migrations order by id`)
      .catch(() => ({ rows: [] }));
    return { error, applied: rows.map((r) => r.id) };
  } finally {
    await other.end();
    await pool.end();
  }
}

const allMigrations = [...MIGRATION_IDS];

describe("migrate racing another session's migration", () => {
  it("a migration waiting for the lock sees the schema the lock's holder committed", async () => {
    const { error, applied } = await raceOnce();
    expect(error).toBeNull();
    expect(applied).toEqual(allMigrations);
  });

  it("a session that looked the schema up before it existed still migrates (the duplicate is retried in a new transaction)", async () => {
    const { error, applied } = await raceOnce(`select to_regnamespace('${SCHEMA}')`);
    expect(error).toBeNull();
    expect(applied).toEqual(allMigrations);
  });
});
