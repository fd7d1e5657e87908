/**
 * A job with a lock (one slot, one limit) and a rate asks its rate in its lock statement (lock_rated,
 * sql/000012.sql): its start is counted there, with no statement of its own on graphile-worker's connection;
 * a busy row of the rate does not hold up the lock session (a `reschedule` job then takes nothing and asks
 * its rate first); the rate still decides before the lock (a job over its rate goes back to the queue even
 * when its key is held); and a `reschedule` job keeps its line.
 * Real PostgreSQL and graphile-worker runners; the cross-process proof is in rate.long.test.ts.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import type { Locks } from "../../src/index.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { batchQuery, decodeBatch, makeBatch, type BatchRow } from "../../src/session/batch.js";
import type { RateRide } from "../../src/session/holds.js";
import { makeSql } from "../../src/sql.js";
import { lockRequest, markBackend, plainInfo } from "../support/lock-requests.js";

const h = useExclusiveHarness(
  "truncate test_executions, test_events; delete from graphile_worker_locks.rates; delete from graphile_worker_locks.rate_reservations; delete from graphile_worker_locks.pauses",
);
const { db, newLocks, runner } = h;

/**
 * Counts, from now until the test ends, the statements sent by name: `rate_admit` (a job's rate asked on
 * graphile-worker's connection) and lock statements that carry a rate (`gwl_lock_*_rated`).
 */
function countStatements() {
  const counts = { rateAdmit: 0, lockRated: 0 };
  const original = pg.Client.prototype.query;
  h.cleanups.push(async () => {
    pg.Client.prototype.query = original;
  });
  pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
    const name = (args[0] as { name?: string } | undefined)?.name;
    if (typeof name === "string") {
      if (name.startsWith("gwl_rate_admit_")) counts.rateAdmit++;
      if (name.startsWith("gwl_lock_") && name.endsWith("_rated")) counts.lockRated++;
    }
    return (original as (...a: unknown[]) => unknown).apply(this, args);
  } as typeof original;
  return counts;
}

/** Job ids of `rate:admitted`, `job:throttled`, `job:dropped` and `lock:conflict`, by payload `n`. */
function recordOutcomes(locks: Locks) {
  const seen = {
    admitted: [] as number[],
    throttled: [] as number[],
    dropped: [] as number[],
    conflicts: [] as number[],
  };
  const n = (e: { job: { payload: unknown } }) => (e.job.payload as { n: number }).n;
  locks.events.on("rate:admitted", (e) => seen.admitted.push(n(e)));
  locks.events.on("job:throttled", (e) => seen.throttled.push(n(e)));
  locks.events.on("job:dropped", (e) => seen.dropped.push(n(e)));
  locks.events.on("lock:conflict", (e) => seen.conflicts.push(n(e)));
  return seen;
}

