/**
 * Supersede: a newer job of a key stops the job running for it, in whatever process it runs, and removes the
 * key's waiting jobs; the stopped job ends as completed, keeps its key until it returns, and the new job runs
 * after it. Real PostgreSQL, a real graphile-worker runner in a separate process (test/fixtures/
 * supersede-worker.ts) and in this one, executions recorded on the database clock.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  ErrorCodes,
  InvalidArgumentError,
  lockKey,
  makeLocksFromPreset,
  type Locks,
  type LocksEvents,
} from "../../src/index.js";
import { slotKeys } from "../../src/key.js";
import { validateTaskRules } from "../../src/preset/rules.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { maxConcurrencyPerKey, readEvents, readExecutions } from "../support/executions.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";
import { startProxy } from "../support/proxy.js";

const h = useExclusiveHarness("truncate test_executions, test_events");
const { db, cleanups, newLocks, runner, q } = h;

/** The rules of the worker process's task `sup`, for the enqueuing instances of this file. */
const SUP_RULES = {
  exclusive: true,
  onConflict: "reschedule",
  supersede: true,
  key: (p: { k: string }) => ({ k: p.k }),
} as const;

function enqueuer(): Locks {
  const locks = newLocks();
  locks.define("sup", SUP_RULES);
  return locks;
}

/** Resolves once job `jobId` has started (its execution is recorded). */
const started = (jobId: string, task = "sup") =>
  waitFor(
    async () =>
      (await readExecutions(db.pool(), task)).some((e) => e.jobId === jobId && e.start > 0n),
    { message: `job ${jobId} to start` },
  );

/** Resolves once no job is left (every one completed or removed). */
const drained = () =>
  waitFor(
    async () =>
      (await q<{ n: number }>("select count(*)::int as n from graphile_worker._private_jobs"))
        .rows[0]!.n === 0,
    { timeoutMs: 60_000, message: "every job to finish" },
  );

/** `events` of `name` on `locks`, collected from now on. */
function collect<K extends keyof LocksEvents>(locks: Locks, name: K): Array<LocksEvents[K]> {
  const seen: Array<LocksEvents[K]> = [];
  locks.events.on(name, (e) => seen.push(e));
  return seen;
}

