/**
 * Key functions that fail, and blank task identifiers: typed errors (`InvalidArgumentError`, naming the
 * task and the function, with the original error as `cause`) at every entry point, before anything is
 * written; and inside the worker, a job failure naming the job, task and function, which graphile-worker
 * retries. Real PostgreSQL and a real graphile-worker runner.
 */
import { makeWorkerUtils, type Runner, type WorkerUtils } from "graphile-worker";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { ErrorCodes, InvalidArgumentError, makeLocks, type Locks } from "../src/index.js";
import { useTestDatabase, waitFor } from "./support/db.js";
import { quietLogger, startRunner } from "./support/runner.js";

const db = useTestDatabase();
let utils: WorkerUtils;
const cleanups: Array<() => Promise<unknown>> = [];

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url });
});
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  await db.pool().query("delete from graphile_worker._private_jobs");
});
afterAll(async () => {
  await utils?.release();
});

function newLocks(): Locks {
  const locks = makeLocks({ connectionString: db.url, logger: quietLogger });
  cleanups.push(() => locks.release());
  return locks;
}

/** Everything an enqueue can write: the jobs, the unique windows and the waiting lines, as text. */
async function written(): Promise<string> {
  const { rows } = await db.pool().query<{ state: string }>(
    `select json_build_object(
       'jobs', (select coalesce(json_agg(j order by j.id), '[]') from graphile_worker._private_jobs j),
       'windows', (select coalesce(json_agg(w), '[]') from graphile_worker_locks.unique_windows w),
       'waiters', (select coalesce(json_agg(w), '[]') from graphile_worker_locks.waiters w)
     )::text as state`,
  );
  return rows[0]!.state;
}

/** A key function that throws `boom` for the payload `{ id: "boom" }` and keys by `id` otherwise. */
const boom = new Error("boom");
const throwingKey = (p: { id: unknown }) => {
  if (p.id === "boom") throw boom;
  return p.id;
};

/** Asserts that `promise` rejects with an InvalidArgumentError matching `message`, caused by `cause`. */
async function expectInvalid(promise: Promise<unknown>, message: RegExp, cause?: unknown) {
  const error = await promise.then(
    () => expect.unreachable("expected a rejection"),
    (e: unknown) => e,
  );
  expect(error).toBeInstanceOf(InvalidArgumentError);
  expect(error).toBeInstanceOf(TypeError);
  expect((error as InvalidArgumentError).code).toBe(ErrorCodes.INVALID_ARGUMENT);
  expect((error as Error).message).toMatch(message);
  if (cause !== undefined) expect((error as Error).cause).toBe(cause);
}

describe("a key function that throws, at enqueue", () => {
  const strategies = [
    { name: "drop (preemptive)", options: { onConflict: "drop" } },
    { name: "drop, preemptive: false", options: { onConflict: "drop", preemptive: false } },
    { name: "reschedule", options: { onConflict: "reschedule" } },
    { name: "raise", options: { onConflict: "raise" } },
    { name: "limit 3", options: { onConflict: "raise", limit: 3 } },
  ] as const;

  for (const { name, options } of strategies) {
    it(`${name}: InvalidArgumentError naming the task and \`key\`, the original as cause, nothing written`, async () => {
      const locks = newLocks();
      const task = locks.exclusive("kx", async () => undefined, { ...options, key: throwingKey });
      const before = await written();
      await expectInvalid(task.addJob({ id: "boom" }), /^`key` of task 'kx' threw: boom$/, boom);
      await expectInvalid(locks.addJob("kx", { id: "boom" }), /`key` of task 'kx' threw/, boom);
      await expectInvalid(
        locks.addJob("kx", { id: "boom" }, { preemptive: true }),
        /`key` of task 'kx' threw/,
        boom,
      );
      await expectInvalid(
        locks.addJob("kx", { id: "boom" }, { preemptive: false }),
        /`key` of task 'kx' threw/,
        boom,
      );
      expect(await written()).toBe(before);
      // The same task enqueues a payload its key function takes.
      expect((await task.addJob({ id: 1 })).outcome).toBe("added");
    });
  }

  it("a key function that returns what JSON cannot carry: named, with its path, nothing written", async () => {
    const locks = newLocks();
    const task = locks.exclusive("kx_bigint", async () => undefined, {
      onConflict: "raise",
      key: (p: { id: number }) => ({ id: BigInt(p.id) }),
    });
    const before = await written();
    await expectInvalid(
      task.addJob({ id: 1 }),
      /^`key` of task 'kx_bigint' returned a value JSON cannot carry: key\(payload\)\.id is a BigInt/,
    );
    expect(() => task.lockKey({ id: 1 })).toThrow(InvalidArgumentError);
    expect(await written()).toBe(before);
  });

  it("a task defined with `define` (exclusive): the same", async () => {
    const locks = newLocks();
    locks.define("kx_defined", { exclusive: true, onConflict: "raise", key: throwingKey });
    const before = await written();
    await expectInvalid(
      locks.addJob("kx_defined", { id: "boom" }),
      /`key` of task 'kx_defined' threw: boom/,
      boom,
    );
    expect(await written()).toBe(before);
  });
});

