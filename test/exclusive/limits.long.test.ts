/**
 * Composed limits across processes (run with TEST_LONG=1): three worker processes
 * (test/fixtures/limits-worker.ts) run a task with two limits (one per tenant, a cap of 3 over all) and two
 * tasks sharing a lock group, through a kill -9 of a process and the termination of another's lock session.
 * Every execution's start and end is recorded with the database's clock, and no tenant, cap, or group key is
 * ever exceeded; every `reschedule` job completes exactly once; a job never holds part of its slots while
 * it waits (pg_locks sampled throughout). And two jobs taking the same two keys in opposite orders never
 * deadlock: thousands of rounds of the lock function on two connections, and jobs across processes.
 */
import { makeWorkerUtils, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { advisoryParts, slotKeys } from "../../src/key.js";
import { batchQuery, decodeBatch, makeBatch, type BatchRow } from "../../src/session/batch.js";
import { makeSql } from "../../src/sql.js";
import { highestConcurrency } from "../../scripts/overlap.js";
import { useTestDatabase, waitFor, waitForNoJobs } from "../support/db.js";
import { markBackend, stackedRequest } from "../support/lock-requests.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";

const SCRIPT = "limits-worker.ts";
const db = useTestDatabase();
let utils: WorkerUtils;

beforeAll(async () => {
  utils = await makeWorkerUtils({ connectionString: db.url });
});
afterAll(async () => {
  await utils?.release();
});

interface Run {
  task: string;
  jobId: string;
  key: string;
  worker: string;
  n: number;
  lost: boolean;
  note: string;
  /** Microseconds since the epoch (database clock). */
  start: bigint;
  end: bigint | null;
}

async function readRuns(): Promise<Run[]> {
  const { rows } = await db.pool().query<{
    task: string;
    job_id: string;
    lock_key: string;
    worker: string;
    note: string;
    s: string;
    e: string | null;
  }>(
    `select task, job_id::text, lock_key, worker, note,
       (extract(epoch from started_at) * 1000000)::bigint::text as s,
       (extract(epoch from ended_at) * 1000000)::bigint::text as e
     from test_executions order by id`,
  );
  return rows.map((r) => ({
    task: r.task,
    jobId: r.job_id,
    key: r.lock_key,
    worker: r.worker,
    n: Number.parseInt(r.note, 10),
    note: r.note,
    lost: r.note.endsWith(":lost"),
    start: BigInt(r.s),
    end: r.e === null ? null : BigInt(r.e),
  }));
}

/** The database's clock now, in microseconds since the epoch. */
async function now(): Promise<bigint> {
  const { rows } = await db
    .pool()
    .query<{ t: string }>(
      "select (extract(epoch from clock_timestamp()) * 1000000)::bigint::text as t",
    );
  return BigInt(rows[0]!.t);
}

const highest = (runs: readonly Run[]) =>
  highestConcurrency(runs.map((r) => ({ start: r.start, end: r.end! })));

/** The runs open at the first instant at which more than `cap` were (none if never), for a failure's message. */
function crowd(runs: readonly Run[], cap: number): Run[] {
  for (const r of [...runs].sort((a, b) => (a.start < b.start ? -1 : 1))) {
    const open = runs.filter((o) => o.start <= r.start && o.end! > r.start);
    if (open.length > cap) return open;
  }
  return [];
}

/** The most executions of each key that ran at once. */
function perKey(runs: readonly Run[]): Map<string, number> {
  const keys = new Set(runs.map((r) => r.key));
  return new Map([...keys].map((k) => [k, highest(runs.filter((r) => r.key === k))]));
}

async function drained(timeoutMs: number): Promise<void> {
  await waitForNoJobs(db.pool(), { timeoutMs });
}

/**
 * Samples pg_locks every few milliseconds until stopped: a session that holds a tenant key of `stacked`
 * must hold as many cap slots (each job holds one of each). A partial hold exists only inside the one
 * statement that takes them (microseconds): a mismatch seen in two samples in a row is a job holding part
 * of its slots.
 */
function sampleSlots(tenants: readonly string[]) {
  const tenantKeys = tenants.map((t) => advisoryParts(slotKeys("stacked", t, 1)[0]!));
  const capKeys = slotKeys("cap", "all", 3).map(advisoryParts);
  const key = (p: { classid: number; objid: number }) => `${p.classid}/${p.objid}`;
  const isTenant = new Set(tenantKeys.map(key));
  const isCap = new Set(capKeys.map(key));
  const client = new pg.Client({ connectionString: db.url });
  let stopped = false;
  let samples = 0;
  const persistent: string[] = [];
  const done = (async () => {
    await client.connect();
    let previous = new Set<number>();
    while (!stopped) {
      const { rows } = await client.query<{ pid: number; classid: number; objid: number }>(
        "select pid, classid::int8 as classid, objid::int8 as objid from pg_locks where locktype = 'advisory' and objsubid = 1 and granted",
      );
      samples++;
      const balance = new Map<number, number>();
      for (const r of rows) {
        const k = `${Number(r.classid)}/${Number(r.objid)}`;
        const d = isTenant.has(k) ? 1 : isCap.has(k) ? -1 : 0;
        if (d !== 0) balance.set(r.pid, (balance.get(r.pid) ?? 0) + d);
      }
      const off = new Set([...balance].filter(([, b]) => b !== 0).map(([pid]) => pid));
      for (const pid of off)
        if (previous.has(pid)) persistent.push(`pid ${pid}: ${JSON.stringify(rows)}`);
      previous = off;
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
    await client.end();
  })();
  return {
    async stop() {
      stopped = true;
      await done;
      return { samples, persistent };
    },
  };
}

describe("composed limits across 3 processes", () => {
  it("stacked limits and a shared group hold through kill -9 and a lock-session termination; every job completes once", async () => {
    const tenants = ["a", "b", "c", "d", "e", "f"];
    const groupKeys = ["k1", "k2", "wide"];
    const workers: WorkerProcess[] = [];
    const sampler = sampleSlots(tenants);
    let sampled: ReturnType<typeof sampler.stop> | undefined;
    let killAt = 0n;
    let terminateAt = 0n;
    try {
      for (const [name, localQueue] of [
        ["w1", false],
        ["w2", true],
        ["w3", false],
      ] as const) {
        workers.push(
          await startWorkerProcess(db.url, { name, concurrency: 4, localQueue, script: SCRIPT }),
        );
      }
      const jobs = [];
      for (let n = 0; n < 240; n++) {
        jobs.push({
          identifier: "stacked",
          payload: { t: tenants[n % tenants.length], ms: 5 + (n % 4) * 10, n },
        });
        if (n % 2 === 0) {
          jobs.push({
            identifier: n % 4 === 0 ? "grp_a" : "grp_b",
            payload: { k: groupKeys[n % 3], ms: 10 + (n % 3) * 10, n: 1000 + n },
          });
        }
      }
      await utils.addJobs(jobs);
      await waitFor(async () => (await readRuns()).filter((r) => r.end !== null).length >= 60, {
        message: "60 executions",
        timeoutMs: 120_000,
      });

      // kill -9 of a process that holds keys, and its graphile-worker jobs unlocked as an operator would.
      const victim = workers[0]!;
      await waitFor(
        async () => (await readRuns()).some((r) => r.worker === victim.name && r.end === null),
        { message: "the victim to be running a job", timeoutMs: 60_000 },
      );
      killAt = await now();
      victim.child.kill("SIGKILL");
      await victim.exited;
      const { rows: ids } = await db
        .pool()
        .query<{ id: string }>(
          "select detail->>'workerId' as id from test_events where kind = 'worker' and worker = $1",
          [victim.name],
        );
      expect(ids.length).toBeGreaterThan(0);
      await db
        .pool()
        .query("select graphile_worker.force_unlock_workers($1::text[])", [ids.map((r) => r.id)]);
      workers.push(
        await startWorkerProcess(db.url, { name: "w4", concurrency: 4, script: SCRIPT }),
      );

      // More work, longer jobs: the lock session of another process is terminated while its jobs run.
      const more = [];
      for (let n = 240; n < 300; n++) {
        more.push({
          identifier: "stacked",
          payload: { t: tenants[n % tenants.length], ms: 100 + (n % 3) * 50, n },
        });
        if (n % 2 === 0) {
          more.push({
            identifier: n % 4 === 0 ? "grp_a" : "grp_b",
            payload: { k: groupKeys[n % 3], ms: 100, n: 1000 + n },
          });
        }
      }
      await utils.addJobs(more);
      await waitFor(
        async () => (await readRuns()).some((r) => r.worker === "w2" && r.end === null),
        { message: "w2 to be running a job", timeoutMs: 60_000 },
      );
      terminateAt = await now();
      const { rows: terminated } = await db
        .pool()
        .query<{ n: number }>(
          "select count(pg_terminate_backend(pid))::int as n from pg_stat_activity where application_name = 'graphile-worker-locks/w2'",
        );
      expect(terminated[0]!.n).toBe(1);

      await drained(240_000);
    } finally {
      for (const w of workers) {
        if (w.child.exitCode === null && w.child.signalCode === null) await w.stop();
      }
      sampled = sampler.stop();
    }
    const { samples, persistent } = await sampled!;

    // A killed job's lock went with its process, a lost one's with its session: neither ran past that
    // moment with its key (the server frees the keys only after it).
    // A job whose loss its process heard of only after it returned could not be aborted; its recorded end
    // (a write after its body) is capped at the loss as a lost one's is, as the soak does.
    const { rows: returnedLoss } = await db
      .pool()
      .query<{ job_id: string }>(
        "select job_id::text from test_events where kind = 'lock:lost-returned'",
      );
    const lostAfterReturn = new Set(returnedLoss.map((r) => r.job_id));
    // A lost execution's row may have been written after the loss (a busy machine delays it): capped, it
    // ends where it starts. It did start before the loss: none starts with its signal aborted.
    const capped = (r: Run, at: bigint) => {
      const end = at < r.end! ? at : r.end!;
      return { ...r, end: end < r.start ? r.start : end };
    };
    const runs = (await readRuns()).map((r) => {
      if (r.end === null && r.worker === "w1") return capped({ ...r, end: killAt }, killAt);
      if (r.lost || (r.worker === "w2" && lostAfterReturn.has(r.jobId)))
        return capped(r, terminateAt);
      return r;
    });
    expect(runs.filter((r) => r.end === null)).toEqual([]);
    expect(runs.filter((r) => r.note.includes(":preaborted"))).toEqual([]);
    const stacked = runs.filter((r) => r.task === "stacked");
    const grouped = runs.filter((r) => r.task === "grp_a" || r.task === "grp_b");
    const overCap = crowd(stacked, 3);
    expect(
      overCap,
      `more than 3 at once; kill at ${killAt}, termination at ${terminateAt}, lost after return: ${[...lostAfterReturn].join(", ")}`,
    ).toEqual([]);
    expect(highest(stacked)).toBe(3);
    const tenantCrowds = [...new Set(stacked.map((r) => r.key))]
      .map((k) =>
        crowd(
          stacked.filter((r) => r.key === k),
          1,
        ),
      )
      .filter((c) => c.length > 0);
    expect(
      tenantCrowds,
      `a tenant twice at once; kill at ${killAt}, termination at ${terminateAt}`,
    ).toEqual([]);
    const byGroupKey = perKey(grouped);
    expect(byGroupKey.get("k1")).toBe(1);
    expect(byGroupKey.get("k2")).toBe(1);
    expect(byGroupKey.get("wide")).toBeLessThanOrEqual(2);

    // Every job completed exactly once. A killed or lost execution is not a completion, and neither is one of
    // the killed process whose job row ran again elsewhere: it may have ended just before the kill, with
    // graphile-worker's completion of the row not yet committed, and the unlocked row then runs again (at
    // least once, as graphile-worker promises after a crash), or meets its held key there and is given back
    // by that process, its copy running in its place. A copy has an id of its own, and a job given back by
    // the process that ran it is not excused, so this excuses no duplicate the library could make.
    const { rows: givenBackRows } = await db
      .pool()
      .query<{ job_id: string; worker: string; copy: string }>(
        "select job_id::text, worker, detail->>'newJobId' as copy from test_events where kind = 'given-back' order by id",
      );
    const rerun = (r: Run) =>
      r.worker === "w1" &&
      (runs.some((o) => o !== r && o.jobId === r.jobId && o.worker !== "w1") ||
        givenBackRows.some((g) => g.job_id === r.jobId && g.worker !== "w1"));
    const completed = runs.filter(
      (r) => !r.lost && !(r.worker === "w1" && r.end === killAt) && !rerun(r),
    );
    const counts = new Map<number, number>();
    for (const r of completed) counts.set(r.n, (counts.get(r.n) ?? 0) + 1);
    expect(counts.size).toBe(300 + 150);
    const twice = [...counts].filter(([, c]) => c !== 1).map(([n]) => n);
    const twiceRuns = twice.map((n) => completed.filter((r) => r.n === n));
    const twiceIds = new Set(twiceRuns.flat().map((r) => r.jobId));
    expect(
      twiceRuns,
      `jobs completed more than once; their give-backs (job, worker, copy): ${JSON.stringify(
        givenBackRows.filter((g) => twiceIds.has(g.job_id) || twiceIds.has(g.copy)),
      )}; kill at ${killAt}, termination at ${terminateAt}`,
    ).toEqual([]);

    expect(persistent).toEqual([]);
    expect(samples).toBeGreaterThan(50);
    const { rows: left } = await db
      .pool()
      .query<{ n: number }>("select count(*)::int as n from graphile_worker_locks.waiters");
    expect(left[0]!.n).toBe(0);
    console.info(
      `stacked: ${stacked.length} executions, group: ${grouped.length}, lost: ${runs.filter((r) => r.lost).length}, pg_locks samples: ${samples}`,
    );
  }, 420_000);

  it("two jobs taking the same two keys in opposite orders never deadlock: 3 processes, 600 jobs", async () => {
    await db.pool().query("truncate test_executions");
    const workers: WorkerProcess[] = [];
    try {
      for (const name of ["x1", "x2", "x3"])
        workers.push(await startWorkerProcess(db.url, { name, concurrency: 4, script: SCRIPT }));
      await utils.addJobs(
        Array.from({ length: 600 }, (_, n) => ({
          identifier: n % 2 === 0 ? "ab" : "ba",
          payload: { k: "ab", ms: 1, n },
        })),
      );
      await drained(240_000);
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }
    const runs = await readRuns();
    expect(runs.filter((r) => r.end === null)).toEqual([]);
    expect(highest(runs)).toBe(1);
    expect(new Set(runs.map((r) => r.n)).size).toBe(600);
    expect(runs).toHaveLength(600);
  }, 300_000);

  /**
   * The two ways a lock statement takes a job's limits all or none: try_lock_all (a line, or a limit of
   * several slots), and the CASE expression of the statement for limits of one key each (`fastLimits`).
   * Each answers the slots taken, or '!' and the limit that was full.
   */
  const takeAll = {
    try_lock_all: async (c: pg.Client, keys: string[]) =>
      (
        await c.query<{ r: string }>("select graphile_worker_locks.try_lock_all($1, null) as r", [
          keys.map((k) => `${k}:${k}`).join(";"),
        ])
      ).rows[0]!.r,
    "the lock statement's expression": async (c: pg.Client, keys: string[]) => {
      const mark = "limits-test";
      const pid = await markBackend(c, mark);
      const request = stackedRequest(keys.map((k) => [k]));
      const query = batchQuery(sql, makeBatch([], [request], [], false), pid, mark);
      expect(query.name).toBe("gwl_lock_limits2");
      return decodeBatch((await c.query<BatchRow>(query)).rows).stacked.get(1)!;
    },
  };
  const sql = makeSql("graphile_worker_locks", "graphile_worker");

  it.each(Object.keys(takeAll))(
    "%s, on two connections in opposite orders, thousands of rounds: never a deadlock or a partial hold",
    async (way) => {
      const take = takeAll[way as keyof typeof takeAll];
      const [a, b] = slotKeys("g", "A", 1).concat(slotKeys("g", "B", 1));
      const forward = [String(a), String(b)];
      const backward = [String(b), String(a)];
      const clients = [
        new pg.Client({ connectionString: db.url }),
        new pg.Client({ connectionString: db.url }),
      ];
      await Promise.all(clients.map((c) => c.connect()));
      const held = async (c: pg.Client) =>
        (
          await c.query<{ n: number }>(
            "select count(*)::int as n from pg_locks where locktype = 'advisory' and pid = pg_backend_pid() and granted",
          )
        ).rows[0]!.n;
      let taken = 0;
      let refused = 0;
      try {
        await Promise.all(
          clients.map(async (c, i) => {
            for (let round = 0; round < 2500; round++) {
              const answer = await take(c, i === 0 ? forward : backward);
              if (answer.startsWith("!")) {
                refused++;
                // Refused: it holds nothing.
                expect(await held(c)).toBe(0);
              } else {
                taken++;
                expect(await held(c)).toBe(2);
                await c.query("select pg_advisory_unlock_all()");
              }
            }
          }),
        );
      } finally {
        await Promise.all(clients.map((c) => c.end()));
      }
      expect(taken + refused).toBe(5000);
      expect(taken).toBeGreaterThan(0);
      expect(refused).toBeGreaterThan(0);
    },
    300_000,
  );
});
