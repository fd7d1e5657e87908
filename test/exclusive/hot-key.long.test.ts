/**
 * One hot `reschedule` key worked by two processes: the key passes from job to job within a process
 * (in memory, or kept at its release for the job woken early that this process fetches) and between them,
 * and the line's order holds throughout: no job starts before an older one of its key, whichever process
 * holds it, so no process keeps the key while an older job of another process waits.
 * With graphile-worker's local queue, the jobs of a batch that meet the key held wait in line at their
 * workers rather than park: each is fetched once.
 * Real graphile-worker runners in separate Node processes, starts and ends stamped by the database's clock.
 */
import { makeWorkerUtils } from "graphile-worker";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { makeLocks, type HandoffCounts, type Locks } from "../../src/index.js";
import { useTestDatabase, waitForNoJobs } from "../support/db.js";
import { maxConcurrencyPerKey, readEvents, readExecutions } from "../support/executions.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";

const db = useTestDatabase();
let locks: Locks;

beforeAll(() => {
  locks = makeLocks({ connectionString: db.url });
});
afterAll(async () => {
  await locks?.release();
});

describe("a hot key across two processes", () => {
  it("2 processes x concurrency 8, 300 jobs of 2 ms on one key enqueued with locks.addJobs: each runs once, alone, in enqueue order", async () => {
    // The enqueuing process defines the task as the workers do (same key); its safety net, 10 s, outlasts the run.
    locks.exclusive("exec", async () => undefined, {
      key: (p: { k: string }) => ({ k: p.k }),
      onConflict: "reschedule",
      reschedule: { minDelay: 20, maxDelay: 10_000 },
    });
    const jobs = 300;
    const added = await locks.addJobs(
      Array.from({ length: jobs }, (_, n) => ({
        identifier: "exec",
        payload: { k: "hot", ms: 2, n },
      })),
    );
    expect(added.map((r) => r.outcome)).toEqual(Array(jobs).fill("added"));
    const workers: WorkerProcess[] = [];
    try {
      for (const name of ["h1", "h2"])
        workers.push(
          await startWorkerProcess(db.url, {
            name,
            concurrency: 8,
            strategy: "reschedule",
            attach: true,
          }),
        );
      await waitForNoJobs(db.pool(), { timeoutMs: 240_000 });
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }

    const executions = await readExecutions(db.pool());
    expect(executions).toHaveLength(jobs);
    expect(executions.every((e) => e.end !== null)).toBe(true);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    const order = executions
      .sort((a, b) => (a.start < b.start ? -1 : 1))
      .map((e) => Number(e.note));
    expect(order).toEqual(Array.from({ length: jobs }, (_, n) => n));
    const handoffs = (await readEvents(db.pool(), "handoffs")).map(
      (e) => e.detail as HandoffCounts,
    );
    expect(handoffs).toHaveLength(2);
    expect(handoffs.reduce((n, h) => n + h.handedOver, 0)).toBeGreaterThan(0);
  }, 300_000);

  it("2 processes x concurrency 8 with local queues of 50, 300 jobs of 2 ms on one key enqueued with graphile-worker's addJobs: each runs once, alone, nearly all fetched once", async () => {
    await db.pool().query("truncate test_executions, test_events");
    const jobs = 300;
    const utils = await makeWorkerUtils({ connectionString: db.url });
    try {
      await utils.addJobs(
        Array.from({ length: jobs }, (_, n) => ({
          identifier: "exec",
          payload: { k: "hot", ms: 2, n },
        })),
      );
    } finally {
      await utils.release();
    }
    const workers: WorkerProcess[] = [];
    try {
      for (const name of ["q1", "q2"])
        workers.push(
          await startWorkerProcess(db.url, {
            name,
            concurrency: 8,
            strategy: "reschedule",
            localQueue: true,
            attach: true,
          }),
        );
      await waitForNoJobs(db.pool(), { timeoutMs: 240_000 });
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }

    const executions = await readExecutions(db.pool());
    expect(new Set(executions.map((e) => e.note)).size).toBe(jobs);
    expect(executions).toHaveLength(jobs);
    expect(executions.every((e) => e.end !== null)).toBe(true);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    // Parking would fetch each job twice (its copy again); waiting in line fetches it once. A job whose
    // second in line runs out on a loaded machine parks, hence "nearly".
    const parks = (await readEvents(db.pool(), "job:rescheduled")).length;
    expect(parks).toBeLessThanOrEqual(jobs / 10);
    const handoffs = (await readEvents(db.pool(), "handoffs")).map(
      (e) => e.detail as HandoffCounts,
    );
    expect(handoffs).toHaveLength(2);
    expect(handoffs.reduce((n, h) => n + h.waitedInLine, 0)).toBeGreaterThan(jobs / 2);
  }, 300_000);
});
