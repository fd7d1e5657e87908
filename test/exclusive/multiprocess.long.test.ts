/**
 * Cross-process claims, with real graphile-worker runners in separate Node processes sharing one database.
 */
import { makeWorkerUtils, type WorkerUtils } from "graphile-worker";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { lockKey, makeLocks, type HandoffCounts, type Locks } from "../../src/index.js";
import { useTestDatabase, waitFor, waitForNoJobs } from "../support/db.js";
import { maxConcurrencyPerKey, readEvents, readExecutions } from "../support/executions.js";
import {
  startWorkerProcess,
  type WorkerProcess,
  type WorkerProcessOptions,
} from "../support/processes.js";

const db = useTestDatabase();
let utils: WorkerUtils;
let locks: Locks;

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url });
  locks = makeLocks({ connectionString: db.url });
});
afterAll(async () => {
  await locks?.release();
  await utils?.release();
});

async function reset() {
  await db
    .pool()
    .query("truncate test_executions, test_events; delete from graphile_worker._private_jobs");
}

async function drained(): Promise<void> {
  await waitForNoJobs(db.pool(), { timeoutMs: 60_000 });
}

/**
 * Starts one worker process per options, then runs `enqueue` (if any), waits until every job is gone, and
 * stops them all, whatever happened.
 */
async function runWorkers(
  processes: WorkerProcessOptions[],
  enqueue?: () => Promise<void>,
): Promise<void> {
  const workers: WorkerProcess[] = [];
  try {
    for (const options of processes) workers.push(await startWorkerProcess(db.url, options));
    await enqueue?.();
    await drained();
  } finally {
    await Promise.all(workers.map((w) => w.stop()));
  }
}

/** Every one of `jobs` jobs over `keys` keys ran to its end, once, and no key ran twice at once. */
async function expectEachRanOnceAlone(keys: number, jobs: number) {
  const executions = await readExecutions(db.pool());
  const perKey = maxConcurrencyPerKey(executions);
  expect(perKey.size).toBe(keys);
  expect(Math.max(...perKey.values())).toBe(1);
  // (a parked job runs under a new id: none may be left behind or run twice)
  expect(executions).toHaveLength(jobs);
  expect(executions.every((e) => e.end !== null)).toBe(true);
  return { executions, perKey };
}

