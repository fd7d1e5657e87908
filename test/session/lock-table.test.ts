/**
 * A full shared lock table: PostgreSQL refuses the lock session's statements with "out of shared memory"
 * (53200) while the session itself is sound. Real PostgreSQL, a real graphile-worker runner, and a separate
 * connection that holds most of the server's lock table with advisory locks of its own (the two-int form,
 * which never meets the library's keys).
 */
import type net from "node:net";
import pg from "pg";
import { describe, expect, it } from "vitest";
import { ErrorCodes, type LocksEvents } from "../../src/index.js";
import { advisoryParts, slotKeys } from "../../src/key.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { startProxy } from "../support/proxy.js";
import { warningsLogger } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

/** The first int of the filler's advisory keys. */
const FILLER = 424242;

/**
 * Fills the server's lock table from `client`: locks advisory keys in one statement until PostgreSQL runs
 * out of lock memory (session locks stay held after the statement fails), then releases `room` of them.
 * Resolves the entries the table holds by the settings, and how many the filler holds.
 */
async function fillLockTable(
  client: pg.Client,
  room: number,
): Promise<{ entries: number; held: number }> {
  const { rows } = await client.query<{ entries: number }>(
    `select current_setting('max_locks_per_transaction')::int
       * (current_setting('max_connections')::int + current_setting('max_prepared_transactions')::int)
       as entries`,
  );
  const entries = rows[0]!.entries;
  // Twice the nominal size: PostgreSQL lends the table some spare shared memory beyond it.
  const error = await client
    .query(`select count(pg_advisory_lock(${FILLER}, g)) from generate_series(1, $1::int) g`, [
      2 * entries + 1000,
    ])
    .then(
      () => null,
      (e: unknown) => e as { code?: string },
    );
  expect(error?.code, "the filler to run out of lock memory").toBe("53200");
  await client.query(
    `select count(pg_advisory_unlock(${FILLER}, g)) from generate_series(1, $1::int) g`,
    [room],
  );
  const { rows: held } = await client.query<{ n: number }>(
    `select count(*)::int as n from pg_locks where pid = pg_backend_pid() and locktype = 'advisory'`,
  );
  return { entries, held: held[0]!.n };
}

/**
 * A pool of `size` connections, all opened now and kept open: a backend cannot start while the lock table is
 * full (it takes locks on shared catalogs), so every connection the test needs then is opened before.
 */
async function openPool(size: number): Promise<pg.Pool> {
  const pool = new pg.Pool({ connectionString: db.url, max: size, idleTimeoutMillis: 0 });
  // (the database is dropped with its connections after the file)
  pool.on("error", () => undefined);
  pool.on("connect", (client) => client.on("error", () => undefined));
  cleanups.push(() => pool.end());
  const clients = await Promise.all(Array.from({ length: size }, () => pool.connect()));
  for (const client of clients) client.release();
  return pool;
}

/**
 * A TCP proxy to the test database whose answers to the client can be held back (`hold`) and let through
 * (`release`), in order.
 */
async function holdingProxy(): Promise<{ url: string; hold(): void; release(): void }> {
  let held: Buffer[] | null = null;
  const clients = new Set<net.Socket>();
  const { url } = await startProxy(db.url, cleanups, (inbound, open) => {
    const outbound = open();
    clients.add(inbound);
    inbound.on("close", () => clients.delete(inbound));
    for (const socket of [inbound, outbound]) socket.on("error", () => undefined);
    inbound.pipe(outbound);
    outbound.on("data", (data: Buffer) => {
      if (held) held.push(data);
      else inbound.write(data);
    });
    inbound.on("close", () => outbound.destroy());
    outbound.on("close", () => inbound.destroy());
  });
  return {
    url,
    hold() {
      held ??= [];
    },
    release() {
      const data = held ?? [];
      held = null;
      // (one client goes through the proxy: the lock session)
      for (const client of clients) for (const chunk of data) client.write(chunk);
    },
  };
}

