/**
 * The versions under test are the ones the environment names (see scripts/postgres.ts and
 * test/support/graphile-worker.ts): a selector that quietly fell back to the default would make a
 * matrix run test the default version again.
 */
import { describe, expect, inject, it } from "vitest";
import { runMigrations, Logger } from "graphile-worker";
import { expectedMajor } from "../scripts/postgres.js";
import { withAdmin } from "./support/admin.js";
import { useTestDatabase } from "./support/db.js";
import { LAST_MIGRATION, requestedGraphileWorker } from "./support/graphile-worker.js";
import { startWorkerProcess } from "./support/processes.js";

const db = useTestDatabase();
const graphileWorker = requestedGraphileWorker();

describe("the versions under test", () => {
  it.skipIf(expectedMajor() === undefined)(
    `the server is PostgreSQL ${expectedMajor() ?? "(given by the environment)"}`,
    async () => {
      const { rows } = await withAdmin(inject("baseUrl"), (admin) =>
        admin.query<{ n: number }>("select current_setting('server_version_num')::int as n"),
      );
      expect(String(Math.floor(rows[0]!.n / 10_000))).toBe(expectedMajor());
    },
  );

  it(`the template holds graphile-worker ${graphileWorker}'s schema`, async () => {
    const { rows } = await db
      .pool()
      .query<{ id: number }>("select max(id) as id from graphile_worker.migrations");
    expect(rows[0]!.id).toBe(LAST_MIGRATION[graphileWorker]);
  });

  it(`graphile-worker imported here is ${graphileWorker}`, async () => {
    // Migrating an empty database shows which version's migrations the imported module carries.
    const pool = db.pool();
    await pool.query("create schema gw_probe");
    await runMigrations({
      pgPool: pool,
      schema: "gw_probe",
      logger: new Logger(() => () => undefined),
    });
    const { rows } = await pool.query<{ id: number }>(
      "select max(id) as id from gw_probe.migrations",
    );
    expect(rows[0]!.id).toBe(LAST_MIGRATION[graphileWorker]);
  });

  it(`the forked worker processes import graphile-worker ${graphileWorker}`, async () => {
    const worker = await startWorkerProcess(db.url, { name: "probe" });
    try {
      const dir = graphileWorker === "0.17" ? "graphile-worker-0.17" : "graphile-worker";
      expect(worker.graphileWorker).toContain(`/node_modules/${dir}/`);
    } finally {
      await worker.stop();
    }
  });
});