describe("a rate asked in the lock statement", () => {
  it("counts the start of a job below its rate there, with no rate statement on graphile-worker's connection", async () => {
    const counts = countStatements();
    const locks = newLocks();
    const seen = recordOutcomes(locks);
    const ran: number[] = [];
    const task = locks.exclusive(
      "ride_plain",
      async (p: { n: number; k: string }) => {
        ran.push(p.n);
      },
      { key: (p) => ({ n: p.n }), rate: { limit: 1000, period: 60_000, key: (p) => p.k } },
    );
    const jobs = 40;
    await h.utils.addJobs(
      Array.from({ length: jobs }, (_, n) => ({
        identifier: "ride_plain",
        payload: { n, k: n % 2 === 0 ? "even" : "odd" },
      })),
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { ride_plain: task },
    });
    locks.attach(r);
    await waitFor(async () => ran.length === jobs, { message: "every job to run" });
    expect([...ran].sort((a, b) => a - b)).toEqual(Array.from({ length: jobs }, (_, n) => n));
    expect([...seen.admitted].sort((a, b) => a - b)).toEqual(ran.sort((a, b) => a - b));
    expect(seen.throttled).toEqual([]);
    // Every start was counted by a lock statement; none asked the rate on its own.
    expect(counts.rateAdmit).toBe(0);
    expect(counts.lockRated).toBeGreaterThan(0);
    const { rows } = await h.q<{ label: string; n: number }>(
      "select label, cardinality(starts)::int as n from graphile_worker_locks.rates order by label",
    );
    expect(rows.map((row) => row.n)).toEqual([jobs / 2, jobs / 2]);
  });

  // A `drop` job whose rate's row is busy takes its key (its rate then decides on graphile-worker's connection);
  // a `reschedule` job takes nothing, and its key stays free while its rate decides first.
  for (const { onConflict, title, suffix } of [
    {
      onConflict: "drop" as const,
      title:
        "a busy row of the rate does not hold up the lock session: the job is admitted once it holds its key",
      suffix: "",
    },
    {
      onConflict: "reschedule" as const,
      title:
        "a `reschedule` job whose rate's row is busy takes nothing: its key stays free while it asks its rate first",
      suffix: "_line",
    },
  ]) {
    it(title, async () => {
      const counts = countStatements();
      const locks = newLocks();
      const seen = recordOutcomes(locks);
      const ran: string[] = [];
      const [ratedName, plainName] = [`ride_busy${suffix}`, `ride_other${suffix}`];
      const rated = locks.exclusive(
        ratedName,
        async (p: { n: number }) => {
          ran.push(`rated ${p.n}`);
        },
        {
          key: () => "one",
          onConflict,
          ...(onConflict === "reschedule" ? { reschedule: { minDelay: 50, maxDelay: 200 } } : {}),
          rate: { limit: 10, period: 60_000 },
        },
      );
      const plain = locks.exclusive(plainName, async (p: { n: number }) => {
        ran.push(`plain ${p.n}`);
      });
      // The key's row, made by a first start, then held by a transaction of another connection.
      await h.utils.addJob(ratedName, { n: 0 });
      const r = await runner({
        connectionString: db.url,
        concurrency: 4,
        taskList: { [ratedName]: rated, [plainName]: plain },
      });
      locks.attach(r);
      await waitFor(async () => ran.includes("rated 0"), { message: "job 0 to run" });
      // Job 0 rode: its start was counted in its lock statement.
      expect(counts.rateAdmit).toBe(0);
      const holder = await h.connect();
      await holder.query("begin");
      await holder.query("select 1 from graphile_worker_locks.rates for update");
      try {
        await h.utils.addJob(ratedName, { n: 1 });
        // Job 1's lock statement skipped the busy row (a `drop` job took its key; a `reschedule` job took
        // nothing); its rate now waits on graphile-worker's connection. Meanwhile the lock session serves
        // other jobs.
        await waitFor(async () => counts.rateAdmit === 1, { message: "job 1 to ask its rate" });
        await h.utils.addJob(plainName, { n: 2 });
        await waitFor(async () => ran.includes("plain 2"), {
          message: "a job of another task to run while the row is busy",
        });
        expect(await rated.lockAvailable({ n: 1 })).toBe(onConflict === "reschedule");
        expect(ran).not.toContain("rated 1");
      } finally {
        await holder.query("rollback");
      }
      await waitFor(async () => ran.includes("rated 1"), { message: "job 1 to run" });
      expect(seen.admitted).toEqual([0, 1]);
      expect(seen.conflicts).toEqual([]);
      const { rows } = await h.q<{ n: number }>(
        "select cardinality(starts)::int as n from graphile_worker_locks.rates",
      );
      expect(rows).toEqual([{ n: 2 }]);
    });
  }

  it("the rate decides first: a job over its rate whose key is held goes back to the queue; one below it meets the conflict", async () => {
    const locks = newLocks();
    const seen = recordOutcomes(locks);
    const ran: number[] = [];
    const full = locks.exclusive(
      "ride_full",
      async (p: { n: number }) => {
        ran.push(p.n);
      },
      { key: () => "one", rate: { limit: 1, period: 60_000 } },
    );
    const room = locks.exclusive(
      "ride_room",
      async (p: { n: number }) => {
        ran.push(p.n);
      },
      { key: () => "one", rate: { limit: 10, period: 60_000 } },
    );
    const free = locks.exclusive(
      "ride_free",
      async (p: { n: number }) => {
        ran.push(p.n);
      },
      { key: () => "one", rate: { limit: 1, period: 60_000 } },
    );
    await h.utils.addJob("ride_full", { n: 0 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 2,
      taskList: { ride_full: full, ride_room: room, ride_free: free },
    });
    locks.attach(r);
    await waitFor(async () => ran.includes(0), { message: "job 0 to use the rate" });
    const fullHeld = await h.holdExternally(full.lockKey({ n: 1 }));
    await h.holdExternally(room.lockKey({ n: 2 }));
    await h.utils.addJob("ride_full", { n: 1 });
    await h.utils.addJob("ride_room", { n: 2 });
    await waitFor(async () => seen.throttled.includes(1) && seen.dropped.includes(2), {
      message: "job 1 to be given back and job 2 dropped",
    });
    expect(seen.conflicts).toEqual([2]);
    expect(ran).toEqual([0]);
    expect(seen.admitted).toEqual([0]);
    // Its key free, a job over its rate is given back too, its statement leaving the key free (job 4, of a
    // task no job of which was refused yet: it asks its rate in its lock statement).
    await fullHeld.release();
    await h.utils.addJob("ride_free", { n: 3 });
    await waitFor(async () => ran.includes(3), { message: "job 3 to use the rate" });
    await h.utils.addJob("ride_free", { n: 4 });
    await waitFor(async () => seen.throttled.includes(4), { message: "job 4 to be given back" });
    expect(await free.lockAvailable({ n: 4 })).toBe(true);
    expect(seen.conflicts).toEqual([2]);
    expect(seen.admitted).toEqual([0, 3]);
    // Jobs 1 and 4's copies wait for their slots, a period on.
    const copies = `from graphile_worker._private_jobs j join graphile_worker._private_tasks t
      on t.id = j.task_id where t.identifier in ('ride_full', 'ride_free')`;
    const { rows } = await h.q<{ n: number }>(
      `select count(*)::int as n ${copies} and j.run_at > now() + interval '30 seconds'`,
    );
    expect(rows[0]!.n).toBe(2);
    await h.q(`delete from graphile_worker._private_jobs where id in (select j.id ${copies})`);
  });

  it("a `reschedule` job that meets its key held asks its rate first, parks with nothing left counted, and is counted once when it starts", async () => {
    const counts = countStatements();
    const locks = newLocks();
    const seen = recordOutcomes(locks);
    // Each park, with the rate asks counted when it was told.
    const parked: { n: number; rateAdmits: number }[] = [];
    locks.events.on("job:rescheduled", (e) =>
      parked.push({ n: (e.job.payload as { n: number }).n, rateAdmits: counts.rateAdmit }),
    );
    const ran: number[] = [];
    const task = locks.exclusive(
      "ride_line",
      async (p: { n: number }) => {
        ran.push(p.n);
      },
      {
        key: () => "one",
        onConflict: "reschedule",
        // The external holder's release wakes no line: the copy runs by its safety net, late enough
        // that the checks below see only the first park, soon enough to keep the test short.
        reschedule: { minDelay: 1000, maxDelay: 1500 },
        rate: { limit: 10, period: 60_000 },
      },
    );
    const held = await h.holdExternally(task.lockKey({ n: 0 }));
    await h.utils.addJob("ride_line", { n: 0 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { ride_line: task },
    });
    locks.attach(r);
    await waitFor(async () => parked.length > 0, { message: "job 0 to park" });
    const log = async () =>
      (
        await h.q<{ n: number }>(
          "select cardinality(starts)::int as n from graphile_worker_locks.rates",
        )
      ).rows.map((row) => row.n);
    // Its lock statement met the key held and took nothing; the job then asked its rate on
    // graphile-worker's connection (the probe, which counted its start), met the key held again, parked,
    // and its start was taken back (after the park: the event can come first).
    expect(parked[0]).toEqual({ n: 0, rateAdmits: 1 });
    await waitFor(async () => (await log())[0] === 0, { message: "its start to be taken back" });
    expect(await log()).toEqual([0]);
    expect(seen.conflicts).toContain(0);
    await held.release();
    await waitFor(async () => ran.includes(0), { message: "job 0 to run" });
    expect(seen.admitted).toEqual([0]);
    expect(await log()).toEqual([1]);
  });

  it("a `reschedule` job whose key a job of its own process holds asks its rate before it waits for the key", async () => {
    const counts = countStatements();
    const locks = newLocks();
    const seen = recordOutcomes(locks);
    const ran: number[] = [];
    let finish!: () => void;
    const finished = new Promise<void>((resolve) => (finish = resolve));
    const task = locks.exclusive(
      "ride_local",
      async (p: { n: number }) => {
        ran.push(p.n);
        if (p.n === 0) await finished;
      },
      {
        key: () => "one",
        onConflict: "reschedule",
        // Job 1 parks behind job 0, and job 0's release wakes it. Its safety net is late enough that its copy
        // does not ask its rate again while the test looks for its one ask.
        reschedule: { minDelay: 1000, maxDelay: 1500 },
        rate: { limit: 10, period: 60_000 },
      },
    );
    await h.utils.addJob("ride_local", { n: 0 });
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { ride_local: task },
    });
    locks.attach(r);
    await waitFor(async () => ran.includes(0), { message: "job 0 to run" });
    // Job 0 rode: its start was counted in its lock statement.
    expect(counts.rateAdmit).toBe(0);
    try {
      await h.utils.addJob("ride_local", { n: 1 });
      // Job 1 finds its key held here. Its rate decides now, while job 0 still holds the key: it does not
      // take the key in memory at job 0's end with its rate still to be asked.
      await waitFor(async () => counts.rateAdmit === 1, {
        message: "job 1 to ask its rate while job 0 holds the key",
      });
      expect(ran).toEqual([0]);
    } finally {
      finish();
    }
    await waitFor(async () => ran.includes(1), { message: "job 1 to run" });
    expect(seen.admitted).toEqual([0, 1]);
    const { rows } = await h.q<{ n: number }>(
      "select cardinality(starts)::int as n from graphile_worker_locks.rates",
    );
    expect(rows).toEqual([{ n: 2 }]);
  });

  it("a line of `reschedule` jobs of one key: each runs once, one at a time, each start counted once", async () => {
    const locks = newLocks();
    const seen = recordOutcomes(locks);
    const runs: Array<{ n: number; start: number; end: number }> = [];
    const task = locks.exclusive(
      "ride_queue",
      async (p: { n: number }) => {
        const start = performance.now();
        await new Promise((resolve) => setTimeout(resolve, 15));
        runs.push({ n: p.n, start, end: performance.now() });
      },
      {
        key: () => "one",
        onConflict: "reschedule",
        reschedule: { minDelay: 50, maxDelay: 500 },
        rate: { limit: 1000, period: 60_000 },
      },
    );
    const jobs = 16;
    await locks.addJobs(
      Array.from({ length: jobs }, (_, n) => ({ identifier: "ride_queue", payload: { n } })),
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { ride_queue: task },
    });
    locks.attach(r);
    await waitFor(async () => runs.length === jobs, {
      message: "every job to run",
      timeoutMs: 30_000,
    });
    expect(runs.map((x) => x.n).sort((a, b) => a - b)).toEqual(
      Array.from({ length: jobs }, (_, n) => n),
    );
    const byStart = [...runs].sort((a, b) => a.start - b.start);
    for (let i = 1; i < byStart.length; i++)
      expect(
        byStart[i]!.start,
        `job ${byStart[i]!.n} after job ${byStart[i - 1]!.n}`,
      ).toBeGreaterThanOrEqual(byStart[i - 1]!.end);
    expect([...seen.admitted].sort((a, b) => a - b)).toEqual(
      runs.map((x) => x.n).sort((a, b) => a - b),
    );
    const { rows } = await h.q<{ n: number }>(
      "select cardinality(starts)::int as n from graphile_worker_locks.rates",
    );
    expect(rows).toEqual([{ n: jobs }]);
  });

  it("each lock statement that carries rates (plain, full, with several limits) takes the key and counts the start", async () => {
    const sql = makeSql("graphile_worker_locks", "graphile_worker");
    const client = await h.connect();
    const pid = await markBackend(client, "test");
    const ride = (rateKey: string): RateRide => ({
      rateKey,
      label: `rate ${rateKey}`,
      limit: 5,
      periodMs: 60_000,
      burst: 5,
      pauseKeys: [],
    });
    const cases = [
      // (a plain batch: the rated request alone)
      {
        name: "gwl_lock_plain_rated",
        locks: [lockRequest(["101"], plainInfo, { ride: ride("901") })],
      },
      // (a semaphore request beside it)
      {
        name: "gwl_lock_slots_rated",
        locks: [
          lockRequest(["102"], plainInfo, { ride: ride("902") }),
          lockRequest(["201", "202"], plainInfo),
        ],
      },
      // (a request of several limits of one key each beside it)
      {
        name: "gwl_lock_limits2_rated",
        locks: [
          lockRequest(["103"], plainInfo, { ride: ride("903") }),
          lockRequest(["301", "302"], plainInfo, {
            limits: [["301"], ["302"]],
            lines: ["301", "302"],
          }),
        ],
      },
      // (a request of several limits, one of two slots, beside it: try_lock_all)
      {
        name: "gwl_lock_stacked_rated",
        locks: [
          lockRequest(["104"], plainInfo, { ride: ride("904") }),
          lockRequest(["401", "402", "403"], plainInfo, {
            limits: [["401", "402"], ["403"]],
            lines: ["", "403"],
          }),
        ],
      },
    ];
    for (const c of cases) {
      const query = batchQuery(sql, makeBatch([], c.locks, [], false), pid, "test");
      expect(query.name).toBe(c.name);
      const { rows } = await client.query<BatchRow>(query);
      const answer = decodeBatch(rows);
      expect(answer.marked, c.name).toBe(true);
      const rated = answer.rated.get(1);
      expect(rated, c.name).toMatch(/^\d+$/);
      const limits = c.locks[1]?.limits;
      if (limits) expect(answer.stacked.get(1), c.name).toBe(limits.map((l) => l[0]).join(","));
    }
    const { rows } = await client.query<{ k: string }>(
      "select ((classid::bigint << 32) | objid::bigint)::text as k from pg_locks where locktype = 'advisory' and pid = pg_backend_pid() order by 1",
    );
    expect(rows.map((r) => r.k)).toEqual(
      expect.arrayContaining(["101", "102", "103", "104", "301", "302", "401", "403"]),
    );
    const logs = await h.q<{ rate_key: string; n: number }>(
      "select rate_key::text, cardinality(starts)::int as n from graphile_worker_locks.rates order by rate_key",
    );
    expect(logs.rows).toEqual([
      { rate_key: "901", n: 1 },
      { rate_key: "902", n: 1 },
      { rate_key: "903", n: 1 },
      { rate_key: "904", n: 1 },
    ]);
  });
});
