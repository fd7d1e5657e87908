/**
 * `limit > 1`: a key's slots within one process. Jobs of one key fetched together or apart, with every
 * conflict strategy, with lock-ahead on and off: a slot this process is still acquiring for one job never
 * turns another job away while a slot is free, and no more than `limit` jobs of the key run at once.
 * Executions are recorded with the database's clock. Real PostgreSQL, real graphile-worker runners.
 */
import { describe, expect, it } from "vitest";
import type { Locks } from "../../src/index.js";
import { slotKeys } from "../../src/key.js";
import { deferred, waitFor, type Deferred } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { maxConcurrencyPerKey, readExecutions } from "../support/executions.js";

const h = useExclusiveHarness("truncate test_executions, test_events");
const { db, newLocks, runner } = h;

const STRATEGIES = ["drop", "raise", "reschedule"] as const;
type Strategy = (typeof STRATEGIES)[number];
const LIMITS = [2, 3, 4, 5];

/**
 * A task of `limit` slots on one key ("one") whose executions are recorded (task `identifier`, the
 * payload's `n` as note) and wait for the gate current when they started. Counts its conflicts by job id.
 */
function gatedTask(locks: Locks, identifier: string, limit: number, strategy: Strategy) {
  const pool = db.pool();
  let gate: Deferred<void> = deferred();
  const started: string[] = [];
  const conflicts: string[] = [];
  locks.events.on("lock:conflict", (e) => {
    if (e.taskIdentifier === identifier) conflicts.push(e.job.id);
  });
  const task = locks.exclusive(
    identifier,
    async (payload: { n: string }, helpers) => {
      const current = gate;
      const { rows } = await pool.query<{ id: string }>(
        "insert into test_executions (job_id, task, lock_key, worker, attempts, note) values ($1, $2, 'one', 'w', $3, $4) returning id",
        [helpers.job.id, identifier, helpers.job.attempts, payload.n],
      );
      started.push(helpers.job.id);
      await current.promise;
      await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
        rows[0]!.id,
      ]);
    },
    {
      limit,
      onConflict: strategy,
      key: () => "one",
      reschedule: { minDelay: 50, maxDelay: 200 },
    },
  );
  return {
    task,
    started,
    conflicts,
    /** Lets the executions running now finish; later ones wait for the next gate. */
    open() {
      const current = gate;
      gate = deferred();
      current.resolve();
    },
    /** Lets every execution finish, now and later (for the end of a test). */
    openForGood() {
      gate.resolve();
      gate = { promise: Promise.resolve(), resolve: () => undefined, reject: () => undefined };
    },
  };
}

async function endedCount(identifier: string): Promise<number> {
  const executions = await readExecutions(db.pool(), identifier);
  return executions.filter((e) => e.end !== null).length;
}

describe.each([
  { lockAhead: false, name: "without lock-ahead" },
  { lockAhead: true, name: "with lock-ahead (local queue, attached runner)" },
])("limit > 1 in one process, $name", ({ lockAhead }) => {
  describe.each(STRATEGIES)("%s", (strategy) => {
    it.each(LIMITS)(
      "limit %i: `limit` jobs fetched together all run at once; one more conflicts; `limit` fetched apart all run",
      async (limit) => {
        const identifier = `lim_${strategy}_${limit}_${lockAhead ? "ahead" : "plain"}`;
        const locks = newLocks();
        const t = gatedTask(locks, identifier, limit, strategy);
        const r = await runner({
          connectionString: db.url,
          concurrency: limit + 2,
          taskList: { [identifier]: t.task },
          ...(lockAhead
            ? { preset: { worker: { localQueue: { size: 20 }, completeJobBatchDelay: 0 } } }
            : {}),
        });
        if (lockAhead) locks.attach(r);
        h.cleanups.push(async () => t.openForGood()); // (runs before the runner's stop, should the test fail)

        // Fetched together: one insert of `limit` jobs of the key, which the runner picks up at once.
        await h.utils.addJobs(
          Array.from({ length: limit }, (_, i) => ({
            identifier,
            payload: { n: `together-${i}` },
          })),
        );
        await waitFor(async () => t.started.length + t.conflicts.length >= limit, {
          message: `${limit} jobs to start or conflict`,
        });
        expect(t.conflicts).toEqual([]);
        expect(t.started).toHaveLength(limit);

        // Every slot is taken: one more job of the key meets the strategy.
        const { id: extra } = await h.utils.addJob(identifier, { n: "extra" });
        await waitFor(async () => t.conflicts.length > 0, { message: "the extra job to conflict" });
        // (a rescheduled copy of it may meet the held slots again meanwhile)
        expect(t.conflicts[0]).toBe(extra);
        expect(t.started).toHaveLength(limit);

        t.open();
        await waitFor(async () => (await endedCount(identifier)) === limit, {
          message: "the jobs fetched together to end",
        });
        if (strategy === "drop") {
          await waitFor(async () => (await h.jobRows()).length === 0, {
            message: "the dropped job to complete",
          });
        } else {
          // The extra job runs, now that slots are free (a raised one once graphile-worker retries it).
          if (strategy === "raise") {
            await waitFor(
              async () => (await h.jobRows()).find((j) => j.id === extra && j.locked_by === null),
              { message: "the raised job to be given back for a retry" },
            );
            await h.utils.rescheduleJobs([extra], { runAt: new Date() });
          }
          await waitFor(async () => t.started.length === limit + 1, {
            message: "the extra job to run",
          });
          t.open();
          await waitFor(async () => (await endedCount(identifier)) === limit + 1, {
            message: "the extra job to end",
          });
        }
        const conflictsBefore = t.conflicts.length;
        const startedBefore = t.started.length;

        // Fetched apart: each job added once the one before it runs; every one takes a free slot.
        for (let i = 0; i < limit; i++) {
          await h.utils.addJob(identifier, { n: `apart-${i}` });
          await waitFor(
            async () => t.started.length - startedBefore + t.conflicts.length - conflictsBefore > i,
            {
              message: `job ${i} fetched apart to start or conflict`,
            },
          );
        }
        expect(t.conflicts).toHaveLength(conflictsBefore);
        expect(t.started).toHaveLength(startedBefore + limit);
        t.openForGood();
        await waitFor(async () => (await h.jobRows()).length === 0, {
          message: "every job to complete",
        });

        // By the database's clock: `limit` at once, never more, and every run in its first attempt
        // (drop, raise: none but the extra job's second).
        const executions = await readExecutions(db.pool(), identifier);
        expect(executions).toHaveLength(startedBefore + limit);
        expect(maxConcurrencyPerKey(executions).get("one")).toBe(limit);
        const together = executions.filter((e) => e.note?.startsWith("together-"));
        expect(together.map((e) => e.attempts)).toEqual(Array<number>(limit).fill(1));
        const apart = executions.filter((e) => e.note?.startsWith("apart-"));
        expect(apart.map((e) => e.attempts)).toEqual(Array<number>(limit).fill(1));
        expect(maxConcurrencyPerKey(together).get("one")).toBe(limit);
        expect(maxConcurrencyPerKey(apart).get("one")).toBe(limit);
      },
    );
  });
});

