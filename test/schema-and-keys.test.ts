/**
 * The library's migrations under concurrent starts, and key stability through PostgreSQL: the key computed
 * at enqueue from the JS value equals the key the worker computes from the payload it receives.
 */
import { readdir } from "node:fs/promises";
import fc from "fast-check";
import pg from "pg";
import { afterAll, describe, expect, it } from "vitest";
import { lockKey, makeLocks, migrate } from "../src/index.js";
import { useTestDatabase, waitFor } from "./support/db.js";
import { quietLogger, startRunner } from "./support/runner.js";

const db = useTestDatabase();
const closers: Array<() => Promise<unknown>> = [];
afterAll(async () => {
  for (const close of closers.reverse()) await close();
});

describe("migrations", () => {
  it("apply once and safely when many processes start at the same time", async () => {
    const pools = Array.from({ length: 8 }, () => {
      const pool = new pg.Pool({ connectionString: db.url, max: 1 });
      // (as the helper pool: a backend terminated at the end of the file must not crash the test worker)
      pool.on("error", () => undefined);
      pool.on("connect", (client) => client.on("error", () => undefined));
      return pool;
    });
    closers.push(() => Promise.all(pools.map((p) => p.end())));
    await Promise.all(pools.map((pgPool) => migrate({ pgPool, schema: "gwl_concurrent" })));
    const { rows } = await db
      .pool()
      .query<{ id: number }>("select id from gwl_concurrent.migrations order by id");
    const files = (await readdir(new URL("../sql/", import.meta.url))).filter((f) =>
      /^\d{6}\.sql$/.test(f),
    );
    expect(files.length).toBeGreaterThanOrEqual(1);
    expect(rows.map((r) => r.id)).toEqual(
      files.map((f) => Number.parseInt(f.slice(0, 6), 10)).sort((x, y) => x - y),
    );
    const view = await db.pool().query("select * from gwl_concurrent.held_locks");
    expect(view.rows).toEqual([]);
    // And again: the fast path finds everything applied.
    await migrate({ pgPool: pools[0]!, schema: "gwl_concurrent" });
  });
});

describe("keys through PostgreSQL", () => {
  it("a JSON value read back from a json column gives the same key (property)", async () => {
    const client = new pg.Client({ connectionString: db.url });
    await client.connect();
    closers.push(() => client.end());
    await fc.assert(
      fc.asyncProperty(fc.jsonValue(), async (value) => {
        const { rows } = await client.query<{ v: unknown }>("select $1::json as v", [
          JSON.stringify(value),
        ]);
        expect(lockKey("t", rows[0]!.v)).toBe(lockKey("t", value));
      }),
      { numRuns: 200 },
    );
  });

  it("the worker computes, from the payload it receives, the key computed at enqueue", async () => {
    const locks = makeLocks({ connectionString: db.url, logger: quietLogger });
    closers.push(() => locks.release());
    const seen = new Map<string, bigint>();
    const task = locks.exclusive("roundtrip", async (payload: unknown, helpers) => {
      seen.set(helpers.job.id, task.lockKey(payload));
    });
    const samples = fc.sample(
      fc.record({
        id: fc.integer(),
        when: fc.date({ noInvalidDate: true, min: new Date(0), max: new Date(4e12) }),
        amount: fc.double({ noNaN: true, noDefaultInfinity: true }),
        tags: fc.array(fc.string()),
        nested: fc.jsonValue(),
        optional: fc.option(fc.string(), { nil: undefined }),
      }),
      60,
    );
    const expected = new Map<string, bigint>();
    for (const payload of samples) {
      const { job } = await task.addJob(payload, { preemptive: false });
      expected.set(job!.id, task.lockKey(payload));
    }
    const runner = await startRunner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { roundtrip: task },
    });
    closers.push(() => runner.stop());
    await waitFor(async () => seen.size === samples.length, { message: "every job to run" });
    expect(seen).toEqual(expected);
  });
});
