import pg from "pg";

/** Runs `fn` on a short-lived administrative connection to `url` (creating and dropping databases). */
export async function withAdmin<T>(url: string, fn: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url, application_name: "gwl-test-admin" });
  client.on("error", () => undefined);
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end();
  }
}

/**
 * Drops `database` if it exists, ending its connections first. (`drop database ... with (force)` would
 * do both, but it needs PostgreSQL 13; this works on 12 too.) A connection that arrives between the two
 * makes the drop fail with 55006: terminate and try again.
 */
export async function dropDatabase(admin: pg.Client, database: string): Promise<void> {
  for (let attempt = 1; ; attempt++) {
    await admin.query(
      "select pg_terminate_backend(pid) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()",
      [database],
    );
    try {
      await admin.query(`drop database if exists ${pg.escapeIdentifier(database)}`);
      return;
    } catch (error) {
      if ((error as { code?: string }).code !== "55006" || attempt >= 50) throw error;
      await new Promise((resolve) => setTimeout(resolve, 20 * attempt));
    }
  }
}