describe("supersede across processes", () => {
  let worker: WorkerProcess;
  beforeAll(async () => {
    worker = await startWorkerProcess(db.url, {
      name: "A",
      concurrency: 4,
      script: "supersede-worker.ts",
    });
  });
  afterAll(async () => {
    await worker?.stop();
  });

  it("stops the job running in another process, removes the waiting ones, and runs after it", async () => {
    const locks = enqueuer();
    const removed = collect(locks, "job:superseded");
    const old = (await locks.addJob("sup", { k: "a", n: 1 }, { supersede: false })).job!;
    await started(old.id);
    // Waiting jobs of the key: one parked in its line (fetched and met the held key), one scheduled.
    const parkedBefore = (await locks.addJob("sup", { k: "a", n: 2 }, { supersede: false })).job!;
    await waitFor(async () => (await h.parkedCount()) === 1, { message: "job 2 to park" });
    const parked = (
      await q<{ job_id: string }>("select job_id::text from graphile_worker_locks.waiters")
    ).rows[0]!.job_id;
    const scheduled = (
      await locks.addJob(
        "sup",
        { k: "a", n: 3 },
        { supersede: false, runAt: new Date(Date.now() + 3_600_000) },
      )
    ).job!;
    // Another key's job is not touched.
    const other = (await locks.addJob("sup", { k: "b", n: 9, ms: 10 }, { supersede: false })).job!;

    const newer = await locks.addJob("sup", { k: "a", n: 4, ms: 10 });
    expect(newer.outcome).toBe("added");
    expect(newer.superseded).toEqual([parked, scheduled.id].sort((x, y) => Number(x) - Number(y)));
    expect(removed.map((e) => [e.jobId, e.state, e.byJobId])).toEqual(
      newer.superseded!.map((id) => [id, "waiting", newer.job!.id]),
    );
    expect(parkedBefore.id).not.toBe(parked); // (the parked copy is what waited)

    await drained();
    const executions = await readExecutions(db.pool(), "sup");
    // The old job saw its signal fire with a SupersededError naming the new job.
    const aborted = await readEvents(db.pool(), "aborted");
    expect(aborted).toEqual([
      {
        jobId: old.id,
        worker: "A",
        detail: { code: ErrorCodes.SUPERSEDED, byJobId: newer.job!.id },
      },
    ]);
    const superseded = await readEvents(db.pool(), "superseded");
    expect(superseded.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { byJobId: newer.job!.id, state: "running" }],
    ]);
    // Each job ran once (the removed ones not at all), the new one after the old one let go.
    expect(executions.map((e) => e.note).sort()).toEqual(["1", "4", "9"]);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    const first = executions.find((e) => e.note === "1")!;
    const last = executions.find((e) => e.note === "4")!;
    expect(last.start).toBeGreaterThanOrEqual(first.end!);
    expect(other.id).toBeDefined();
    // The old job threw its signal's reason and still ended completed: no row left, no retry.
    expect(executions.filter((e) => e.note === "1")).toHaveLength(1);
  });

  it("a task that ignores its signal keeps the key until it returns, then ends completed", async () => {
    const locks = enqueuer();
    const old = (await locks.addJob("sup", { k: "i", n: 1, ignore: true, ms: 1_500 })).job!;
    await started(old.id);
    const newer = (await locks.addJob("sup", { k: "i", n: 2, ms: 10 })).job!;
    await drained();
    const executions = await readExecutions(db.pool(), "sup");
    expect(executions.map((e) => e.note)).toEqual(["1", "2"]);
    const [first, second] = executions;
    // Its signal fired while it ran on, and nobody ran beside it meanwhile.
    const aborted = await readEvents(db.pool(), "aborted");
    expect(aborted.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { code: ErrorCodes.SUPERSEDED, byJobId: newer.id }],
    ]);
    expect(second!.start).toBeGreaterThanOrEqual(first!.end!);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    const superseded = await readEvents(db.pool(), "superseded");
    expect(superseded.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { byJobId: newer.id, state: "running" }],
    ]);
  });

  it("an enqueue in a transaction that rolls back stops and removes nothing; its commit does", async () => {
    const locks = enqueuer();
    const old = (await locks.addJob("sup", { k: "t", n: 1 })).job!;
    await started(old.id);
    const scheduled = (
      await locks.addJob(
        "sup",
        { k: "t", n: 2 },
        { supersede: false, runAt: new Date(Date.now() + 3_600_000) },
      )
    ).job!;
    const client = await h.connect();
    await client.query("begin");
    const rolledBack = await locks.addJob("sup", { k: "t", n: 3 }, { pgClient: client });
    expect(rolledBack.superseded).toEqual([scheduled.id]);
    await client.query("rollback");
    const rows = await q<{ id: string }>(
      "select id::text from graphile_worker._private_jobs where id = $1",
      [scheduled.id],
    );
    expect(rows.rows).toEqual([{ id: scheduled.id }]);
    await client.query("begin");
    const committed = await locks.addJob("sup", { k: "t", n: 4, ms: 10 }, { pgClient: client });
    await client.query("commit");
    await drained();
    // Only the committed enqueue's notice reached the running job.
    const aborted = await readEvents(db.pool(), "aborted");
    expect(aborted.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { code: ErrorCodes.SUPERSEDED, byJobId: committed.job!.id }],
    ]);
    const executions = await readExecutions(db.pool(), "sup");
    expect(executions.map((e) => e.note)).toEqual(["1", "4"]);
  });

  it("`addJobs`: an item that supersedes stops the running job and removes the waiting ones; a rollback stops nothing", async () => {
    const locks = enqueuer();
    const removed = collect(locks, "job:superseded");
    const old = (await locks.addJob("sup", { k: "m", n: 1 }, { supersede: false })).job!;
    await started(old.id);
    const scheduled = (
      await locks.addJob(
        "sup",
        { k: "m", n: 2 },
        { supersede: false, runAt: new Date(Date.now() + 3_600_000) },
      )
    ).job!;
    // In a transaction that rolls back: the item supersedes (the task's option), and nothing comes of it.
    const client = await h.connect();
    await client.query("begin");
    const rolledBack = await locks.addJobs([{ identifier: "sup", payload: { k: "m", n: 3 } }], {
      pgClient: client,
    });
    expect(rolledBack[0]!.superseded).toEqual([scheduled.id]);
    await client.query("rollback");
    expect(
      (
        await q<{ id: string }>(
          "select id::text from graphile_worker._private_jobs where id = $1",
          [scheduled.id],
        )
      ).rows,
    ).toEqual([{ id: scheduled.id }]);
    removed.length = 0;

    // Committed: a plain item of the key, then one that supersedes (per item), and another key's item.
    const results = await locks.addJobs([
      { identifier: "sup", payload: { k: "m", n: 4, ms: 10 }, supersede: false },
      { identifier: "sup", payload: { k: "m", n: 5, ms: 10 }, supersede: true },
      { identifier: "sup", payload: { k: "o", n: 6, ms: 10 }, supersede: false },
      // A key nobody holds: the superseding item removes the item ahead of it and is not left waiting
      // behind it in line (nobody would wake it).
      { identifier: "sup", payload: { k: "q", n: 7, ms: 10 }, supersede: false },
      { identifier: "sup", payload: { k: "q", n: 8, ms: 10 }, supersede: true },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "added", "added", "added", "added"]);
    expect(results[4]!.superseded).toEqual([results[3]!.job!.id]);
    const inLine = await q("select 1 from graphile_worker_locks.waiters where job_id = $1", [
      results[4]!.job!.id,
    ]);
    expect(inLine.rows).toEqual([]);
    const newer = results[1]!;
    expect(results[0]!.superseded).toBeUndefined();
    expect(newer.superseded).toEqual([scheduled.id, results[0]!.job!.id]);
    expect(results[2]!.superseded).toBeUndefined();
    expect(removed.map((e) => [e.taskIdentifier, e.jobId, e.state, e.byJobId])).toEqual([
      ...newer.superseded!.map((id) => ["sup", id, "waiting", newer.job!.id]),
      ["sup", results[3]!.job!.id, "waiting", results[4]!.job!.id],
    ]);

    await drained();
    // Only the committed enqueue's notice reached the running job.
    const aborted = await readEvents(db.pool(), "aborted");
    expect(aborted.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { code: ErrorCodes.SUPERSEDED, byJobId: newer.job!.id }],
    ]);
    const superseded = await readEvents(db.pool(), "superseded");
    expect(superseded.map((e) => [e.jobId, e.detail])).toEqual([
      [old.id, { byJobId: newer.job!.id, state: "running" }],
    ]);
    const executions = await readExecutions(db.pool(), "sup");
    expect(executions.map((e) => e.note).sort()).toEqual(["1", "5", "6", "8"]);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    const first = executions.find((e) => e.note === "1")!;
    const last = executions.find((e) => e.note === "5")!;
    expect(last.start).toBeGreaterThanOrEqual(first.end!);
  });
});

