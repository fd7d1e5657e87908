/**
 * A worker process of the supersede section (supersede.ts), forked twice and kept. Its runner (concurrency
 * 4, attached to its lock session) runs `bs_job`, a `reschedule` task keyed by `payload.k`: a job runs until
 * its abort signal fires (at most `payload.ms`) and records, on the machine's monotonic clock, its start, its
 * end (just before it returns, so the release comes after) and when its signal fired; it tells the parent
 * when a job starts (event `started`, the job's id).
 *
 * Requests: `reset` (forgets the records), `collect` (answers them).
 */
import type { JobHelpers } from "graphile-worker";
import type { ExclusiveOptions } from "../src/index.js";
import { machineClock as clock, quietLogger, sendEvent, startRunner, workerMain } from "./lib.js";
import { library } from "./library.js";

export const SUPERSEDE_TASK = "bs_job";

export type SupersedePayload = { k: string; ms: number };

/** How every process defines the task (and the bench, which enqueues). */
export const supersedeOptions: ExclusiveOptions<SupersedePayload> = {
  onConflict: "reschedule",
  key: (p) => p.k,
  reschedule: { minDelay: 30_000, maxDelay: 60_000 },
};

export interface SupersedeMark {
  jobId: string;
  k: string;
  start: number;
  end: number;
  /** When its abort signal fired, if it did. */
  aborted: number | null;
  reason: string | null;
}

export type SupersedeRequest = { type: "reset" } | { type: "collect" };

workerMain<SupersedeRequest>(import.meta.url, async (url, name) => {
  let marks: SupersedeMark[] = [];
  const locks = library.makeLocks({
    connectionString: url,
    logger: quietLogger,
    applicationName: `gwl-bench-supersede/${name}`,
  });
  const task = locks.exclusive<SupersedePayload>(
    SUPERSEDE_TASK,
    async (payload, { abortSignal, job }: JobHelpers) => {
      const mark: SupersedeMark = {
        jobId: job.id,
        k: payload.k,
        start: clock(),
        end: 0,
        aborted: null,
        reason: null,
      };
      sendEvent("started", job.id);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, payload.ms);
        abortSignal?.addEventListener(
          "abort",
          () => {
            mark.aborted = clock();
            mark.reason = (abortSignal.reason as { code?: string }).code ?? null;
            clearTimeout(timer);
            resolve();
          },
          { once: true },
        );
      });
      mark.end = clock();
      marks.push(mark);
    },
    supersedeOptions,
  );
  await locks.connect();
  const runner = await startRunner({
    connectionString: url,
    concurrency: 4,
    taskList: { [SUPERSEDE_TASK]: task } as never,
    pollInterval: 1_000,
  });
  locks.attach(runner);
  return {
    handlers: {
      reset: () => void (marks = []),
      collect: (): SupersedeMark[] => marks,
    },
    async leave() {
      await runner.stop();
      await locks.release();
    },
  };
});
