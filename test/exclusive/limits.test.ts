/**
 * Limits that compose, in one process: lock groups (`lockGroup`, keys shared by several tasks), several
 * limits per job (`limits`, one slot of each, all or nothing) and limits per key (`limit` as a function of
 * the key value). Executions are recorded with the database's clock; real PostgreSQL, real graphile-worker
 * runners. The cross-process proofs are in limits.long.test.ts.
 */
import { describe, expect, it } from "vitest";
import { InvalidArgumentError, type ExclusiveOptions, type Locks } from "../../src/index.js";
import { advisoryParts, lockKey, slotKeys } from "../../src/key.js";
import { validateTaskRules } from "../../src/preset/rules.js";
import { highestConcurrency } from "../../scripts/overlap.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { readExecutions, type Execution } from "../support/executions.js";
import { nextEvent, warningsLogger } from "../support/runner.js";

const h = useExclusiveHarness("truncate test_executions, test_events");
const { db, cleanups, newLocks, runner } = h;

interface Job {
  tenant: string;
  ms?: number;
  /** Recorded as the execution's note. */
  n?: number;
}

/** A task body that records its execution (task `identifier`, lock_key = the tenant) and sleeps `ms`. */
function recording(identifier: string, wait?: () => Promise<void>) {
  const pool = db.pool();
  return async (payload: Job, helpers: { job: { id: string; attempts: number } }) => {
    const { rows } = await pool.query<{ id: string }>(
      "insert into test_executions (job_id, task, lock_key, worker, attempts, note) values ($1, $2, $3, 'w', $4, $5) returning id",
      [helpers.job.id, identifier, payload.tenant, helpers.job.attempts, String(payload.n ?? "")],
    );
    if (wait) await wait();
    else await new Promise((resolve) => setTimeout(resolve, payload.ms ?? 30));
    await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
      rows[0]!.id,
    ]);
  };
}

/**
 * A `reschedule` task `identifier` of `locks` recording its executions, whose jobs of tenant "h" run until
 * `gate` resolves (at the latest when the test ends).
 */
function gatedTask(
  locks: Locks,
  identifier: string,
  options: Omit<ExclusiveOptions<Job>, "onConflict">,
) {
  const gate = deferred();
  cleanups.push(async () => gate.resolve());
  const body = recording(identifier);
  const task = locks.exclusive(
    identifier,
    async (payload: Job, helpers) => {
      if (payload.tenant === "h") await gate.promise;
      await body(payload, helpers);
    },
    { ...options, onConflict: "reschedule" },
  );
  return { task, gate };
}

/**
 * Runs a first job of `task` (recorded as `identifier`), which teaches the task its usual hold (600 ms: a job
 * waits here up to twice that, at most 1 s), and waits for its release.
 */
async function teachHold(
  locks: Locks,
  task: { addJob(payload: Job): Promise<unknown> },
  identifier: string,
) {
  await task.addJob({ tenant: "teach", ms: 600 });
  await waitFor(
    async () => (await readExecutions(db.pool(), identifier)).some((e) => e.end !== null),
    { message: "the teaching job to run" },
  );
  await waitFor(async () => locks.status().held.length === 0, { message: "its release" });
}

function intervals(executions: readonly Execution[]) {
  return executions.map((e) => {
    if (e.end === null) throw new Error(`execution of job ${e.jobId} has no end`);
    return { start: e.start, end: e.end };
  });
}

/** The highest number of executions that ran at once, over all, and per tenant (lock_key). */
function concurrency(executions: readonly Execution[]) {
  const perTenant = new Map<string, number>();
  for (const tenant of new Set(executions.map((e) => e.lockKey))) {
    perTenant.set(
      tenant,
      highestConcurrency(intervals(executions.filter((e) => e.lockKey === tenant))),
    );
  }
  return { all: highestConcurrency(intervals(executions)), perTenant };
}

/** Whether some session holds `key` right now. */
async function isHeld(key: bigint): Promise<boolean> {
  const { classid, objid } = advisoryParts(key);
  const { rows } = await db
    .pool()
    .query(
      "select 1 from pg_locks where locktype = 'advisory' and objsubid = 1 and granted and classid = $1 and objid = $2",
      [classid, objid],
    );
  return rows.length > 0;
}