describe("a full lock table", () => {
  it("gives back the jobs that could not lock without an attempt, aborts no holder and leaves nothing locked", async () => {
    const { logger, warnings } = warningsLogger();
    const proxy = await holdingProxy();
    // Deferred copies come back after two seconds.
    const locks = newLocks({ logger, lockConnectionString: proxy.url, lockSessionWait: 2000 });
    const lost: Array<LocksEvents["lock:lost"]> = [];
    const deferrals: Array<LocksEvents["job:deferred"]> = [];
    locks.events.on("lock:lost", (e) => lost.push(e));
    locks.events.on("job:deferred", (e) => deferrals.push(e));
    const gate = deferred();
    cleanups.push(async () => gate.resolve()); // (before the runners stop, should the test fail)
    const pool = await openPool(4);
    const executions: Array<{ n: number; attempts: number; aborted: boolean }> = [];
    const holderStarted = deferred<string>();
    // The holder runs through the whole test; the others (n = 1 to 12) take a key each.
    const task = locks.exclusive(
      "exec",
      async (p: { n: number }, helpers) => {
        // (a read: it takes no entry of the lock table)
        await pool.query("select clock_timestamp()");
        if (p.n === 0) {
          holderStarted.resolve(helpers.job.id);
          await gate.promise;
        }
        executions.push({
          n: p.n,
          attempts: helpers.job.attempts,
          aborted: !!helpers.abortSignal?.aborted,
        });
      },
      { key: (p) => p.n },
    );
    await locks.connect();
    await runner({ pgPool: await openPool(2), concurrency: 1, taskList: { exec: task } });
    await h.utils.addJob("exec", { n: 0 });
    const holderJobId = await holderStarted.promise;

    // Twelve workers fed by a local queue of twelve: lock-ahead asks for twelve keys in one statement.
    const burst = await runner({
      pgPool: await openPool(4),
      concurrency: 12,
      taskList: { exec: task },
      preset: { worker: { localQueue: { size: 12 } } },
    });
    locks.attach(burst);
    const filler = await h.connect();
    const { entries } = await fillLockTable(filler, 8);
    // Its answer is held until every job has started and waits for it: then they ask again together, in
    // one statement of twelve keys, which meets the full table too.
    let started = 0;
    const allStarted = deferred();
    let first = true;
    burst.events.on("localQueue:getJobs:complete", ({ jobs }) => {
      if (jobs.length > 0 && first) proxy.hold();
      first &&= jobs.length === 0;
    });
    burst.events.on("job:start", () => {
      if (++started === 12) setImmediate(() => allStarted.resolve());
    });
    await h.utils.addJobs(
      Array.from({ length: 12 }, (_, i) => ({ identifier: "exec", payload: { n: i + 1 } })),
    );
    await allStarted.promise;
    proxy.release();
    await waitFor(async () => deferrals.length === 12, {
      message: "the twelve jobs to go back to the queue",
    });
    await filler.end();
    // The holder, still running, still holds its key on the lock session.
    expect(await task.lockAvailable({ n: 0 })).toBe(false);
    expect(locks.status().held.map((held) => held.jobId)).toContain(holderJobId);
    await waitFor(async () => executions.length === 12, {
      message: "the twelve jobs to run once the table has room",
    });
    gate.resolve();
    await waitFor(async () => executions.length === 13 && (await h.jobRows()).length === 0, {
      message: "every job to finish",
    });

    for (const e of deferrals) {
      expect(e.error).toMatchObject({ code: ErrorCodes.LOCK_TABLE_FULL });
      expect(e.error.message).toContain("`max_locks_per_transaction`");
      expect(e.error.message).toContain(`= ${entries} entries`);
    }
    expect(
      warnings.filter((w) => w.includes("`max_locks_per_transaction`")).length,
    ).toBeGreaterThanOrEqual(2);
    // Nobody running was told to stop, and no attempt was burned: each job ran once, on its first attempt.
    expect(lost).toEqual([]);
    expect(executions.map((e) => e.n).sort((a, b) => a - b)).toEqual(
      Array.from({ length: 13 }, (_, n) => n),
    );
    expect(executions.filter((e) => e.attempts !== 1 || e.aborted)).toEqual([]);
    // Nothing is left locked: no job row (locked or not), no key held by the session. (The holder's unlock
    // may still be on its way when graphile-worker has completed its job: a quiet unlock is not waited for.)
    await waitFor(async () => locks.status().held.length === 0, {
      message: "the holder's key to be released",
      timeoutMs: 5000,
    }).catch(() => undefined);
    expect(locks.status().held).toEqual([]);
  });

  it("a request of several limits that meets the full table after taking a slot is left holding none", async () => {
    const { logger } = warningsLogger();
    const locks = newLocks({ logger, lockSessionWait: 1000 });
    const deferrals: Array<LocksEvents["job:deferred"]> = [];
    locks.events.on("job:deferred", (e) => deferrals.push(e));
    const ran: string[] = [];
    const task = locks.exclusive(
      "stacked_full",
      async (_p: unknown, helpers) => void ran.push(helpers.job.id),
      // Eight limits, more than the table has room for.
      { limits: Array.from({ length: 8 }, (_, i) => ({ key: () => "k", group: `full-${i}` })) },
    );
    const keys = Array.from({ length: 8 }, (_, i) => slotKeys(`full-${i}`, "k", 1)[0]!);
    await locks.connect();
    const pool = await openPool(2);
    await runner({ pgPool: await openPool(2), concurrency: 1, taskList: { stacked_full: task } });
    // (added before the table fills: an insert needs room of its own)
    await pool.query(
      "select graphile_worker.add_job('stacked_full', '{}'::json, run_at => now() + interval '2 seconds')",
    );
    const filler = await h.connect();
    // Room for four more locks: the job's first limits take them, the next meets the full table.
    await fillLockTable(filler, 4);
    await waitFor(async () => deferrals.length === 1, { message: "the job to go back" });
    expect(deferrals[0]!.error).toMatchObject({ code: ErrorCodes.LOCK_TABLE_FULL });
    const parts = keys.map(advisoryParts);
    const { rows } = await filler.query<{ n: number }>(
      `select count(*)::int as n from pg_locks l
         join unnest($1::oid[], $2::oid[]) as k(classid, objid) on l.classid = k.classid and l.objid = k.objid
         where l.locktype = 'advisory' and l.objsubid = 1`,
      [parts.map((p) => p.classid), parts.map((p) => p.objid)],
    );
    expect(rows[0]!.n).toBe(0);
    expect(ran).toEqual([]);
    await filler.end();
    await waitFor(async () => ran.length === 1, { message: "the job to run once there is room" });
    await waitFor(async () => locks.status().held.length === 0, {
      message: "its eight keys to be released",
    });
  });
});
