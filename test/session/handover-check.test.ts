/**
 * The check of an in-memory hand-over (a finished hold passes its key to the job it woke early, without an
 * unlock) costs no statement of its own: the woken job gets its hold from the answer of the next lock
 * statement, which carries the new hold's early wake. (That the check still stops a hand-over on a dead
 * session is handover-loss.test.ts's.)
 * Real PostgreSQL, a real graphile-worker runner.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent } from "../support/runner.js";

const h = useExclusiveHarness();
const { cleanups, newLocks, runner, parkedCount } = h;

/** Counts, from now until the test ends, the lock statements and the heartbeat-shaped checks sent. */
function countStatements() {
  const counts = { lock: 0, check: 0 };
  const original = pg.Client.prototype.query;
  cleanups.push(async () => void (pg.Client.prototype.query = original));
  pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
    const config = args[0] as { name?: string; text?: string } | string | undefined;
    const text = typeof config === "string" ? config : config?.text;
    if (typeof config === "object" && config?.name?.startsWith("gwl_lock_")) counts.lock++;
    else if (text?.startsWith("select pg_catalog.pg_backend_pid() as pid")) counts.check++;
    return (original as (...a: unknown[]) => unknown).apply(this, args);
  } as typeof original;
  return counts;
}

describe("hand-over check", () => {
  it("rides on the lock statement that carries the new hold's early wake: no statement of its own", async () => {
    // No heartbeat within the test: a heartbeat-shaped statement can only be a hand-over's own check.
    const locks = newLocks({ heartbeatInterval: 60_000, heartbeatTimeout: 60_000 });
    const gate = deferred();
    cleanups.push(async () => gate.resolve());
    const started: number[] = [];
    const task = locks.exclusive(
      "handover_check",
      async (p: { n: number; gated?: boolean }) => {
        started.push(p.n);
        if (p.gated) await gate.promise;
      },
      { key: () => "one key", onConflict: "reschedule" },
    );
    const r = await runner({
      connectionString: h.db.url,
      concurrency: 3,
      taskList: { handover_check: task },
    });
    locks.attach(r);
    const fetched = (n: number) =>
      new Promise<void>((resolve) =>
        r.events.on("job:start", ({ job }) => {
          if ((job.payload as { n: number }).n === n) resolve();
        }),
      );

    // Short jobs teach the task its usual hold, so that a new hold wakes the next job in line at once.
    await locks.addJobs(
      Array.from({ length: 20 }, (_, n) => ({ identifier: "handover_check", payload: { n } })),
    );
    await waitFor(async () => started.length === 20, { message: "the teaching jobs to run" });
    await waitFor(async () => (await parkedCount()) === 0, { message: "the line to empty" });

    // 100 runs and releases at once; 101 takes the key with 102 in line, wakes it early, and holds the key
    // until 102 was fetched here and waits to be handed it.
    const fetched102 = fetched(102);
    const held101 = nextEvent(
      locks,
      "lock:acquired",
      (e) => (e.job.payload as { n: number }).n === 101,
    );
    await locks.addJobs(
      [100, 101, 102].map((n) => ({
        identifier: "handover_check",
        payload: { n, ...(n === 101 ? { gated: true } : {}) },
      })),
    );
    await held101;
    await fetched102;
    const handedOver = locks.status().handoffs.handedOver;

    const counts = countStatements();
    const held102 = nextEvent(
      locks,
      "lock:acquired",
      (e) => (e.job.payload as { n: number }).n === 102,
    );
    gate.resolve();
    await held102;
    expect(locks.status().handoffs.handedOver).toBe(handedOver + 1);
    expect(counts).toEqual({ lock: 1, check: 0 });
  });
});
