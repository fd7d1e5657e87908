/**
 * A `reschedule` job fetched in a batch of graphile-worker's local queue that meets its key held waits in
 * the key's line at its worker (join_line, sql/000014.sql) instead of parking: it takes the key at the
 * release, fetched once; it waits at most a second, then parks at its place; it never waits behind a job
 * that needs a worker. Real PostgreSQL, real graphile-worker runners, two lock sessions (two `Locks`).
 */
import type { Runner } from "graphile-worker";
import { describe, expect, it } from "vitest";
import { lockKey, type Locks } from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent } from "../support/runner.js";
import { spannedTask } from "../support/spans.js";

const h = useExclusiveHarness();
const { cleanups, newLocks, runner, q, holdExternally, markFetched } = h;

const LOCAL_QUEUE = { worker: { localQueue: { size: 50 }, completeJobBatchDelay: 0 } };

/**
 * A task of `spannedTask` (jobs of 5 ms) in `lockGroup`; a parked copy waits for its wake (its safety net
 * is half a minute away).
 */
const groupTask = (locks: Locks, identifier: string, lockGroup: string) =>
  spannedTask(cleanups, locks, identifier, 5, {
    lockGroup,
    reschedule: { minDelay: 30_000, maxDelay: 60_000 },
  });

/** How many times each job (by payload `n`) was fetched by `r`'s workers, and when it last was. */
function countFetches(r: Runner) {
  const fetched = new Map<number, number>();
  const at = new Map<number, number>();
  r.events.on("job:start", ({ job }) => {
    const n = (job.payload as { n: number }).n;
    fetched.set(n, (fetched.get(n) ?? 0) + 1);
    at.set(n, performance.now());
  });
  return { fetched, at };
}

/**
 * Two lock sessions with a task each, `<group>_holder` and `<group>_batch`, of one key in lock group
 * `group`: `holder`'s runner runs the first (no local queue), the other's the second (a local queue,
 * attached). (Each runner knows only its task: a runner with forbidden flags would not fetch in batches.)
 */
async function twoSessions(group: string) {
  const holder = newLocks();
  const held = groupTask(holder, `${group}_holder`, group);
  await runner({
    connectionString: h.db.url,
    concurrency: 2,
    taskList: { [`${group}_holder`]: held.task },
  });
  const locks = newLocks();
  const batch = groupTask(locks, `${group}_batch`, group);
  const r = await runner({
    connectionString: h.db.url,
    concurrency: 2,
    preset: LOCAL_QUEUE,
    taskList: { [`${group}_batch`]: batch.task },
  });
  locks.attach(r);
  return { holder, held, locks, batch, ...countFetches(r) };
}

/** The waiter rows of `jobId`'s job (its place in a line). */
const waiterRows = async (jobId: string) => {
  const { rows } = await q<{ n: string }>(
    "select count(*) as n from graphile_worker_locks.waiters where job_id = $1",
    [jobId],
  );
  return Number(rows[0]!.n);
};

