/**
 * One key under graphile-worker's local queue (`localQueue.size` 50, concurrency 10), on graphile-worker
 * 0.17.3 and 0.18 alike. 0.17's batch fetch can hand out several jobs of one named queue at once
 * (graphile/worker#621); whatever a version's fetch does, an exclusive key (limit 1) never runs two jobs at
 * once. Half the jobs are in a named queue, half in none. Executions are recorded with the database's
 * clock. Real PostgreSQL, real runners of both versions, lock-ahead attached.
 */
import * as gw17 from "graphile-worker-0.17";
import * as gw18 from "graphile-worker-0.18";
import type { JobHelpers } from "graphile-worker";
import { describe, expect, it } from "vitest";
import { makeLocks, type ExclusiveOptions, type Locks } from "../../src/index.js";
import { waitForNoJobs } from "../support/db.js";
import { maxConcurrencyPerKey, readExecutions, type Execution } from "../support/executions.js";
import { useScratchDatabases } from "../support/scratch.js";

const scratch = useScratchDatabases();

const JOBS = 100;

interface Version {
  name: string;
  /** How many jobs of one named queue this version alone runs at once here (graphile/worker#621). */
  namedQueueAlone: "several" | "one";
  migrate(url: string): Promise<void>;
  run(options: {
    url: string;
    taskList: Record<string, unknown>;
  }): Promise<{ stop(): Promise<void>; events: unknown }>;
}

const quiet17 = new gw17.Logger(() => () => undefined);
const quiet18 = new gw18.Logger(() => () => undefined);
const localQueue = { worker: { localQueue: { size: 50 }, completeJobBatchDelay: 0 } };

const VERSIONS: Version[] = [
  {
    name: "graphile-worker 0.17.3",
    namedQueueAlone: "several",
    migrate: (url) => gw17.runMigrations({ connectionString: url, logger: quiet17 }),
    run: ({ url, taskList }) =>
      gw17.run({
        connectionString: url,
        concurrency: 10,
        taskList: taskList as gw17.TaskList,
        noHandleSignals: true,
        pollInterval: 50,
        logger: quiet17,
        preset: localQueue,
      }),
  },
  {
    name: "graphile-worker 0.18",
    namedQueueAlone: "one",
    migrate: (url) => gw18.runMigrations({ connectionString: url, logger: quiet18 }),
    run: ({ url, taskList }) =>
      gw18.run({
        connectionString: url,
        concurrency: 10,
        taskList: taskList as gw18.TaskList,
        noHandleSignals: true,
        pollInterval: 50,
        logger: quiet18,
        preset: localQueue,
      }),
  },
];

const CASES: Array<{ name: string; options: ExclusiveOptions<{ n: number }> }> = [
  {
    name: "exclusive (default limit), reschedule",
    options: {
      key: () => "one",
      onConflict: "reschedule",
      reschedule: { minDelay: 20, maxDelay: 100 },
    },
  },
  { name: "limit: 1, drop", options: { key: () => "one", limit: 1, onConflict: "drop" } },
];

/** The test_executions table of the shared test databases, in a scratch database. */
const EXECUTIONS_TABLE = `create table public.test_executions (
  id bigserial primary key, job_id bigint, task text, lock_key text, worker text, attempts int,
  started_at timestamptz not null default clock_timestamp(), ended_at timestamptz, note text
)`;

/**
 * Runs `JOBS` jobs of task `one_key` (half in the named queue "q621") on a fresh database with `version`'s
 * runner, `wrap` making the task from a body that records each execution; resolves the executions and how
 * many jobs were dropped. Lock-ahead is attached when `wrap` is given a `Locks`; no advisory lock is left.
 */
async function runOneKey(
  version: Version,
  wrap:
    | ((
        locks: Locks,
        body: (payload: { n: number }, helpers: JobHelpers) => Promise<void>,
      ) => unknown)
    | null,
): Promise<{ executions: Execution[]; dropped: number }> {
  const url = await scratch.create();
  await version.migrate(url);
  const pool = scratch.pool(url);
  await pool.query(EXECUTIONS_TABLE);
  const body = async (payload: { n: number }, helpers: JobHelpers) => {
    const { rows } = await pool.query<{ id: string }>(
      "insert into test_executions (job_id, task, lock_key, worker, attempts, note) values ($1, 'one_key', 'one', 'w', $2, $3) returning id",
      [helpers.job.id, helpers.job.attempts, String(payload.n)],
    );
    await new Promise((resolve) => setTimeout(resolve, 3));
    await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
      rows[0]!.id,
    ]);
  };
  const locks = makeLocks({ connectionString: url, logger: quiet18 });
  let runner: Awaited<ReturnType<Version["run"]>> | undefined;
  let dropped = 0;
  try {
    await locks.migrate();
    locks.events.on("job:dropped", () => void dropped++);
    const task = wrap ? wrap(locks, body) : body;
    // All jobs are in the table before the runner's first fetch: its batches are full ones.
    await locks.addJobs(
      Array.from({ length: JOBS }, (_, n) => ({
        identifier: "one_key",
        payload: { n },
        ...(n % 2 === 0 ? { queueName: "q621" } : {}),
      })),
    );
    runner = await version.run({ url, taskList: { one_key: task } });
    if (wrap) locks.attach(runner as Parameters<Locks["attach"]>[0]);
    await waitForNoJobs(pool, {
      timeoutMs: 50_000,
      message: `all ${JOBS} jobs to complete`,
    });
    await runner.stop();
    runner = undefined;
  } finally {
    await runner?.stop();
    await locks.release();
  }
  const { rows } = await pool.query<{ n: number }>(
    "select count(*)::int as n from pg_locks where locktype = 'advisory' and database = (select oid from pg_database where datname = current_database())",
  );
  expect(rows[0]!.n).toBe(0);
  return { executions: await readExecutions(pool, "one_key"), dropped };
}

describe.each(VERSIONS)(
  "one key under the local queue (size 50, concurrency 10), $name",
  (version) => {
    it(`plain graphile-worker runs ${version.namedQueueAlone === "one" ? "one job" : "several jobs"} of one named queue at once`, async () => {
      const { executions } = await runOneKey(version, null);
      const queued = executions.filter((e) => Number(e.note) % 2 === 0);
      expect(queued).toHaveLength(JOBS / 2);
      const highest = maxConcurrencyPerKey(queued).get("one")!;
      if (version.namedQueueAlone === "one") expect(highest).toBe(1);
      else expect(highest).toBeGreaterThan(1);
    });

    it.each(CASES)(
      `$name: ${JOBS} jobs, half in one named queue, never two at once`,
      async ({ options }) => {
        const { executions, dropped } = await runOneKey(version, (locks, body) =>
          locks.exclusive("one_key", body, options),
        );
        expect(executions.length).toBeGreaterThan(0);
        expect(maxConcurrencyPerKey(executions)).toEqual(new Map([["one", 1]]));
        // Every job ran once, or (drop) was dropped.
        const ran = new Set(executions.map((e) => e.note));
        expect(ran.size).toBe(executions.length);
        expect(executions.length + dropped).toBe(JOBS);
        if (options.onConflict === "reschedule") expect(ran.size).toBe(JOBS);
      },
    );
  },
);