describe("a uniqueKey function that throws, at enqueue", () => {
  it("on the task, per enqueue, and the exclusive key standing in for it: named, nothing written", async () => {
    const locks = newLocks();
    const sendWelcome = locks.unique("ku", async () => undefined, {
      unique: "queued",
      uniqueKey: throwingKey,
    });
    const exclusiveUnique = locks.exclusive("ku_x", async () => undefined, {
      onConflict: "reschedule",
      unique: "active",
      key: throwingKey,
    });
    const before = await written();
    await expectInvalid(
      sendWelcome.addJob({ id: "boom" }),
      /^`uniqueKey` of task 'ku' threw: boom$/,
      boom,
    );
    for (const onDuplicate of ["reject", "raise", "replace"] as const) {
      await expectInvalid(
        locks.addJob(
          "ku_plain",
          { id: "boom" },
          { unique: "exists", uniqueKey: throwingKey, onDuplicate },
        ),
        /^`uniqueKey` of task 'ku_plain' threw: boom$/,
        boom,
      );
    }
    await expectInvalid(
      locks.addJob("ku_window", { id: "boom" }, { uniqueFor: 60, uniqueKey: throwingKey }),
      /`uniqueKey` of task 'ku_window' threw: boom/,
      boom,
    );
    await expectInvalid(
      exclusiveUnique.addJob({ id: "boom" }),
      /`key` of task 'ku_x' threw: boom/,
      boom,
    );
    await expectInvalid(
      locks.addJob("ku_plain", { id: 1 }, { unique: "queued", uniqueKey: () => Symbol("s") }),
      /`uniqueKey` of task 'ku_plain' returned a value JSON cannot carry: uniqueKey\(payload\) is a symbol/,
    );
    expect(await written()).toBe(before);
  });
});

describe("addJobs", () => {
  it("an item whose key function throws names its index, and none of the batch is written", async () => {
    const locks = newLocks();
    locks.exclusive("kb", async () => undefined, { onConflict: "reschedule", key: throwingKey });
    locks.unique("kb_u", async () => undefined, { unique: "queued", uniqueKey: throwingKey });
    const before = await written();
    await expectInvalid(
      locks.addJobs([
        { identifier: "kb", payload: { id: 1 } },
        { identifier: "kb", payload: { id: 1 } },
        { identifier: "kb", payload: { id: "boom" } },
      ]),
      /^addJobs: item 2: `key` of task 'kb' threw: boom$/,
      boom,
    );
    await expectInvalid(
      locks.addJobs([
        { identifier: "kb_u", payload: { id: 1 } },
        { identifier: "kb_u", payload: { id: "boom" } },
      ]),
      /^addJobs: item 1: `uniqueKey` of task 'kb_u' threw: boom$/,
      boom,
    );
    await expectInvalid(
      locks.addJobs([
        { identifier: "kb_plain", payload: { id: 1 } },
        {
          identifier: "kb_plain",
          payload: { id: "boom" },
          unique: "active",
          uniqueKey: throwingKey,
        },
      ]),
      /^addJobs: item 1: `uniqueKey` of task 'kb_plain' threw: boom$/,
      boom,
    );
    expect(await written()).toBe(before);
    // The same batch without the bad item is written.
    const results = await locks.addJobs([
      { identifier: "kb", payload: { id: 1 } },
      { identifier: "kb_u", payload: { id: 2 } },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "added"]);
  });
});