/**
 * A proxy for a lock session that drops every notification PostgreSQL sends it (NotificationResponse
 * messages, type 'A'): the session hears no supersede (nor release) notice.
 */
async function deafProxy(): Promise<string> {
  const { url } = await startProxy(db.url, cleanups, (inbound, open) => {
    const outbound = open();
    inbound.pipe(outbound);
    let buffer = Buffer.alloc(0);
    let started = false;
    outbound.on("data", (chunk: Buffer) => {
      buffer = Buffer.concat([buffer, chunk]);
      const out: Buffer[] = [];
      // (the server's first byte may be an SSL answer, one byte without a length)
      if (!started && buffer.length > 0 && (buffer[0] === 0x4e || buffer[0] === 0x53)) {
        out.push(buffer.subarray(0, 1));
        buffer = buffer.subarray(1);
      }
      started = true;
      while (buffer.length >= 5) {
        const length = buffer.readUInt32BE(1);
        if (buffer.length < 1 + length) break;
        const message = buffer.subarray(0, 1 + length);
        buffer = buffer.subarray(1 + length);
        if (message[0] !== 0x41) out.push(message);
      }
      if (out.length > 0) inbound.write(Buffer.concat(out));
    });
    const close = () => {
      inbound.destroy();
      outbound.destroy();
    };
    inbound.on("close", close);
    outbound.on("close", close);
    inbound.on("error", close);
    outbound.on("error", close);
  });
  return url;
}