describe("exclusive execution across processes", () => {
  it("3 processes x concurrency 8, 2,000 jobs over 20 keys: no overlap per key, every job accounted for", async () => {
    await reset();
    const names = ["p1", "p2", "p3"];
    await runWorkers(
      names.map((name) => ({ name, concurrency: 8, strategy: "drop" })),
      async () => {
        // Bulk-added without the preemptive check, so that duplicates really meet at run time.
        const specs = Array.from({ length: 2000 }, (_, i) => ({
          identifier: "exec",
          payload: { k: `key-${i % 20}`, ms: 5 + (i % 16) },
        }));
        const added = await utils.addJobs(specs);
        expect(added).toHaveLength(2000);
      },
    );

    const executions = await readExecutions(db.pool());
    const dropped = await readEvents(db.pool(), "job:dropped");
    const conflicts = await readEvents(db.pool(), "lock:conflict");

    // No overlap per key, and real contention happened (or the test proves nothing).
    const perKey = maxConcurrencyPerKey(executions);
    expect(perKey.size).toBe(20);
    expect(Math.max(...perKey.values())).toBe(1);
    expect(dropped.length).toBeGreaterThan(0);
    expect(new Set(executions.map((e) => e.worker)).size).toBe(3);

    // Accounted for: each job either executed once or was dropped with its event, never both, never neither.
    const executedIds = executions.map((e) => e.jobId);
    const droppedIds = dropped.map((e) => e.jobId);
    expect(new Set(executedIds).size).toBe(executedIds.length);
    expect(new Set(droppedIds).size).toBe(droppedIds.length);
    const all = new Set([...executedIds, ...droppedIds]);
    expect(all.size).toBe(2000);
    expect(executedIds.length + droppedIds.length).toBe(2000);
    expect(conflicts.length).toBe(dropped.length);
  });

  it("reschedule, 3 processes x concurrency 4, 300 jobs over 3 keys: early wakes pass keys within and across processes, no overlap, every job runs once", async () => {
    await reset();
    // Two of the three give their runner to locks.attach: their early wakes go to their own workers.
    await runWorkers(
      ["r1", "r2", "r3"].map((name) => ({
        name,
        concurrency: 4,
        strategy: "reschedule",
        attach: name !== "r3",
      })),
      async () => {
        const added = await utils.addJobs(
          Array.from({ length: 300 }, (_, i) => ({
            identifier: "exec",
            payload: { k: `line-${i % 3}`, ms: 10 },
          })),
        );
        expect(added).toHaveLength(300);
      },
    );
    await expectEachRanOnceAlone(3, 300);
    expect((await readEvents(db.pool(), "job:rescheduled")).length).toBeGreaterThan(0);
    const handoffs = (await readEvents(db.pool(), "handoffs")).map((e) => ({
      worker: e.worker,
      ...(e.detail as HandoffCounts),
    }));
    expect(handoffs).toHaveLength(3);
    const sum = (field: keyof HandoffCounts) => handoffs.reduce((total, h) => total + h[field], 0);
    expect(sum("prewakes")).toBeGreaterThan(0);
    expect(sum("handedOver")).toBeGreaterThan(0);
    expect(sum("afterRelease")).toBeGreaterThan(0);
    const wokenHere = (worker: string) => handoffs.find((h) => h.worker === worker)!.wokenHere;
    expect(wokenHere("r1") + wokenHere("r2")).toBeGreaterThan(0);
    expect(wokenHere("r3")).toBe(0);
  });

  it("reschedule enqueued with locks.addJobs, 3 processes x concurrency 4, 300 jobs over 3 keys in line from the start: no overlap, every job runs once, in enqueue order", async () => {
    await reset();
    await db.pool().query("delete from graphile_worker_locks.waiters");
    // The enqueuing process defines the task as the workers do (same key); its safety net, 10 s, outlasts the run.
    locks.exclusive("exec", async () => undefined, {
      key: (p: { k: string }) => ({ k: p.k }),
      onConflict: "reschedule",
      reschedule: { minDelay: 20, maxDelay: 10_000 },
    });
    const added = await locks.addJobs(
      Array.from({ length: 300 }, (_, i) => ({
        identifier: "exec",
        payload: { k: `queued-${i % 3}`, ms: 10, n: i },
      })),
    );
    expect(added.map((r) => r.outcome)).toEqual(Array(300).fill("added"));
    const { rows } = await db
      .pool()
      .query<{ n: number }>("select count(*)::int as n from graphile_worker_locks.waiters");
    expect(rows[0]!.n).toBe(297);
    await runWorkers(
      ["q1", "q2", "q3"].map((name) => ({
        name,
        concurrency: 4,
        strategy: "reschedule",
        attach: true,
      })),
    );
    const { executions, perKey } = await expectEachRanOnceAlone(3, 300);
    // Each key's jobs ran in enqueue order (the database's clock orders the starts across processes). The
    // order is the payload's `n`, not the job id: a job its safety net fetched parks again as a copy with a
    // new id, and keeps its place in line.
    for (const key of perKey.keys()) {
      const order = executions
        .filter((e) => e.lockKey === key)
        .sort((a, b) => (a.start < b.start ? -1 : 1))
        .map((e) => Number(e.note));
      expect(order.every(Number.isInteger)).toBe(true);
      expect(order).toEqual([...order].sort((a, b) => a - b));
    }
    // Nothing was fetched only to park: the jobs waited in line from their enqueue.
    expect((await readEvents(db.pool(), "job:rescheduled")).length).toBeLessThan(10);
  });

  it("kill -9 of a worker mid-job: another process acquires the key at once", async () => {
    await reset();
    const victim = await startWorkerProcess(db.url, { name: "victim", concurrency: 2 });
    try {
      // The job holds its key until aborted, which never comes: the process is killed.
      await utils.addJob("exec", { k: "crash", hold: true });
      await waitFor(async () => (await readExecutions(db.pool())).length === 1, {
        message: "the victim to start",
      });
      expect(await locks.lockAvailable("exec", { k: "crash" })).toBe(false);

      const killedAt = Date.now();
      victim.child.kill("SIGKILL");
      await victim.exited;
      // The lock dies with the connection: no TTL to wait out.
      await waitFor(() => locks.lockAvailable("exec", { k: "crash" }), {
        timeoutMs: 10_000,
        message: "the lock to be freed",
      });
      const freedMs = Date.now() - killedAt;

      const next = await startWorkerProcess(db.url, { name: "next", concurrency: 2 });
      try {
        await utils.addJob("exec", { k: "crash", ms: 5 });
        await waitFor(
          async () =>
            (await readExecutions(db.pool())).some((e) => e.worker === "next" && e.end !== null),
          {
            message: "the other process to run the key",
          },
        );
      } finally {
        await next.stop();
      }
      const conflicts = await readEvents(db.pool(), "lock:conflict");
      expect(conflicts).toEqual([]);
      expect(freedMs).toBeLessThan(10_000);
      console.info(`lock freed ${freedMs} ms after SIGKILL`);
      // The crashed job itself stays locked by graphile-worker (its 4-hour rule), not by us.
      const { rows } = await db
        .pool()
        .query("select id from graphile_worker.jobs where locked_by is not null");
      expect(rows).toHaveLength(1);
    } finally {
      victim.child.kill("SIGKILL");
    }
  });

  it("lockAvailable is false while another process holds the key and true after", async () => {
    await reset();
    const worker = await startWorkerProcess(db.url, { name: "holder", concurrency: 1 });
    try {
      const key = lockKey("exec", { k: "probe" });
      expect(await locks.lockAvailable("exec", { k: "probe" })).toBe(true);
      await utils.addJob("exec", { k: "probe", ms: 1500 });
      await waitFor(async () => (await readExecutions(db.pool())).length === 1, {
        message: "the job to start",
      });
      expect(await locks.lockAvailable("exec", { k: "probe" })).toBe(false);
      expect(await locks.lockAvailable("exec", { k: "other" })).toBe(true);
      const held = await waitFor(
        async () => (await locks.heldLocks()).find((h) => h.lockKey === key && h.since),
        {
          message: "the holder registry to show the lock",
        },
      );
      expect(held.taskIdentifier).toBe("exec");
      expect(held.applicationName).toBe("graphile-worker-locks/holder");
      await waitFor(() => locks.lockAvailable("exec", { k: "probe" }), {
        message: "the lock to be released",
      });
    } finally {
      await worker.stop();
    }
  });
});