/**
 * Makes the next call of release_waiters raise 'injected wake failure' (the calls after it run as before),
 * keeping the function's oid, so that statements prepared already call it. Returns the function that puts
 * the original back.
 */
async function failReleaseWaitersOnce(): Promise<() => Promise<void>> {
  const pool = db.pool();
  const { rows } = await pool.query<{ def: string }>(
    "select pg_get_functiondef('graphile_worker_locks.release_waiters(bigint[], bigint[])'::regprocedure) as def",
  );
  const def = rows[0]!.def;
  const copy = def.replace(".release_waiters(", ".release_waiters_real(");
  if (copy === def) throw new Error("release_waiters: unexpected definition");
  await pool.query(copy);
  await pool.query("create sequence graphile_worker_locks.test_wake_failures");
  await pool.query(`create or replace function graphile_worker_locks.release_waiters(p_keys bigint[], p_job_ids bigint[])
    returns int language plpgsql volatile as $$
    begin
      if nextval('graphile_worker_locks.test_wake_failures') = 1 then
        raise exception 'injected wake failure';
      end if;
      return graphile_worker_locks.release_waiters_real(p_keys, p_job_ids);
    end $$`);
  return async () => {
    await pool.query(def);
    await pool.query(
      "drop function graphile_worker_locks.release_waiters_real(bigint[], bigint[])",
    );
    await pool.query("drop sequence graphile_worker_locks.test_wake_failures");
  };
}

/**
 * Lets the running `charge` job end (`gate`), and checks that its release woke the `refund` job parked in its
 * line in the release's own statement (the parked job's safety net is far: no waiter is left once the
 * release is answered), and that the refund then ran, starting after the charge ended.
 */
async function releaseWakesParkedRefund(locks: Locks, gate: { resolve(): void }): Promise<void> {
  const released = new Promise<void>((resolve) =>
    locks.events.on("lock:released", (e) => e.taskIdentifier === "charge" && resolve()),
  );
  gate.resolve();
  await released;
  expect(await h.parkedCount()).toBe(0);
  await waitFor(
    async () => (await readExecutions(db.pool(), "refund")).some((e) => e.end !== null),
    { message: "the parked refund to run after the charge", timeoutMs: 20_000 },
  );
  const [c] = await readExecutions(db.pool(), "charge");
  const [r] = await readExecutions(db.pool(), "refund");
  expect(r!.start).toBeGreaterThanOrEqual(c!.end!);
}

describe("lockGroup: tasks that share a key space", () => {
  it("keys of a group are the group's; a task without one keeps its own", () => {
    const locks = newLocks();
    const charge = locks.exclusive("charge_card", async () => undefined, {
      key: (p: { userId: number }) => p.userId,
      lockGroup: "card",
    });
    const refund = locks.exclusive("refund_card", async () => undefined, {
      key: (p: { userId: number }) => p.userId,
      lockGroup: "card",
    });
    const plain = locks.exclusive("plain", async () => undefined, {
      key: (p: { userId: number }) => p.userId,
    });
    expect(charge.lockKey({ userId: 1 })).toBe(lockKey("card", 1));
    expect(refund.lockKey({ userId: 1 })).toBe(charge.lockKey({ userId: 1 }));
    expect(plain.lockKey({ userId: 1 })).toBe(lockKey("plain", 1));
    expect(() => locks.exclusive("x", async () => undefined, { lockGroup: " " })).toThrow(
      "`lockGroup` must be a non-empty string",
    );
  });

  it.each(["drop", "reschedule"] as const)(
    "a job of one task meets the key held by a job of the other (%s); a parked one is woken by the other task's release",
    async (strategy) => {
      const locks = newLocks();
      const gate = deferred();
      const rules = {
        key: (p: Job) => p.tenant,
        lockGroup: "card",
        // (a parked job's safety net is far: only the release's wake runs it within the test)
        reschedule: { minDelay: 30_000, maxDelay: 60_000 },
      };
      // The holder drops on conflict; the other task applies `strategy`.
      const charge = locks.exclusive(
        "charge",
        recording("charge", () => gate.promise),
        rules,
      );
      const refund = locks.exclusive("refund", recording("refund"), {
        ...rules,
        onConflict: strategy,
      });
      const conflicts: string[] = [];
      locks.events.on("lock:conflict", (e) => conflicts.push(e.taskIdentifier));
      await runner({
        connectionString: db.url,
        concurrency: 4,
        taskList: { charge, refund },
        pollInterval: 100,
      });
      await h.utils.addJob("charge", { tenant: "u1" });
      await waitFor(async () => (await readExecutions(db.pool(), "charge")).length === 1, {
        message: "the charge to start",
      });
      await h.utils.addJob("refund", { tenant: "u1" }, { maxAttempts: 1 });
      await waitFor(async () => conflicts.length > 0, { message: "the refund to conflict" });
      expect(conflicts[0]).toBe("refund");
      expect(await readExecutions(db.pool(), "refund")).toEqual([]);
      if (strategy === "reschedule") {
        await waitFor(async () => (await h.parkedCount()) === 1, {
          message: "the refund to be parked",
        });
      }
      // The release of a `drop` task's hold wakes the parked job (its safety net is 15 s or more away).
      if (strategy === "reschedule") await releaseWakesParkedRefund(locks, gate);
      else gate.resolve();
    },
  );
});