describe("supersede in this process", () => {
  it("a lost notice leaves the new job to wait its turn: it runs once, after the old job", async () => {
    const lockConnectionString = await deafProxy();
    const deaf = newLocks({ lockConnectionString });
    const finishOld = deferred();
    const oldAborted: unknown[] = [];
    const task = deaf.exclusive(
      "sup_local",
      async (p: { n: number }, helpers) => {
        const { rows } = await q<{ id: string }>(
          "insert into test_executions (job_id, task, lock_key, note) values ($1, 'sup_local', 'k', $2) returning id",
          [helpers.job.id, String(p.n)],
        );
        helpers.abortSignal?.addEventListener("abort", () => oldAborted.push(helpers.job.id));
        if (p.n === 1) await finishOld.promise;
        await q("update test_executions set ended_at = clock_timestamp() where id = $1", [
          rows[0]!.id,
        ]);
      },
      {
        key: () => "k",
        onConflict: "reschedule",
        supersede: true,
        reschedule: { minDelay: 60_000, maxDelay: 60_000 },
      },
    );
    const superseded = collect(deaf, "job:superseded");
    await runner({ connectionString: db.url, concurrency: 2, taskList: { sup_local: task } });
    const old = (await task.addJob({ n: 1 })).job!;
    await started(old.id, "sup_local");
    // Enqueued by another instance; the holder's session never hears of it.
    const other = newLocks();
    other.define("sup_local", {
      exclusive: true,
      onConflict: "reschedule",
      supersede: true,
      key: () => "k",
    });
    const newer = await other.addJob("sup_local", { n: 2 });
    expect(newer.outcome).toBe("added");
    await waitFor(async () => (await h.parkedCount()) === 1, { message: "the new job to park" });
    finishOld.resolve();
    await drained();
    const executions = await readExecutions(db.pool(), "sup_local");
    expect(executions.map((e) => [e.jobId, e.note])).toEqual([
      [old.id, "1"],
      [expect.any(String), "2"],
    ]);
    expect(executions[1]!.start).toBeGreaterThanOrEqual(executions[0]!.end!);
    expect(oldAborted).toEqual([]);
    expect(superseded).toEqual([]);
  });
});

