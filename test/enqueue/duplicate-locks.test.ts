/**
 * A duplicate answered inside a caller's open transaction holds no lock on the existing job: graphile-worker
 * can fetch it, run it and complete it before that transaction ends.
 */
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { makeLocks, type AddJobSpec, type Locks } from "../../src/index.js";
import { deferred, useTestDatabase, waitFor } from "../support/db.js";
import { quietLogger, startRunner } from "../support/runner.js";

const db = useTestDatabase();
const closers: Array<() => Promise<unknown>> = [];
afterAll(async () => {
  for (const close of closers.reverse()) await close();
});

async function openTransaction(isolation: string): Promise<pg.Client> {
  const client = new pg.Client({ connectionString: db.url });
  client.on("error", () => undefined);
  await client.connect();
  closers.push(() => client.end());
  await client.query(`begin isolation level ${isolation}`);
  return client;
}

/** Whether another connection can lock the job's row right now (graphile-worker's fetch and completion need to). */
async function lockableNow(jobId: string): Promise<boolean> {
  const client = await db.pool().connect();
  try {
    await client.query("begin");
    await client.query(
      "select id from graphile_worker._private_jobs where id = $1 for update nowait",
      [jobId],
    );
    return true;
  } catch (error) {
    if ((error as { code?: string }).code === "55P03") return false;
    throw error;
  } finally {
    await client.query("rollback").catch(() => undefined);
    client.release();
  }
}

const cases: Array<[string, AddJobSpec]> = [
  ["scope queued", { unique: "queued" }],
  ["scope active", { unique: "active" }],
  ["scope exists", { unique: "exists" }],
  ["scope and window", { unique: "queued", uniqueFor: 3600 }],
  ["a window alone", { uniqueFor: 3600 }],
  ["replace, when the existing job has started", { unique: "active", onDuplicate: "replace" }],
];

describe("a duplicate inside an open transaction", () => {
  let locks: Locks;
  beforeAll(() => {
    locks = makeLocks({ connectionString: db.url, logger: quietLogger });
    closers.push(() => locks.release());
  });

  for (const isolation of ["read committed", "repeatable read"]) {
    for (const [name, spec] of cases) {
      it(`${name}, ${isolation}: single and bulk leave the existing job unlocked`, async () => {
        const payload = { name, isolation };
        const first = await locks.addJob("dup_lock", payload, spec);
        expect(first.outcome).toBe("added");
        const jobId = first.job!.id;
        if (spec.onDuplicate === "replace") {
          // (a started job is answered like `reject`: its row must not stay locked either)
          await db
            .pool()
            .query(
              "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'x', attempts = 1 where id = $1",
              [jobId],
            );
        }
        const tx = await openTransaction(isolation);
        const single = await locks.addJob("dup_lock", payload, { ...spec, pgClient: tx });
        expect(single.outcome).toBe("duplicate");
        expect(single.job?.id).toBe(jobId);
        expect(await lockableNow(jobId)).toBe(true);
        const bulk = await locks.addJobs([{ identifier: "dup_lock", payload, ...spec }], {
          pgClient: tx,
        });
        expect(bulk[0]!.outcome).toBe("duplicate");
        expect(await lockableNow(jobId)).toBe(true);
        await tx.query("commit");
      });
    }
  }

  it("a real runner fetches, runs and completes the existing job while the transaction stays open", async () => {
    const ran = deferred<string>();
    const first = await locks.addJob("dup_run", { n: 1 }, { unique: "queued" });
    const tx = await openTransaction("read committed");
    const duplicate = await locks.addJob("dup_run", { n: 1 }, { unique: "queued", pgClient: tx });
    expect(duplicate.outcome).toBe("duplicate");
    const runner = await startRunner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { dup_run: async (_payload, helpers) => ran.resolve(helpers.job.id) },
    });
    closers.push(() => runner.stop());
    try {
      const timeout = new Promise<string>((_resolve, reject) =>
        setTimeout(
          () => reject(new Error("the existing job was not fetched before the commit")),
          10_000,
        ),
      );
      expect(await Promise.race([ran.promise, timeout])).toBe(first.job!.id);
      await waitFor(
        async () => {
          const { rows } = await db
            .pool()
            .query("select 1 from graphile_worker._private_jobs where id = $1", [first.job!.id]);
          return rows.length === 0;
        },
        { timeoutMs: 10_000, message: "the existing job's completion, before the commit" },
      );
    } finally {
      await tx.query("commit");
    }
  });
});