describe("a job fetched in a batch waits in line", () => {
  it("takes its key at the other session's release at its worker, fetched once, without parking", async () => {
    const { holder, held, locks, batch, fetched } = await twoSessions("line_wait_release");
    const rescheduled: string[] = [];
    locks.events.on("job:rescheduled", ({ job }) => rescheduled.push(job.id));
    const holding = nextEvent(holder, "lock:acquired");
    await holder.addJob("line_wait_release_holder", { n: 1, gated: true });
    await holding;
    const added = await locks.addJob("line_wait_release_batch", { n: 2 });
    const jobId = added.job!.id;
    // It waits at its worker, in line: its own row, its job still locked by that worker.
    await waitFor(async () => (await waiterRows(jobId)) === 1, {
      message: "job 2 to take its place in line",
    });
    expect(batch.spans.has(2)).toBe(false);
    held.gate.resolve();
    await waitFor(async () => batch.spans.get(2)?.end != null, { message: "job 2 to run" });
    expect(batch.spans.get(2)!.start).toBeGreaterThanOrEqual(held.spans.get(1)!.end!);
    expect(rescheduled).toEqual([]);
    expect(fetched.get(2)).toBe(1);
    expect(locks.status().handoffs.waitedInLine).toBe(1);
    await waitFor(async () => (await waiterRows(jobId)) === 0, {
      message: "job 2 to leave the line",
    });
  });

  it("waits at most a second, then parks at its place and runs once the key frees", async () => {
    const { holder, held, locks, batch, fetched } = await twoSessions("line_wait_timeout");
    const holding = nextEvent(holder, "lock:acquired");
    await holder.addJob("line_wait_timeout_holder", { n: 1, gated: true });
    await holding;
    const parked = nextEvent(locks, "job:rescheduled");
    const started = performance.now();
    const added = await locks.addJob("line_wait_timeout_batch", { n: 2 });
    await waitFor(async () => (await waiterRows(added.job!.id)) === 1, {
      message: "job 2 to take its place in line",
    });
    const { newJobId } = await parked;
    // (the second is counted from before the enqueue: the job waited its full second in line)
    expect(performance.now() - started).toBeGreaterThanOrEqual(1000);
    // Its copy has its row, at the same place; the job itself has left the line.
    expect(await waiterRows(added.job!.id)).toBe(0);
    expect(await waiterRows(newJobId)).toBe(1);
    held.gate.resolve();
    await waitFor(async () => batch.spans.get(2)?.end != null, { message: "job 2 to run" });
    expect(batch.spans.get(2)!.start).toBeGreaterThanOrEqual(held.spans.get(1)!.end!);
    expect(fetched.get(2)).toBe(2);
    expect(locks.status().handoffs.waitedInLine).toBe(0);
  });

  it("does not wait behind a parked job, which needs a worker: it parks at once, and both run in line order", async () => {
    const { holder, held, locks, batch, fetched, at } = await twoSessions("line_wait_behind");
    const holding = nextEvent(holder, "lock:acquired");
    await holder.addJob("line_wait_behind_holder", { n: 1, gated: true });
    await holding;
    // Job 2, of the holder's runner, meets the key held and parks (its copy waits for a worker).
    const parked2 = nextEvent(holder, "job:rescheduled");
    await holder.addJob("line_wait_behind_holder", { n: 2 });
    await parked2;
    const parked3 = nextEvent(locks, "job:rescheduled");
    await locks.addJob("line_wait_behind_batch", { n: 3 });
    await parked3;
    // Parked from its fetch well within the second it would have waited in line.
    expect(performance.now() - at.get(3)!).toBeLessThan(800);
    expect(locks.status().handoffs.waitedInLine).toBe(0);
    held.gate.resolve();
    await waitFor(async () => batch.spans.get(3)?.end != null, { message: "job 3 to run" });
    expect(held.spans.get(2)!.end).not.toBeNull();
    expect(batch.spans.get(3)!.start).toBeGreaterThanOrEqual(held.spans.get(2)!.end!);
    expect(fetched.get(3)).toBe(2);
  });

  it("a job woken from the line that finds a job ahead of it, which joined after its wake, wakes that job when the key is free", async () => {
    const locks = newLocks();
    locks.exclusive("line_wait_sql", async () => undefined, {
      key: () => "k",
      onConflict: "reschedule",
    });
    await locks.migrate();
    const key = lockKey("line_wait_sql", "k").toString();
    const ahead = (await locks.addJob("line_wait_sql", { n: 1 })).job!.id;
    const woken = (await locks.addJob("line_wait_sql", { n: 2 })).job!.id;
    await markFetched(ahead);
    await markFetched(woken);
    const join = async (id: string) =>
      (
        await q<{ ahead: number }>(
          "select graphile_worker_locks.join_line($1, $2, array[$1]::bigint[]) as ahead",
          [key, id],
        )
      ).rows[0]!.ahead;
    const wakeJob = async () =>
      (
        await q<{ job_id: string }>(
          "select job_id::text from graphile_worker_locks.wakes where lock_key = $1",
          [key],
        )
      ).rows[0]?.job_id;
    // The key is held elsewhere: the later job takes its place in line and is woken (by a release, say).
    const holder = await holdExternally(BigInt(key));
    expect(await join(woken)).toBe(0);
    await q("select graphile_worker_locks.wake_waiters(array[$1]::bigint[], false)", [key]);
    expect(await wakeJob()).toBe(woken);
    // The older job joins the line after that wake: it is ahead of the woken job.
    expect(await join(ahead)).toBe(0);
    await holder.release();
    // The woken job tries, is not next, and takes its place again (to wait: 0 waiting rows ahead, the job
    // ahead being woken): the job ahead is woken for the free key.
    expect(await join(woken)).toBe(0);
    expect(await wakeJob()).toBe(ahead);
    expect(await waiterRows(ahead)).toBe(0);
    expect(await waiterRows(woken)).toBe(1);
    // The job ahead, next now, tries at once.
    expect(await join(ahead)).toBe(-1);
  });
});