describe("supersede on a key of several slots, and in a lock group", () => {
  it("stops every running job of a key with `limit: 2`, removes every older waiting one, and runs the newest", async () => {
    const locks = newLocks();
    const aborted: string[] = [];
    const task = locks.exclusive(
      "sup_multi",
      async (p: { n: number }, helpers) => {
        const { rows } = await q<{ id: string }>(
          "insert into test_executions (job_id, task, lock_key, note) values ($1, 'sup_multi', 'k', $2) returning id",
          [helpers.job.id, String(p.n)],
        );
        const signal = helpers.abortSignal!;
        // Runs until its signal fires (at most a minute).
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, p.n === 5 ? 10 : 60_000);
          const stop = () => {
            aborted.push(`${helpers.job.id}:${(signal.reason as { code?: string }).code}`);
            clearTimeout(timer);
            resolve();
          };
          if (signal.aborted) stop();
          else signal.addEventListener("abort", stop, { once: true });
        });
        await q("update test_executions set ended_at = clock_timestamp() where id = $1", [
          rows[0]!.id,
        ]);
        if (signal.aborted) throw signal.reason;
      },
      { key: () => "k", limit: 2, onConflict: "reschedule", supersede: true },
    );
    const superseded = collect(locks, "job:superseded");
    await runner({ connectionString: db.url, concurrency: 3, taskList: { sup_multi: task } });
    const one = (await task.addJob({ n: 1 }, { supersede: false })).job!;
    const two = (await task.addJob({ n: 2 }, { supersede: false })).job!;
    await started(one.id, "sup_multi");
    await started(two.id, "sup_multi");
    // Waiting: one parked in the key's line (both slots held), one scheduled (never fetched).
    await task.addJob({ n: 3 }, { supersede: false });
    await waitFor(async () => (await h.parkedCount()) === 1, { message: "job 3 to park" });
    const parked = (
      await q<{ job_id: string }>("select job_id::text from graphile_worker_locks.waiters")
    ).rows[0]!.job_id;
    const scheduled = (
      await task.addJob({ n: 4 }, { supersede: false, runAt: new Date(Date.now() + 3_600_000) })
    ).job!;

    const newer = await task.addJob({ n: 5 });
    expect(newer.superseded).toEqual([parked, scheduled.id].sort((x, y) => Number(x) - Number(y)));
    await drained();
    // Both running jobs were told (the signal's reason a SupersededError), and ended as superseded.
    expect(aborted.sort()).toEqual(
      [one.id, two.id].map((id) => `${id}:${ErrorCodes.SUPERSEDED}`).sort(),
    );
    expect(
      superseded
        .map((e) => [e.jobId, e.state, e.byJobId])
        .sort(([a], [b]) => Number(a) - Number(b)),
    ).toEqual(
      [[one.id, "running"], [two.id, "running"], ...newer.superseded!.map((id) => [id, "waiting"])]
        .map(([id, state]) => [id, state, newer.job!.id])
        .sort(([a], [b]) => Number(a) - Number(b)),
    );
    // Each ran once (the removed ones not at all), never more than 2 at once; the newest ran.
    const executions = await readExecutions(db.pool(), "sup_multi");
    expect(executions.map((e) => e.note).sort()).toEqual(["1", "2", "5"]);
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBeLessThanOrEqual(2);
    const { rows } = await q("select 1 from graphile_worker._private_jobs");
    expect(rows).toEqual([]);
  });

  it("with several limits, removes a job parked in another limit's line than the key's", async () => {
    const locks = newLocks();
    const ran: number[] = [];
    const task = locks.exclusive("sup_stacked", async (p: { n: number }) => void ran.push(p.n), {
      limits: [{ key: () => "tenant" }, { key: () => "all", group: "sup_cap" }],
      onConflict: "reschedule",
      supersede: true,
    });
    // The cap is held elsewhere: a job of the task parks in the cap's line.
    const capKey = slotKeys("sup_cap", "all", 1)[0]!;
    const cap = await h.holdExternally(capKey);
    await runner({ connectionString: db.url, concurrency: 1, taskList: { sup_stacked: task } });
    await task.addJob({ n: 1 }, { supersede: false });
    await waitFor(async () => (await h.parkedCount()) === 1, { message: "job 1 to park" });
    const parked = (
      await q<{ job_id: string; lock_key: string }>(
        "select job_id::text, lock_key::text from graphile_worker_locks.waiters",
      )
    ).rows[0]!;
    expect(parked.lock_key).toBe(BigInt.asIntN(64, capKey).toString());
    const newer = await task.addJob({ n: 2 });
    expect(newer.superseded).toEqual([parked.job_id]);
    expect(await h.parkedCount()).toBe(0);
    await cap.release();
    await drained();
    expect(ran).toEqual([2]);
  });

  it("an event names the superseded job's own task when tasks share a `lockGroup`", async () => {
    const locks = newLocks();
    const rules = {
      exclusive: true,
      onConflict: "reschedule",
      lockGroup: "account",
      key: (p: { user: string }) => p.user,
    } as const;
    locks.define("charge", rules);
    locks.define("refund", rules);
    const events = collect(locks, "job:superseded");
    const later = { runAt: new Date(Date.now() + 3_600_000) };
    const charge = (await locks.addJob("charge", { user: "u1" }, later)).job!;
    const refund = (await locks.addJob("refund", { user: "u1" }, later)).job!;
    const by = await locks.addJob("refund", { user: "u1" }, { ...later, supersede: true });
    expect(by.superseded).toEqual([charge.id, refund.id]);
    // And per item of a bulk enqueue.
    const charge2 = (await locks.addJob("charge", { user: "u2" }, later)).job!;
    const [first, bulkBy] = await locks.addJobs([
      { identifier: "refund", payload: { user: "u2" }, ...later },
      { identifier: "refund", payload: { user: "u2" }, ...later, supersede: true },
    ]);
    expect(events.map((e) => [e.taskIdentifier, e.jobId, e.byJobId])).toEqual([
      ["charge", charge.id, by.job!.id],
      ["refund", refund.id, by.job!.id],
      ["charge", charge2.id, bulkBy!.job!.id],
      ["refund", first!.job!.id, bulkBy!.job!.id],
    ]);
  });
});

