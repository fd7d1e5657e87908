/**
 * Empty databases (from template0: neither graphile-worker's schema nor this library's), for tests of what
 * happens on first use. Each is dropped, with its connections, when the file is done.
 */
import { randomBytes } from "node:crypto";
import { readdirSync } from "node:fs";
import pg from "pg";
import { afterAll, inject } from "vitest";
import { databaseUrl } from "../../scripts/postgres.js";
import { dropDatabase, withAdmin } from "./admin.js";

/** The numbers of the library's migrations (the files in `sql/`), in order. */
export const MIGRATION_IDS: readonly number[] = readdirSync(new URL("../../sql/", import.meta.url))
  .filter((f) => /^\d{6}\.sql$/.test(f))
  .map((f) => Number.parseInt(f.slice(0, 6), 10))
  .sort((a, b) => a - b);

/** The library's latest migration: the highest number in `sql/`. */
export const LATEST_MIGRATION = MIGRATION_IDS.at(-1)!;

export interface ScratchDatabases {
  /** Creates an empty database and returns its URL. */
  create(): Promise<string>;
  /** A pool (max 4) to a database made by `create`, closed when the file is done. */
  pool(url: string): pg.Pool;
}

export function useScratchDatabases(): ScratchDatabases {
  const names: string[] = [];
  const pools: pg.Pool[] = [];
  afterAll(async () => {
    await Promise.all(pools.map((p) => p.end().catch(() => undefined)));
    await withAdmin(inject("baseUrl"), async (admin) => {
      for (const name of names) {
        await dropDatabase(admin, name);
      }
    });
  });
  return {
    async create() {
      const name = `gwl_s_${randomBytes(6).toString("hex")}`;
      await withAdmin(inject("baseUrl"), (admin) =>
        admin.query(`create database ${pg.escapeIdentifier(name)} template template0`),
      );
      names.push(name);
      return databaseUrl(inject("baseUrl"), name);
    },
    pool(url) {
      const pool = new pg.Pool({
        connectionString: url,
        max: 4,
        application_name: "gwl-test-helper",
      });
      // (the database is dropped with force at the end: a terminated backend must not crash the worker)
      pool.on("error", () => undefined);
      pool.on("connect", (client) => client.on("error", () => undefined));
      pools.push(pool);
      return pool;
    },
  };
}