describe("limits: several limits per job", () => {
  const tenantAndCap = (cap: number) => ({
    onConflict: "reschedule" as const,
    limits: [
      { key: (p: Job) => p.tenant, limit: 1 },
      { key: () => "all", limit: cap, group: "cap" },
    ],
    reschedule: { minDelay: 20, maxDelay: 300 },
  });

  // (with lock-ahead: the lock statement of a fetched batch carries its requests of several limits)
  describe.each([{ lockAhead: true, name: "with lock-ahead" }])("$name", ({ lockAhead }) => {
    it("per tenant 1 and 2 in all: neither is exceeded, and every job runs exactly once", async () => {
      const identifier = `stacked_${lockAhead ? "ahead" : "plain"}`;
      const locks = newLocks();
      const task = locks.exclusive(identifier, recording(identifier), tenantAndCap(2));
      const r = await runner({
        connectionString: db.url,
        concurrency: 6,
        taskList: { [identifier]: task },
        pollInterval: 100,
        ...(lockAhead
          ? { preset: { worker: { localQueue: { size: 20 }, completeJobBatchDelay: 0 } } }
          : {}),
      });
      if (lockAhead) locks.attach(r);
      const tenants = ["a", "a", "a", "b", "b", "c", "d", "e"];
      for (let i = 0; i < tenants.length; i++)
        await task.addJob({ tenant: tenants[i]!, n: i, ms: 40 });
      await waitFor(
        async () =>
          (await readExecutions(db.pool(), identifier)).filter((e) => e.end !== null).length ===
          tenants.length,
        { message: "every job to run", timeoutMs: 60_000 },
      );
      const executions = await readExecutions(db.pool(), identifier);
      expect(executions.map((e) => Number(e.note)).sort((a, b) => a - b)).toEqual(
        tenants.map((_, i) => i),
      );
      const c = concurrency(executions);
      expect(c.all).toBeLessThanOrEqual(2);
      for (const [, n] of c.perTenant) expect(n).toBe(1);
      expect(await h.parkedCount()).toBe(0);
    });
  });

  it("a job whose second limit is full holds none of its slots while it waits, and runs when that limit frees", async () => {
    const locks = newLocks();
    const task = locks.exclusive("waits", recording("waits"), {
      ...tenantAndCap(1),
      reschedule: { minDelay: 30_000, maxDelay: 60_000 },
    });
    const [tenantSlot] = slotKeys("waits", "t1", 1);
    const [capSlot] = slotKeys("cap", "all", 1);
    // Another process holds the cap.
    const other = await h.holdExternally(capSlot!);
    expect(await locks.lockAvailable("waits", { tenant: "t1" })).toBe(false);
    expect(await task.lockAvailable({ tenant: "t1" })).toBe(false);
    expect(await locks.canStart("waits", { tenant: "t1" })).toEqual({
      ok: false,
      blockers: [{ kind: "limit", index: 1, group: "cap", lockKey: capSlot, limit: 1, held: 1 }],
    });
    const rescheduled: bigint[] = [];
    locks.events.on("job:rescheduled", (e) => rescheduled.push(e.lockKey));
    await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { waits: task },
      pollInterval: 100,
    });
    await task.addJob({ tenant: "t1" });
    await waitFor(async () => rescheduled.length > 0, { message: "the job to park" });
    // It waits in the line of the full limit, holding none of its slots.
    expect(rescheduled[0]).toBe(capSlot);
    const { rows } = await h.q<{ lock_key: string }>(
      "select lock_key::text from graphile_worker_locks.waiters",
    );
    expect(rows.map((r) => r.lock_key)).toEqual([capSlot!.toString()]);
    expect(await isHeld(tenantSlot!)).toBe(false);
    expect(locks.status().held).toEqual([]);
    await other.release();
    // The cap frees without a release of this library (the other session ended): the safety net is far,
    // so a second job's park (wake_if_free) wakes the line, or the job waits for its net; release it the
    // way a holder of this library would instead: a job of the cap's group that takes and frees it.
    const capTask = locks.exclusive("cap_user", recording("cap_user"), {
      key: () => "all",
      lockGroup: "cap",
    });
    expect(capTask.lockKey({ tenant: "x" })).toBe(capSlot);
    await runner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { cap_user: capTask },
      pollInterval: 100,
    });
    await capTask.addJob({ tenant: "x" });
    await waitFor(
      async () => (await readExecutions(db.pool(), "waits")).some((e) => e.end !== null),
      { message: "the parked job to run once the cap frees", timeoutMs: 20_000 },
    );
    // (its slots are released once its task has returned, a moment after the end it recorded)
    await waitFor(async () => (await locks.canStart("waits", { tenant: "t1" })).ok, {
      message: "its slots to be released",
    });
    expect(await locks.canStart("waits", { tenant: "t1" })).toEqual({ ok: true, blockers: [] });
  });

  it("a running job's hold covers one slot of each limit: status, the holder registry and its release", async () => {
    const locks = newLocks();
    const gate = deferred();
    const task = locks.exclusive(
      "held",
      recording("held", () => gate.promise),
      { limits: [{ key: (p: Job) => p.tenant }, { key: () => "all", limit: 2, group: "cap" }] },
    );
    await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { held: task },
      pollInterval: 100,
    });
    const { job } = await task.addJob({ tenant: "t1" });
    await waitFor(async () => (await readExecutions(db.pool(), "held")).length === 1, {
      message: "the job to start",
    });
    const keys = [slotKeys("held", "t1", 1)[0]!, slotKeys("cap", "all", 2)[0]!];
    expect(locks.status().held.map((h) => h.lockKey)).toEqual(keys);
    await waitFor(
      async () => {
        const held = await locks.heldLocks();
        return keys.every((k) =>
          held.some((h) => h.lockKey === k && h.taskIdentifier === "held" && h.jobId === job!.id),
        );
      },
      { message: "the registry to show both keys of the job" },
    );
    for (const k of keys) expect(await isHeld(k)).toBe(true);
    gate.resolve();
    await waitFor(async () => locks.status().held.length === 0, {
      message: "the hold to be released",
    });
    for (const k of keys) expect(await isHeld(k)).toBe(false);
  });

  it("a job woken from one limit's line that parks in another's passes the wake on to the next in line", async () => {
    const locks = newLocks();
    const gate = deferred();
    const body = recording("pass");
    const task = locks.exclusive(
      "pass",
      async (payload: Job, helpers) => {
        if (payload.tenant === "h") await gate.promise;
        await body(payload, helpers);
      },
      {
        onConflict: "reschedule",
        limits: [{ key: (p: Job) => p.tenant }, { key: () => "all", group: "cap" }],
        // (safety nets far away: only wakes run parked jobs within the test)
        reschedule: { minDelay: 30_000, maxDelay: 60_000 },
      },
    );
    const [capKey] = slotKeys("cap", "all", 1);
    const [tenantA] = slotKeys("pass", "a", 1);
    const parks: Array<{ jobId: string; lockKey: bigint }> = [];
    locks.events.on("job:rescheduled", (e) => parks.push({ jobId: e.job.id, lockKey: e.lockKey }));
    await runner({
      connectionString: db.url,
      concurrency: 3,
      taskList: { pass: task },
      pollInterval: 100,
    });
    // h holds the cap; w (tenant a) and then x (tenant b) wait in the cap's line.
    await task.addJob({ tenant: "h" });
    await waitFor(async () => locks.status().held.length === 2, { message: "h to hold its slots" });
    await task.addJob({ tenant: "a" });
    await waitFor(async () => parks.length === 1, { message: "w to park" });
    await task.addJob({ tenant: "b" });
    await waitFor(async () => parks.length === 2, { message: "x to park" });
    expect(parks.map((p) => p.lockKey)).toEqual([capKey, capKey]);
    // Another process holds tenant a: woken by h's release, w finds it held and parks in its line.
    const other = await h.holdExternally(tenantA!);
    gate.resolve();
    await waitFor(async () => parks.length === 3, { message: "w to park again" });
    expect(parks[2]!.lockKey).toBe(tenantA);
    // The cap's slot is free: w's park woke x, the next in the cap's line.
    const { rows } = await h.q<{ lock_key: string }>(
      "select lock_key::text from graphile_worker_locks.waiters",
    );
    expect(rows.map((r) => r.lock_key)).toEqual([tenantA!.toString()]);
    await waitFor(
      async () => (await readExecutions(db.pool(), "pass")).some((e) => e.lockKey === "b"),
      { message: "x to run" },
    );
    await other.release();
  });

  it("a job that drops on conflict wakes, at its release, a job another task parked in its grouped limit's line", async () => {
    const locks = newLocks();
    const gate = deferred();
    // The holder's first limit is its own key space, its second the group "card" that refund shares.
    const charge = locks.exclusive(
      "charge",
      recording("charge", () => gate.promise),
      {
        limits: [{ key: (p: Job) => p.tenant }, { key: (p: Job) => p.tenant, group: "card" }],
      },
    );
    const refund = locks.exclusive("refund", recording("refund"), {
      key: (p: Job) => p.tenant,
      lockGroup: "card",
      onConflict: "reschedule",
      // (a parked job's safety net is far: only the release's wake runs it within the test)
      reschedule: { minDelay: 30_000, maxDelay: 60_000 },
    });
    await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { charge, refund },
      pollInterval: 100,
    });
    await h.utils.addJob("charge", { tenant: "u1" });
    await waitFor(async () => (await readExecutions(db.pool(), "charge")).length === 1, {
      message: "the charge to start",
    });
    await h.utils.addJob("refund", { tenant: "u1" });
    await waitFor(async () => (await h.parkedCount()) === 1, {
      message: "the refund to park in the group's line",
    });
    await releaseWakesParkedRefund(locks, gate);
  });

  it("drop: a full limit drops the job at run time and up front, naming the limit's key", async () => {
    const locks = newLocks();
    const task = locks.exclusive("dropper", recording("dropper"), {
      limits: [
        { key: (p: Job) => p.tenant, limit: 2 },
        { key: () => "partner", group: "partner-api" },
      ],
    });
    const [partner] = slotKeys("partner-api", "partner", 1);
    const other = await h.holdExternally(partner!);
    const dropped: bigint[] = [];
    locks.events.on("enqueue:dropped", (e) => dropped.push(e.lockKey));
    expect(await task.addJob({ tenant: "t" })).toEqual({ job: null, outcome: "dropped" });
    expect(dropped).toEqual([partner]);
    // At run time (enqueued without the check): dropped, holding nothing.
    const runDropped: bigint[] = [];
    locks.events.on("job:dropped", (e) => runDropped.push(e.lockKey));
    await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { dropper: task },
      pollInterval: 100,
    });
    await task.addJob({ tenant: "t" }, { preemptive: false });
    await waitFor(async () => runDropped.length > 0, { message: "the job to be dropped" });
    expect(runDropped).toEqual([partner]);
    for (const slot of slotKeys("dropper", "t", 2)) expect(await isHeld(slot)).toBe(false);
    await other.release();
    expect((await task.addJob({ tenant: "t" })).outcome).toBe("added");
    await waitFor(async () => (await readExecutions(db.pool(), "dropper")).length === 1, {
      message: "the job to run once the limit frees",
    });
  });

  it("locks.addJobs adds a job behind an earlier job of the batch with its key waiting in that limit's line; all run once", async () => {
    const locks = newLocks();
    const task = locks.exclusive("enqueue_line", recording("enqueue_line"), {
      ...tenantAndCap(2),
      // (a safety net long enough for a line at enqueue)
      reschedule: { minDelay: 20, maxDelay: 30_000 },
    });
    const tenants = ["a", "a", "b", "a", "c", "b"];
    const results = await locks.addJobs(
      tenants.map((tenant, n) => ({ identifier: "enqueue_line", payload: { tenant, n, ms: 20 } })),
    );
    const idOf = new Map(results.map((r, n) => [r.job!.id, n]));
    const { rows } = await h.q<{ job_id: string; lock_key: string }>(
      "select job_id::text, lock_key::text from graphile_worker_locks.waiters order by pos",
    );
    // Each tenant's first job is runnable; the others wait in their tenant's line (not the cap's).
    const tenantKey = (t: string) => slotKeys("enqueue_line", t, 1)[0]!.toString();
    expect(rows.map((r) => [idOf.get(r.job_id), r.lock_key])).toEqual([
      [1, tenantKey("a")],
      [3, tenantKey("a")],
      [5, tenantKey("b")],
    ]);
    await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { enqueue_line: task },
      pollInterval: 100,
    });
    await waitFor(
      async () =>
        (await readExecutions(db.pool(), "enqueue_line")).filter((e) => e.end !== null).length ===
        tenants.length,
      { message: "every job to run", timeoutMs: 60_000 },
    );
    const executions = await readExecutions(db.pool(), "enqueue_line");
    expect(executions.map((e) => Number(e.note)).sort((a, b) => a - b)).toEqual(
      tenants.map((_, n) => n),
    );
    const c = concurrency(executions);
    expect(c.all).toBeLessThanOrEqual(2);
    for (const [, n] of c.perTenant) expect(n).toBe(1);
    expect(await h.parkedCount()).toBe(0);
  });

  it("a job that finds a limit full, its slot held here, waits for that release and rides with its unlock, rather than park; the holder returns after that answer", async () => {
    const locks = newLocks();
    const { task, gate } = gatedTask(locks, "ride", {
      limits: [{ key: (p: Job) => p.tenant }, { key: () => "all", group: "ride_cap" }],
      // (safety nets far away: a job that parked would not run within the test)
      reschedule: { minDelay: 30_000, maxDelay: 60_000 },
    });
    const parks: bigint[] = [];
    locks.events.on("job:rescheduled", (e) => parks.push(e.lockKey));
    // In order: each job's unlock answered, and its return to graphile-worker.
    const order: string[] = [];
    const tenantOf = (job: { payload: unknown }) => (job.payload as Job).tenant;
    locks.events.on("lock:released", (e) => order.push(`released ${tenantOf(e.job)}`));
    const r = await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { ride: task },
      pollInterval: 100,
    });
    r.events.on("job:success", ({ job }) => order.push(`returned ${tenantOf(job)}`));
    await teachHold(locks, task, "ride");
    // h holds the cap; w (another tenant) meets it full, held here.
    await task.addJob({ tenant: "h" });
    await waitFor(async () => locks.status().held.length === 2, { message: "h to hold its slots" });
    await task.addJob({ tenant: "w" });
    await waitFor(async () => locks.status().handoffs.waitedHere > 0 || parks.length > 0, {
      message: "w to wait here or park",
      intervalMs: 1,
    });
    expect(parks).toEqual([]);
    gate.resolve();
    await waitFor(
      async () =>
        (await readExecutions(db.pool(), "ride")).filter((e) => e.end !== null).length === 3,
      { message: "w to run" },
    );
    expect(parks).toEqual([]);
    expect(locks.status().handoffs).toMatchObject({ waitedHere: 1, rodeWithUnlock: 1 });
    expect(highestConcurrency(intervals(await readExecutions(db.pool(), "ride")))).toBe(1);
    // A job whose slot a job waiting here takes returns once the statement carrying its unlock (and that
    // job's lock) has answered; a job that hands nothing on returns at once, its unlock on its way.
    await waitFor(async () => order.length === 6, { message: "every release and return" });
    const at = (event: string) => order.indexOf(event);
    expect(at("released h")).toBeLessThan(at("returned h"));
    expect(at("returned teach")).toBeLessThan(at("released teach"));
    expect(at("returned w")).toBeLessThan(at("released w"));
  });

  it("a release whose wakes fail after its statement answered keeps the lock session, and wakes its lines again", async () => {
    // Both tasks share a tenant limit and a cap of 1 (groups), each on a runner and a lock session of its own.
    const limits = [
      { key: (p: Job) => p.tenant, group: "wf_tenant" },
      { key: () => "all", group: "wf_cap" },
    ];
    // (safety nets far away: a parked job runs within the test only if a wake runs it)
    const reschedule = { minDelay: 30_000, maxDelay: 60_000 };
    const { logger, warnings } = warningsLogger();
    const locks = newLocks({ logger });
    const { task, gate } = gatedTask(locks, "wf", { limits, reschedule });
    const other = newLocks();
    const otherTask = other.exclusive("wf_other", recording("wf"), {
      onConflict: "reschedule",
      limits,
      reschedule,
    });
    const lost: string[] = [];
    locks.events.on("lock:lost", (e) => lost.push(...e.holds.map((hold) => hold.taskIdentifier)));
    await runner({ connectionString: db.url, concurrency: 2, taskList: { wf: task } });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { wf_other: otherTask } });
    await teachHold(locks, task, "wf");
    // h holds its tenant's slot and the cap; the other session's job of tenant h parks in the line of the
    // tenant's key, which only h's release wakes; w meets the cap full, held here, and waits here.
    await task.addJob({ tenant: "h" });
    await waitFor(async () => locks.status().held.length === 2, { message: "h to hold its slots" });
    const parked = nextEvent(other, "job:rescheduled");
    await otherTask.addJob({ tenant: "h" });
    await parked;
    await task.addJob({ tenant: "w" });
    await waitFor(async () => locks.status().handoffs.waitedHere > 0, {
      message: "w to wait here",
      intervalMs: 1,
    });
    const pid = locks.status().pid;
    // h's release carries w's request: its wakes go after the lock statement, in its transaction. They fail
    // once (the first call of release_waiters from now on raises).
    const restore = await failReleaseWaitersOnce();
    cleanups.push(restore);
    gate.resolve();
    await waitFor(
      async () =>
        (await readExecutions(db.pool(), "wf")).filter((e) => e.end !== null).length === 4,
      { message: "w, and the parked job, to run", timeoutMs: 15_000 },
    );
    expect(warnings.some((w) => w.includes("The wakes of a lock statement failed"))).toBe(true);
    expect(warnings.join("\n")).toContain("injected wake failure");
    expect(locks.status().handoffs.rodeWithUnlock).toBe(1);
    expect(lost).toEqual([]);
    expect(locks.status()).toMatchObject({ state: "ready", pid });
    const executions = await readExecutions(db.pool(), "wf");
    expect(new Set(executions.map((e) => e.jobId)).size).toBe(4);
    expect(concurrency(executions).all).toBe(1);
  });

  it("two tasks taking the same two keys in opposite orders never deadlock, nor exceed either", async () => {
    const locks = newLocks();
    const ab = locks.exclusive("ab", recording("ab"), {
      onConflict: "reschedule",
      limits: [
        { key: () => "A", group: "g" },
        { key: () => "B", group: "g" },
      ],
      reschedule: { minDelay: 10, maxDelay: 200 },
    });
    const ba = locks.exclusive("ba", recording("ba"), {
      onConflict: "reschedule",
      limits: [
        { key: () => "B", group: "g" },
        { key: () => "A", group: "g" },
      ],
      reschedule: { minDelay: 10, maxDelay: 200 },
    });
    await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { ab, ba },
      pollInterval: 100,
    });
    const rounds = 8;
    for (let i = 0; i < rounds; i++) {
      await ab.addJob({ tenant: "ab", ms: 5 });
      await ba.addJob({ tenant: "ba", ms: 5 });
    }
    const done = async () => [
      ...(await readExecutions(db.pool(), "ab")),
      ...(await readExecutions(db.pool(), "ba")),
    ];
    await waitFor(async () => (await done()).filter((e) => e.end !== null).length === 2 * rounds, {
      message: "every job to run",
      timeoutMs: 60_000,
    });
    expect(highestConcurrency(intervals(await done()))).toBe(1);
  });
});