describe("the abort signal of a job that may be superseded", () => {
  it("stops listening to the worker's and the session's signals when its job ends", async () => {
    const warnings: string[] = [];
    const onWarning = (warning: Error) => warnings.push(`${warning.name}: ${warning.message}`);
    process.on("warning", onWarning);
    cleanups.push(async () => void process.off("warning", onWarning));
    const locks = newLocks();
    let reads = 0;
    const task = locks.exclusive(
      "sup_signal",
      async (_p: { n: number }, helpers) => {
        if (helpers.abortSignal && !helpers.abortSignal.aborted) reads++;
      },
      { key: () => "one", onConflict: "reschedule" },
    );
    await runner({ connectionString: db.url, concurrency: 1, taskList: { sup_signal: task } });
    // (more jobs than an AbortSignal's 10 listeners before Node warns of a leak)
    for (let n = 0; n < 15; n++) await task.addJob({ n });
    await drained();
    // (a warning is emitted on the next turn)
    await new Promise((resolve) => setImmediate(resolve));
    expect(reads).toBe(15);
    expect(warnings.filter((w) => w.includes("MaxListenersExceeded"))).toEqual([]);
  });
});

describe("a superseded job whose lock session dies", () => {
  it("is listed by `lock:lost` as running while it finishes: its signal had fired, and the loss is told", async () => {
    const locks = newLocks();
    const lost = collect(locks, "lock:lost");
    const finish = deferred();
    const reasons: unknown[] = [];
    const task = locks.exclusive(
      "sup_lost",
      async (p: { n: number }, helpers) => {
        if (p.n !== 1) return;
        helpers.abortSignal!.addEventListener("abort", () =>
          reasons.push(helpers.abortSignal!.reason),
        );
        // A task that finishes its work after its signal fired (the supersede), still holding its key.
        await finish.promise;
      },
      { key: () => "one", onConflict: "reschedule", supersede: true },
    );
    await runner({ connectionString: db.url, concurrency: 2, taskList: { sup_lost: task } });
    const old = (await task.addJob({ n: 1 })).job!;
    await waitFor(async () => locks.status().held.some((hold) => hold.jobId === old.id), {
      message: "job 1 to hold its key",
    });
    await locks.addJob("sup_lost", { n: 2 }, { supersede: true });
    await waitFor(async () => reasons.length === 1, { message: "job 1's signal to fire" });
    expect((reasons[0] as { code?: string }).code).toBe(ErrorCodes.SUPERSEDED);
    const pid = locks.status().pid!;
    await q("select pg_terminate_backend($1)", [pid]);
    await waitFor(async () => lost.length > 0, { message: "the loss to be told" });
    expect(lost[0]!.holds.map((hold) => [hold.jobId, hold.returned])).toEqual([[old.id, false]]);
    // Its signal fired once, for the supersede.
    expect(reasons).toHaveLength(1);
    finish.resolve();
    await drained();
  });
});

