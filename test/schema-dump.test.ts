/**
 * test/schema.sql is the library's whole schema after every migration, as PostgreSQL describes it
 * (test/support/schemaDump.ts). A migration that changes the schema changes the dump: this test fails with
 * the difference until the file is written again with `UPDATE_SCHEMA=1 npx vitest run test/schema-dump.test.ts`.
 */
import { readFile, writeFile } from "node:fs/promises";
import { expect, it } from "vitest";
import { useTestDatabase } from "./support/db.js";
import { dumpSchema } from "./support/schemaDump.js";

const db = useTestDatabase();
const FILE = new URL("./schema.sql", import.meta.url);

it("the migrated schema is the one in test/schema.sql", async () => {
  const dump = await dumpSchema(db.pool(), "graphile_worker_locks");
  if (process.env.UPDATE_SCHEMA) await writeFile(FILE, dump);
  expect(dump.split("\n")).toEqual((await readFile(FILE, "utf8")).split("\n"));
});