describe("limit as a function of the key value", () => {
  it("gives each key its own number of slots, and refuses a bad answer before anything is written", async () => {
    const locks = newLocks();
    const gate = deferred();
    const task = locks.exclusive(
      "tiers",
      recording("tiers", () => gate.promise),
      {
        key: (p: Job) => p.tenant,
        limit: (tenant: string) => (tenant.startsWith("big") ? 2 : tenant === "bad" ? 0 : 1),
      },
    );
    expect(task.lockKey({ tenant: "big" })).toBe(lockKey("tiers", "big"));
    await expect(task.addJob({ tenant: "bad" })).rejects.toThrow(
      new InvalidArgumentError(
        "`limit` of task 'tiers' must return a positive integer, got 0 for key \"bad\"",
      ),
    );
    expect(await h.jobRows()).toEqual([]);
    const dropped: string[] = [];
    locks.events.on("job:dropped", (e) => dropped.push(e.job.id));
    await runner({
      connectionString: db.url,
      concurrency: 6,
      taskList: { tiers: task },
      pollInterval: 100,
    });
    await h.utils.addJobs([
      { identifier: "tiers", payload: { tenant: "big" } },
      { identifier: "tiers", payload: { tenant: "big" } },
      { identifier: "tiers", payload: { tenant: "small" } },
      { identifier: "tiers", payload: { tenant: "small" } },
    ]);
    await waitFor(
      async () => (await readExecutions(db.pool(), "tiers")).length + dropped.length === 4,
      {
        message: "every job to start or be dropped",
      },
    );
    const started = await readExecutions(db.pool(), "tiers");
    expect(started.filter((e) => e.lockKey === "big")).toHaveLength(2);
    expect(started.filter((e) => e.lockKey === "small")).toHaveLength(1);
    expect(dropped).toHaveLength(1);
    gate.resolve();
    // At run time a bad answer fails the job, naming the task and the option.
    await h.utils.addJob("tiers", { tenant: "bad" }, { maxAttempts: 1 });
    await waitFor(
      async () =>
        (await h.jobRows()).some((j) => j.last_error?.includes("`limit` of task 'tiers'")),
      { message: "the job to fail" },
    );
  });
});