describe("supersede options", () => {
  it("is refused on a task that does not wait (`onConflict` other than reschedule), naming the task", () => {
    const locks = newLocks();
    for (const onConflict of ["drop", "raise", undefined] as const) {
      expect(() =>
        locks.exclusive("sup_drop", async () => undefined, { onConflict, supersede: true }),
      ).toThrow(/task 'sup_drop': `supersede` needs `onConflict: "reschedule"`/);
    }
    expect(() =>
      locks.define("sup_drop", { exclusive: true, onConflict: "drop", supersede: true }),
    ).toThrow(InvalidArgumentError);
    expect(() =>
      locks.exclusive("sup_bad", async () => undefined, {
        onConflict: "reschedule",
        supersede: "yes" as unknown as boolean,
      }),
    ).toThrow(/`supersede` must be a boolean/);
    // The preset and task files: the same rule, naming where the rules come from.
    expect(() =>
      validateTaskRules("sup_drop", { onConflict: "drop", supersede: true }, "worker.locks.tasks"),
    ).toThrow(/worker\.locks\.tasks for task 'sup_drop': `supersede` needs/);
    expect(() =>
      validateTaskRules(
        "sup_ok",
        { onConflict: "reschedule", supersede: true },
        "worker.locks.tasks",
      ),
    ).not.toThrow();
    expect(() =>
      makeLocksFromPreset({
        worker: {
          connectionString: db.url,
          locks: { tasks: { sup_preset: { onConflict: "drop", supersede: true } } },
        },
      }),
    ).toThrow(/task 'sup_preset'.*`supersede` needs `onConflict: "reschedule"`/);
  });

  it("`spec.supersede` is refused before anything is written where it cannot apply", async () => {
    const locks = newLocks();
    locks.define("plain_drop", { exclusive: true, onConflict: "drop" });
    locks.define("waits", { exclusive: true, onConflict: "reschedule" });
    await expect(locks.addJob("plain_drop", {}, { supersede: true })).rejects.toThrow(
      /task 'plain_drop': `supersede` needs a task defined on this instance with `onConflict: "reschedule"`/,
    );
    await expect(locks.addJob("undefined_task", {}, { supersede: true })).rejects.toThrow(
      /task 'undefined_task': `supersede` needs .* not exclusive here/,
    );
    await expect(locks.addJob("waits", {}, { supersede: true, jobKey: "x" })).rejects.toThrow(
      /`supersede` cannot be combined with a `jobKey`/,
    );
    await expect(
      locks.addJobs([{ identifier: "plain_drop", payload: {}, supersede: true }]),
    ).rejects.toThrow(/addJobs: item 0: task 'plain_drop': `supersede` needs/);
    const { rows } = await q("select 1 from graphile_worker._private_jobs");
    expect(rows).toEqual([]);
    // Per enqueue on a `reschedule` task: it supersedes; `false` turns a task's `supersede` off.
    const result = await locks.addJob("waits", { n: 1 }, { supersede: true });
    expect(result).toMatchObject({ outcome: "added", superseded: [] });
    locks.define("waits_sup", { exclusive: true, onConflict: "reschedule", supersede: true });
    const off = await locks.addJob("waits_sup", { n: 1 }, { supersede: false });
    expect(off.outcome).toBe("added");
    expect(off.superseded).toBeUndefined();
    // The preemptive check is skipped: a superseding job is never dropped up front.
    locks.define("waits_pre", { exclusive: true, onConflict: "reschedule", preemptive: true });
    await h.holdExternally(lockKey("waits_pre", { n: 1 }));
    expect((await locks.addJob("waits_pre", { n: 1 })).outcome).toBe("dropped");
    expect((await locks.addJob("waits_pre", { n: 1 }, { supersede: true })).outcome).toBe("added");
  });
});