describe("lockAvailable", () => {
  it("a key function that throws: InvalidArgumentError naming the task and `key`", async () => {
    const locks = newLocks();
    const task = locks.exclusive("kl", async () => undefined, { key: throwingKey });
    await expectInvalid(
      task.lockAvailable({ id: "boom" }),
      /^`key` of task 'kl' threw: boom$/,
      boom,
    );
    await expectInvalid(
      locks.lockAvailable("kl", { id: "boom" }),
      /^`key` of task 'kl' threw: boom$/,
      boom,
    );
    expect(await task.lockAvailable({ id: 1 })).toBe(true);
  });
});

describe("a blank task identifier", () => {
  const blanks = [" ", "   ", "\t\n", ""];

  it("is refused by exclusive, unique, define, addJob, addJobs and lockAvailable, before anything is written", async () => {
    const locks = newLocks();
    const blankMessage = /`taskIdentifier` must be a non-empty string/;
    const before = await written();
    for (const blank of blanks) {
      expect(() => locks.exclusive(blank, async () => undefined)).toThrow(blankMessage);
      expect(() => locks.unique(blank, async () => undefined, { unique: "queued" })).toThrow(
        blankMessage,
      );
      expect(() => locks.define(blank, { exclusive: true })).toThrow(blankMessage);
      await expectInvalid(locks.addJob(blank, { id: 1 }), blankMessage);
      await expectInvalid(locks.addJob(blank, { id: 1 }, { unique: "queued" }), blankMessage);
      await expectInvalid(
        locks.addJobs([
          { identifier: "fine", payload: { id: 1 } },
          { identifier: blank, payload: { id: 1 } },
        ]),
        /^addJobs: item 1: `taskIdentifier` must be a non-empty string/,
      );
      await expectInvalid(locks.lockAvailable(blank, { id: 1 }), blankMessage);
    }
    expect(await written()).toBe(before);
  });
});

describe("a key function that throws inside the worker", () => {
  it("fails the job with an error naming the job, the task and `key`; graphile-worker retries it", async () => {
    const locks = newLocks();
    let ran = 0;
    const task = locks.exclusive(
      "kw",
      async () => {
        ran++;
      },
      { onConflict: "reschedule", key: throwingKey },
    );
    // graphile-worker's own enqueue does not evaluate the key, so the bad payload reaches a worker.
    const job = await utils.addJob("kw", { id: "boom" });
    const runner: Runner = await startRunner({ connectionString: db.url, taskList: { kw: task } });
    cleanups.push(() => runner.stop());
    const row = await waitFor(
      async () => {
        const { rows } = await db.pool().query<{
          attempts: number;
          last_error: string | null;
          locked_by: string | null;
          run_at: Date;
          now: Date;
        }>("select attempts, last_error, locked_by, run_at, now() from graphile_worker._private_jobs where id = $1", [job.id]);
        return rows[0]?.last_error && rows[0].locked_by === null ? rows[0] : null;
      },
      { message: "the job's first attempt to fail" },
    );
    expect(row.last_error).toMatch(new RegExp(`^job ${job.id}: \`key\` of task 'kw' threw: boom`));
    // A real failure: the attempt counts and the job stays, due again later (graphile-worker's backoff).
    expect(row.attempts).toBe(1);
    expect(row.run_at.getTime()).toBeGreaterThan(row.now.getTime());
    expect(ran).toBe(0);
  });
});