describe("validation", () => {
  const locks = () => newLocks();
  it.each([
    [{ limits: [] }, "`limits` must be a non-empty array"],
    [{ limits: [{ limit: 0 }] }, "`limits[0].limit` must be a positive integer or a function"],
    [{ limits: [{}, { group: "" }] }, "`limits[1].group` must be a non-empty string"],
    [{ limits: [{}, { key: 1 }] }, "`limits[1].key` must be a function of the payload"],
    [{ limits: [{}, { lmit: 2 }] }, "`limits[1]`: unknown option `lmit`"],
    [{ limit: 2, limits: [{}, {}] }, "`limit` and `limits` cannot both be set"],
    [{ limit: "2" }, "`limit` must be a positive integer or a function"],
  ])("%j is refused", (options, message) => {
    expect(() => locks().exclusive("v", async () => undefined, options as never)).toThrow(message);
  });

  it("two limits whose keys meet are refused for the job, naming both", async () => {
    const task = locks().exclusive("same", async () => undefined, {
      limits: [{ key: (p: Job) => p.tenant }, { key: () => "all" }],
    });
    await expect(task.addJob({ tenant: "all" })).rejects.toThrow(
      "`limits[0]` and `limits[1]` of task 'same' give the same key",
    );
  });

  it("a preset or task file's rules are checked at start-up, naming the task and the option", () => {
    expect(() =>
      validateTaskRules("t", { limits: [{ key: () => 1 }, { limit: -1 }] }, "worker.locks.tasks"),
    ).toThrow(
      "worker.locks.tasks for task 't': `limits[1].limit` must be a positive integer or a function of the key value, got -1",
    );
    expect(() => validateTaskRules("t", { lockGroup: 5 }, "worker.locks.tasks")).toThrow(
      "worker.locks.tasks for task 't': `lockGroup` must be a non-empty string, got 5",
    );
    validateTaskRules("t", { lockGroup: "g", limits: [{ limit: (v: never) => v }] }, "x");
  });
});