describe.each([
  { lockAhead: false, name: "without lock-ahead" },
  { lockAhead: true, name: "with lock-ahead" },
])("limit > 1 with slots held by another session, $name", ({ lockAhead }) => {
  it("limit 3, slots 0 and 2 held elsewhere: of 3 jobs fetched together one runs and two are dropped as held elsewhere; once freed, 3 run at once", async () => {
    const identifier = `lim_elsewhere_${lockAhead ? "ahead" : "plain"}`;
    const locks = newLocks();
    const t = gatedTask(locks, identifier, 3, "drop");
    const local: boolean[] = [];
    locks.events.on("lock:conflict", (e) => void local.push(e.local));
    const [slot0, , slot2] = slotKeys(identifier, "one", 3, null);
    const others = [await h.holdExternally(slot0!), await h.holdExternally(slot2!)];
    const r = await runner({
      connectionString: db.url,
      concurrency: 5,
      taskList: { [identifier]: t.task },
      ...(lockAhead
        ? { preset: { worker: { localQueue: { size: 20 }, completeJobBatchDelay: 0 } } }
        : {}),
    });
    if (lockAhead) locks.attach(r);
    h.cleanups.push(async () => t.openForGood());

    await h.utils.addJobs(
      Array.from({ length: 3 }, (_, i) => ({ identifier, payload: { n: `held-${i}` } })),
    );
    await waitFor(async () => (await h.jobRows()).length === 1 && t.started.length === 1, {
      message: "one job to run and two to be dropped",
    });
    expect(t.conflicts).toHaveLength(2);
    // (this process holds one slot; the other two are another session's)
    expect(local).toEqual([false, false]);
    expect(await t.task.lockAvailable({ n: "any" })).toBe(false);

    for (const other of others) await other.release();
    t.open();
    await waitFor(async () => (await h.jobRows()).length === 0, {
      message: "the running job to end",
    });
    await h.utils.addJobs(
      Array.from({ length: 3 }, (_, i) => ({ identifier, payload: { n: `free-${i}` } })),
    );
    await waitFor(async () => t.started.length + t.conflicts.length >= 4 + 2, {
      message: "three more jobs to start or conflict",
    });
    expect(t.conflicts).toHaveLength(2);
    t.openForGood();
    await waitFor(async () => (await h.jobRows()).length === 0, {
      message: "every job to complete",
    });
    const executions = await readExecutions(db.pool(), identifier);
    expect(executions).toHaveLength(4);
    expect(maxConcurrencyPerKey(executions.filter((e) => e.note?.startsWith("held-")))).toEqual(
      new Map([["one", 1]]),
    );
    expect(maxConcurrencyPerKey(executions.filter((e) => e.note?.startsWith("free-")))).toEqual(
      new Map([["one", 3]]),
    );
  });
});
