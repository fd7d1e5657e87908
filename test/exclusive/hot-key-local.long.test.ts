/**
 * A hot `reschedule` key under graphile-worker's local queue: the jobs of the key that one fetch brought into
 * the local queue wait in this process for the key and take it from each other in memory, in job id order,
 * instead of each parking and being fetched again. Executions are recorded with the database's clock. Real
 * PostgreSQL, a real graphile-worker runner with lock-ahead attached. The key passes in memory only within a
 * bound of its last grant by a lock statement; then it goes through the database, where a job of another
 * lock session (a second `Locks` instance and runner, on connections of their own) older in the key's line
 * takes it. Run with TEST_LONG=1 (CI runs it with the long checks).
 */
import { describe, expect, it } from "vitest";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { maxConcurrencyPerKey, readExecutions } from "../support/executions.js";
import { countEvents, startRunner } from "../support/runner.js";

const h = useExclusiveHarness("truncate test_executions");
const { db, newLocks, runner } = h;

const JOBS = 60;

describe("a hot key under the local queue", () => {
  it(`${JOBS} jobs of one key fetched together: each fetched once, run alone, in job id order`, async () => {
    const locks = newLocks();
    const pool = db.pool();
    const task = locks.exclusive(
      "hot_local",
      async (payload: { n: number }, helpers) => {
        const { rows } = await pool.query<{ id: string }>(
          "insert into test_executions (job_id, task, lock_key, worker, attempts, note) values ($1, 'hot_local', 'hot', 'w', $2, $3) returning id",
          [helpers.job.id, helpers.job.attempts, String(payload.n)],
        );
        await new Promise((resolve) => setTimeout(resolve, 2));
        await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
          rows[0]!.id,
        ]);
      },
      {
        key: () => "hot",
        onConflict: "reschedule",
        reschedule: { minDelay: 20, maxDelay: 10_000 },
      },
    );
    const counts = countEvents(locks, ["job:rescheduled"]);
    // Runnable jobs (graphile-worker's own add_jobs, not in the key's line), all in the table before the
    // runner's first fetch: its first batch holds fifty of them.
    const added = await h.utils.addJobs(
      Array.from({ length: JOBS }, (_, n) => ({ identifier: "hot_local", payload: { n } })),
    );
    // Each job's place in job id order, and its id, by its `n` (a parked job's copy has a new id).
    const ids = added.map((job) => BigInt(job.id)).sort((a, b) => (a < b ? -1 : 1));
    const firstId = new Map(added.map((job) => [String((job.payload as { n: number }).n), job.id]));
    const rankOf = (n: string) => ids.indexOf(BigInt(firstId.get(n)!));
    const r = await runner({
      connectionString: db.url,
      concurrency: 8,
      taskList: { hot_local: task },
      preset: { worker: { localQueue: { size: 50 }, completeJobBatchDelay: 0 } },
    });
    locks.attach(r);
    await waitFor(
      async () => {
        const { rows } = await pool.query<{ n: number }>(
          "select count(*)::int as n from graphile_worker.jobs",
        );
        return rows[0]!.n === 0;
      },
      { timeoutMs: 120_000, message: `all ${JOBS} jobs to complete` },
    );

    const executions = await readExecutions(pool, "hot_local");
    expect(executions).toHaveLength(JOBS);
    expect(new Set(executions.map((e) => e.note)).size).toBe(JOBS);
    expect(maxConcurrencyPerKey(executions)).toEqual(new Map([["hot", 1]]));
    // Fetches: one per job, and one more per park (a parked job's copy is fetched again).
    expect(counts["job:rescheduled"]).toBeLessThanOrEqual(JOBS / 4);
    expect(locks.status().handoffs.localQueue).toBeGreaterThan(0);
    // Jobs that never parked started in job id order.
    const order = executions
      .filter((e) => e.jobId === firstId.get(e.note!))
      .sort((a, b) => (a.start < b.start ? -1 : 1))
      .map((e) => rankOf(e.note!));
    expect(order.length).toBeGreaterThanOrEqual(JOBS - counts["job:rescheduled"]!);
    expect(order).toEqual([...order].sort((a, b) => a - b));
  }, 150_000);

  it("a job of another lock session, older in the key's line, takes the key within the bound, not after the whole local queue", async () => {
    const pool = db.pool();
    const record =
      (task: string) => async (payload: { n: number }, helpers: { job: { id: string } }) => {
        const { rows } = await pool.query<{ id: string }>(
          "insert into test_executions (job_id, task, lock_key, worker, note) values ($1, $2, 'hot', $2, $3) returning id",
          [helpers.job.id, task, String(payload.n)],
        );
        await new Promise((resolve) => setTimeout(resolve, 100));
        await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
          rows[0]!.id,
        ]);
      };
    // Two tasks in one lock group share the key; each runner fetches only its own task's jobs.
    const options = {
      lockGroup: "fair",
      key: () => "hot",
      onConflict: "reschedule",
      reschedule: { minDelay: 20, maxDelay: 10_000 },
    } as const;
    const a = newLocks();
    const b = newLocks();
    const taskA = a.exclusive("fair_a", record("fair_a"), options);
    const taskB = b.exclusive("fair_b", record("fair_b"), options);
    // The other session's job first: it is older in the key's line than every job of the local queue.
    await h.utils.addJobs([{ identifier: "fair_b", payload: { n: -1 } }]);
    const queued = 40;
    await h.utils.addJobs(
      Array.from({ length: queued }, (_, n) => ({ identifier: "fair_a", payload: { n } })),
    );
    const ra = await runner({
      connectionString: db.url,
      concurrency: 8,
      taskList: { fair_a: taskA },
      preset: { worker: { localQueue: { size: 50 }, completeJobBatchDelay: 0 } },
    });
    a.attach(ra);
    const started = async (task: string) => {
      const { rows } = await pool.query<{ n: number }>(
        "select count(*)::int as n from test_executions where task = $1",
        [task],
      );
      return rows[0]!.n;
    };
    await waitFor(async () => (await started("fair_a")) >= 3, {
      message: "the hot key's line to run",
    });
    // The other session fetches its job, which meets the key held by the first session and parks: the
    // first conflict is stamped (database clock) as when it began to wait.
    let stamped = false;
    b.events.on("lock:conflict", () => {
      if (stamped) return;
      stamped = true;
      void pool.query("insert into test_executions (task, note) values ('fetch_b', 'from')");
    });
    const rb = await startRunner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { fair_b: taskB },
    });
    h.cleanups.push(() => rb.stop());
    await waitFor(
      async () => {
        const { rows } = await pool.query<{ n: number }>(
          "select count(*)::int as n from graphile_worker.jobs",
        );
        return rows[0]!.n === 0;
      },
      { timeoutMs: 120_000, message: `all ${queued + 1} jobs to complete` },
    );
    // (its job may also have found the key between two holds and run at once: then no job went first)
    const [from] = (
      await pool.query<{ at: Date }>(
        "select started_at as at from test_executions where task = 'fetch_b'",
      )
    ).rows;
    const executions = [
      ...(await readExecutions(pool, "fair_a")),
      ...(await readExecutions(pool, "fair_b")),
    ];
    expect(executions).toHaveLength(queued + 1);
    expect(new Set(executions.map((e) => e.note)).size).toBe(queued + 1);
    expect(maxConcurrencyPerKey(executions)).toEqual(new Map([["hot", 1]]));
    const other = executions.find((e) => e.note === "-1")!;
    expect(other).toBeDefined();
    // Jobs of the local queue that started after the other session's job began to wait, and before it: the
    // key passes in memory only within releaseWaitMs (twice the usual hold, at most a second) of its last
    // grant by a lock statement, so at most 1000 / 100 + 1 jobs per grant, and two grants (one may have come
    // just before the other job joined the line). Without the bound, the whole local queue (about 35 jobs)
    // goes first.
    const fromUs = from ? BigInt(from.at.getTime()) * 1000n : other.start;
    const ahead = executions.filter(
      (e) => e.note !== "-1" && e.start > fromUs && e.start < other.start,
    );
    expect(ahead.length).toBeLessThanOrEqual(22);
  }, 150_000);
});
