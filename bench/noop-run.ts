/**
 * One uncontended run of no-op jobs in this process: a real graphile-worker runner (concurrency 8, no
 * lock-ahead) over jobs of distinct payloads, of a task wrapped with `options` (or, with `options: null`, a
 * plain graphile-worker task: what one lock statement per job costs is a plain exclusive run less that
 * one). Jobs per second, lock statements per job (the lock session's count), and PostgreSQL's CPU per job
 * (cpu.ts), once the runner has run a few jobs of the task (so that its connections are open). The limits
 * and rates sections compare such runs, alternating.
 */
import type { Runner, Task } from "graphile-worker";
import type { ExclusiveOptions, Locks } from "../src/index.js";
import { cpuBetween, cpuSnapshot } from "./cpu.js";
import { library } from "./library.js";
import { insertJobs, machineClock as clock, quietLogger, resetJobs, startRunner } from "./lib.js";
import { waitUntilNoJobs, type BenchContext } from "./lib.js";

export const NOOP_CONCURRENCY = 8;

export type NoopPayload = { i: number };

export interface NoopRun {
  jobsPerSecond: number;
  statementsPerJob: number;
  serverCpuUsPerJob: number;
}

/** `body`: what each job does instead of nothing (its payload, graphile-worker's helpers). */
export async function noopRun(
  ctx: BenchContext,
  taskIdentifier: string,
  options: ExclusiveOptions<NoopPayload> | null,
  jobs: number,
  body?: Task,
): Promise<NoopRun> {
  const locks: Locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  let runner: Runner | undefined;
  try {
    const noop: Task = body ?? (async () => undefined);
    const task = options ? locks.exclusive(taskIdentifier, noop, options) : noop;
    await locks.connect();
    runner = await startRunner({
      connectionString: ctx.url,
      concurrency: NOOP_CONCURRENCY,
      taskList: { [taskIdentifier]: task },
      pollInterval: 100,
    });
    // (warm: the runner's pool opens its connections, and they plan the library's statements, before the
    // measured jobs, as in a worker that has been running)
    await insertJobs(ctx.pool, taskIdentifier, Math.min(200, jobs));
    await runner.addJob(taskIdentifier, { i: 0 });
    await waitUntilNoJobs(ctx.pool, 300_000);
    await insertJobs(ctx.pool, taskIdentifier, jobs);
    const statementsBefore = locks.status().statements;
    const cpuBefore = cpuSnapshot();
    const started = clock();
    await runner.addJob(taskIdentifier, { i: 0 }); // (wakes the runner, whatever its poll)
    await waitUntilNoJobs(ctx.pool, 300_000);
    const ms = clock() - started;
    const cpu = cpuBetween(cpuBefore, cpuSnapshot());
    // (the last unlocks may still be on their way: let them land before counting)
    await new Promise((resolve) => setTimeout(resolve, 200));
    const statements = locks.status().statements - statementsBefore;
    return {
      jobsPerSecond: ((jobs + 1) / ms) * 1000,
      statementsPerJob: statements / (jobs + 1),
      serverCpuUsPerJob: (cpu.serverMs / (jobs + 1)) * 1000,
    };
  } finally {
    await runner?.stop();
    await locks.release();
    await resetJobs(ctx.pool);
  }
}
