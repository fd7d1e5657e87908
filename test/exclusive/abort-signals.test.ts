/**
 * The abort signal a locked job sees, with many jobs running at once in one worker pool: graphile-worker's
 * pool signal and the lock session's are shared by every job, so what listens to them must not grow with the
 * jobs (Node.js warns of a leak past ten listeners on one signal, in the user's logs). Real PostgreSQL, a real
 * graphile-worker runner.
 */
import type { JobHelpers, TaskList } from "graphile-worker";
import { describe, expect, it } from "vitest";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";

const h = useExclusiveHarness();
const { db, newLocks, runner, q } = h;

/** Node.js's warnings emitted from now until `stop`. */
function recordWarnings() {
  const warnings: Error[] = [];
  const listener = (warning: Error) => warnings.push(warning);
  process.on("warning", listener);
  h.cleanups.push(async () => void process.off("warning", listener));
  return warnings;
}

describe("abort signals of many jobs at once", () => {
  it("24 jobs of 12 tasks each looking at its signal: no listener-leak warning, and every signal still aborts", async () => {
    const locks = newLocks();
    const warnings = recordWarnings();
    const release = deferred();
    const signals: AbortSignal[] = [];
    const body = async (_payload: unknown, helpers: JobHelpers) => {
      const signal = helpers.abortSignal!;
      signal.addEventListener("abort", () => undefined);
      signals.push(signal);
      // (a task that ends when its signal aborts, or when the test lets it)
      await Promise.race([release.promise, helpers.abortPromise?.catch(() => undefined)]);
    };
    const taskList: TaskList = {};
    for (let t = 0; t < 12; t++) {
      // Half `reschedule` (a signal per job: it may be superseded), half not (one per worker and session).
      taskList[`signal_${t}`] = locks.exclusive(`signal_${t}`, body, {
        key: (p: { n: number }) => p.n,
        onConflict: t % 2 === 0 ? "reschedule" : "drop",
      });
    }
    await locks.connect();
    await runner({ connectionString: db.url, concurrency: 24, taskList });
    for (let n = 0; n < 24; n++) await locks.addJob(`signal_${n % 12}`, { n });
    await waitFor(async () => signals.length === 24, { message: "all 24 jobs to run at once" });
    // (warnings are emitted on a later tick)
    await new Promise((resolve) => setImmediate(resolve));
    expect(warnings.filter((w) => w.name === "MaxListenersExceededWarning")).toEqual([]);

    // The session's loss still reaches every job: each signal aborts, with the lock-lost error.
    await q("select pg_terminate_backend($1)", [locks.status().pid]);
    await waitFor(async () => signals.every((s) => s.aborted), {
      message: "every job's signal to abort on the session's loss",
    });
    expect(new Set(signals.map((s) => (s.reason as { code?: string }).code))).toEqual(
      new Set(["GWL_LOCK_LOST"]),
    );
    release.resolve();
  });
});
