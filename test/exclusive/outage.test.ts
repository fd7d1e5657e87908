/**
 * An outage of the lock session never costs a job an attempt, and a job given back to the queue (parked or
 * deferred) leaves no row behind, whatever dies when. Real PostgreSQL, real runners, a TCP proxy in front of
 * the lock session that can be cut, and a worker in a separate process that is killed.
 */
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import pg from "pg";
import { describe, expect, inject, it } from "vitest";
import { InvalidArgumentError, lockKey, makeLocks } from "../../src/index.js";
import { withAdmin } from "../support/admin.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { readExecutions } from "../support/executions.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";
import { nextEvent, Timeline } from "../support/runner.js";
import { startProxy } from "../support/proxy.js";

const h = useExclusiveHarness("truncate test_executions, test_events");
const { db, cleanups, newLocks, runner, holdExternally } = h;

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * A TCP proxy in front of PostgreSQL that can be cut: every connection through it is reset, and new ones are
 * refused, until it is restored.
 */
async function cuttableProxy(): Promise<{ url: string; cut(): void; restore(): void }> {
  let down = false;
  const { url, sockets } = await startProxy(db.url, cleanups, (inbound, open) => {
    inbound.on("error", () => undefined);
    if (down) {
      inbound.destroy();
      return;
    }
    const outbound = open();
    outbound.on("error", () => undefined);
    inbound.pipe(outbound);
    outbound.pipe(inbound);
    inbound.on("close", () => outbound.destroy());
    outbound.on("close", () => inbound.destroy());
  });
  return {
    url,
    cut() {
      down = true;
      for (const socket of sockets) socket.destroy();
    },
    restore() {
      down = false;
    },
  };
}

async function jobCount(): Promise<number> {
  const { rows } = await db
    .pool()
    .query<{ n: number }>("select count(*)::int as n from graphile_worker._private_jobs");
  return rows[0]!.n;
}

/**
 * Replaces the wake that follows a park (`wake_if_free`) with `body` (plpgsql returning int) for this test,
 * keeping the real one aside.
 */
async function replaceWakeIfFree(body: string): Promise<void> {
  const pool = db.pool();
  await pool.query(
    "alter function graphile_worker_locks.wake_if_free(bigint[], bigint, bigint) rename to wake_if_free_real",
  );
  await pool.query(`create function graphile_worker_locks.wake_if_free(p_slots bigint[], p_key bigint,
      p_job_id bigint) returns int language plpgsql volatile as $$ begin ${body} end; $$`);
  cleanups.push(async () => {
    await pool.query(
      "select pg_terminate_backend(pid) from pg_stat_activity where query like '%wake_if_free%' and pid <> pg_backend_pid()",
    );
    await pool.query("drop function graphile_worker_locks.wake_if_free(bigint[], bigint, bigint)");
    await pool.query(
      "alter function graphile_worker_locks.wake_if_free_real(bigint[], bigint, bigint) rename to wake_if_free",
    );
  });
}

describe("an outage of the lock session", () => {
  it("costs no job an attempt: jobs wait for the session or go back to the queue, and all run once, locked", async () => {
    const proxy = await cuttableProxy();
    const locks = newLocks({
      lockConnectionString: proxy.url,
      lockSessionWait: 400,
      reconnectDelay: { min: 50, max: 200 },
    });
    const timeline = new Timeline();
    const ranIds: number[] = [];
    const errors: Array<{ code?: string; message: string }> = [];
    const deferred: string[] = [];
    locks.events.on("job:deferred", ({ job }) => deferred.push(job.id));
    type P = { id: number; k: string };
    const body = async (p: P, helpers: { job: { id: string; attempts: number } }) => {
      const end = timeline.begin(p.k, helpers.job.id, helpers.job.attempts);
      ranIds.push(p.id);
      await sleep(5);
      end();
    };
    const strategies = ["drop", "raise", "reschedule"] as const;
    const tasks = Object.fromEntries(
      strategies.map((s) => [
        `outage_${s}`,
        locks.exclusive(`outage_${s}`, body, {
          onConflict: s,
          key: (p: P) => ({ k: p.k }),
          reschedule: { minDelay: 10, maxDelay: 200 },
        }),
      ]),
    );
    const r = await runner({ connectionString: db.url, concurrency: 8, taskList: tasks });
    r.events.on("job:error", ({ error }) => errors.push(error as never));
    await locks.connect();

    // Jobs before, during and after a 1.5 s cut; every third one may be tried once only. Drop and raise jobs
    // have keys of their own (so that none is dropped or fails for a held key); reschedule jobs share few.
    let id = 0;
    const add = async (count: number) => {
      const specs = [];
      for (let i = 0; i < count; i++, id++) {
        const strategy = strategies[id % 3]!;
        const k = strategy === "reschedule" ? `r${id % 4}` : `${strategy}${id}`;
        specs.push(
          h.utils.addJob(`outage_${strategy}`, { id, k }, id % 3 === 0 ? { maxAttempts: 1 } : {}),
        );
      }
      await Promise.all(specs);
    };
    await add(30);
    const lost = nextEvent(locks, "lock:lost", undefined, 10_000).catch(() => null);
    proxy.cut();
    await add(30);
    await sleep(1500);
    proxy.restore();
    await add(30);
    await lost;

    await waitFor(async () => (await jobCount()) === 0 && ranIds.length >= 90, {
      timeoutMs: 60_000,
      message: "every job to run",
    });
    expect(errors.filter((e) => e.code === "GWL_LOCK_SESSION_UNAVAILABLE")).toEqual([]);
    expect(errors).toEqual([]);
    expect([...ranIds].sort((a, b) => a - b)).toEqual([...Array(90).keys()]);
    // Zero attempts burned: every execution is its job's first attempt (a deferred copy starts afresh).
    expect(timeline.executions.map((e) => e.attempts).filter((a) => a !== 1)).toEqual([]);
    expect(timeline.maxConcurrency()).toBe(1);
    // The jobs added during the cut met the outage, and those that outwaited lockSessionWait were deferred.
    expect(deferred.length).toBeGreaterThan(0);
  }, 90_000);

  it("a real outage of the database (every connection cut, none accepted for 1.3 s) costs no job an attempt", async () => {
    // As a server restart does to this file's database, without disturbing the other files' databases.
    const database = new URL(db.url).pathname.slice(1);
    // graphile-worker 0.18 leaves the rejection of a batch completion whose connection was cut unhandled
    // (the completion is lost: graphile-worker's behaviour, not this library's). Only those are let through.
    const vitestListeners = process.listeners("unhandledRejection");
    process.removeAllListeners("unhandledRejection");
    const lostCompletions: unknown[] = [];
    process.on("unhandledRejection", (reason, promise) => {
      const stack = String((reason as Error | undefined)?.stack ?? "");
      if (/completeJobs|failJobs/.test(stack)) lostCompletions.push(reason);
      else for (const listener of vitestListeners) listener(reason, promise);
    });
    cleanups.push(async () => {
      process.removeAllListeners("unhandledRejection");
      for (const listener of vitestListeners) process.on("unhandledRejection", listener);
    });
    const admin = (sql: string) => withAdmin(inject("baseUrl"), (client) => client.query(sql));
    cleanups.push(() => admin(`alter database "${database}" allow_connections true`));
    const locks = newLocks();
    const ran: Array<{ id: number; attempts: number }> = [];
    const sessionErrors: unknown[] = [];
    const task = locks.exclusive(
      "restart",
      async (p: { id: number }, helpers) => {
        ran.push({ id: p.id, attempts: helpers.job.attempts });
        await sleep(20);
      },
      { key: (p: { id: number }) => ({ id: p.id }) },
    );
    const r = await runner({
      connectionString: db.url,
      concurrency: 4,
      taskList: { restart: task },
    });
    r.events.on("job:error", ({ error }) => {
      if ((error as { code?: string }).code === "GWL_LOCK_SESSION_UNAVAILABLE")
        sessionErrors.push(error);
    });
    await locks.connect();
    const count = 200;
    await h.utils.addJobs(
      [...Array(count).keys()].map((id) => ({
        identifier: "restart",
        payload: { id },
        maxAttempts: id % 2 === 0 ? 1 : 25,
      })),
    );
    await waitFor(async () => ran.length >= 10, { message: "jobs to start" });
    await admin(`alter database "${database}" allow_connections false`);
    await admin(
      `select pg_terminate_backend(pid) from pg_stat_activity where datname = '${database}'`,
    );
    await sleep(1300);
    await admin(`alter database "${database}" allow_connections true`);
    await waitFor(async () => new Set(ran.map((x) => x.id)).size === count, {
      timeoutMs: 60_000,
      message: "every job to run",
    });
    expect(sessionErrors).toEqual([]);
    expect(ran.filter((x) => x.attempts !== 1)).toEqual([]);
  }, 90_000);

  it("a job that outwaits lockSessionWait goes back to the queue and runs as soon as the session is back", async () => {
    const proxy = await cuttableProxy();
    const locks = newLocks({
      lockConnectionString: proxy.url,
      lockSessionWait: 100,
      reconnectDelay: { min: 50, max: 100 },
    });
    const ran: Array<{ id: string; attempts: number; at: number }> = [];
    const task = locks.exclusive("once", async (_p: unknown, helpers) => {
      ran.push({ id: helpers.job.id, attempts: helpers.job.attempts, at: Date.now() });
    });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { once: task } });
    await locks.connect();
    proxy.cut();
    const deferredEvent = nextEvent(locks, "job:deferred");
    const { job } = await task.addJob({}, { maxAttempts: 1 });
    const event = await deferredEvent;
    expect(event.job.id).toBe(job!.id);
    expect(event.error).toMatchObject({ code: "GWL_LOCK_SESSION_UNAVAILABLE" });
    // (the copy's run_at is its safety net, well after the restore below)
    expect(event.runAt.getTime()).toBeGreaterThanOrEqual(Date.now() + 500);
    expect(ran).toEqual([]);
    const restoredAt = Date.now();
    proxy.restore();
    await waitFor(async () => ran.length === 1 && (await jobCount()) === 0, {
      message: "the copy to run",
    });
    expect(ran[0]).toMatchObject({ id: event.newJobId, attempts: 1 });
    expect(ran[0]!.at).toBeLessThan(event.runAt.getTime());
    expect(ran[0]!.at).toBeGreaterThanOrEqual(restoredAt);
  });

  it("a give-back whose answer is lost is asked again, never followed by a run: the job runs once, as its copy", async () => {
    const lockProxy = await cuttableProxy();
    // graphile-worker's pool goes through a proxy that lets the first give-back (defer_job) reach PostgreSQL,
    // which commits it, and then cuts that connection instead of passing the answer on.
    const swallowed = deferred();
    let armed = true;
    const { url: poolUrl } = await startProxy(db.url, cleanups, (inbound, open) => {
      inbound.on("error", () => undefined);
      const outbound = open();
      outbound.on("error", () => undefined);
      let cutAnswer = false;
      inbound.on("data", (chunk: Buffer) => {
        if (armed && chunk.includes("defer_job")) {
          armed = false;
          cutAnswer = true;
        }
        outbound.write(chunk);
      });
      outbound.on("data", (chunk: Buffer) => {
        if (!cutAnswer) {
          inbound.write(chunk);
          return;
        }
        inbound.destroy();
        outbound.destroy();
        swallowed.resolve();
      });
      inbound.on("close", () => outbound.destroy());
      outbound.on("close", () => inbound.destroy());
    });
    const locks = newLocks({
      lockConnectionString: lockProxy.url,
      lockSessionWait: 100,
      reconnectDelay: { min: 50, max: 100 },
    });
    const ran: string[] = [];
    const task = locks.exclusive("given_back_once", async (_p: unknown, helpers) => {
      ran.push(helpers.job.id);
    });
    const pool = new pg.Pool({ connectionString: poolUrl, max: 4 });
    pool.on("error", () => undefined);
    pool.on("connect", (client) => client.on("error", () => undefined));
    cleanups.push(() => pool.end());
    const r = await runner({ pgPool: pool, concurrency: 1, taskList: { given_back_once: task } });
    const errors: unknown[] = [];
    r.events.on("job:error", ({ error }) => errors.push(error));
    await locks.connect();
    lockProxy.cut();
    const given: Array<{ jobId: string; newJobId: string }> = [];
    locks.events.on("job:deferred", ({ job, newJobId }) => given.push({ jobId: job.id, newJobId }));
    const { job } = await task.addJob({});
    await swallowed.promise;
    // The session is back while the job does not know whether it was given back.
    lockProxy.restore();
    await waitFor(async () => ran.length >= 1 && (await jobCount()) === 0, {
      message: "every row to go",
    });
    await sleep(300);
    // One run, of the copy: the job itself did not run beside it.
    expect(ran).toHaveLength(1);
    expect(ran).not.toContain(job!.id);
    expect(given).toEqual([{ jobId: job!.id, newJobId: ran[0] }]);
    expect(errors).toEqual([]);
  });

  it("a job given back while the session reconnects, then the session refused for good: the process stays responsive", async () => {
    // In a process of its own (test/fixtures/refused-after-give-back.ts): a process that stopped answering
    // would stop this one's timers too.
    const child = spawn(
      process.execPath,
      [
        "--import",
        "tsx",
        fileURLToPath(new URL("../fixtures/refused-after-give-back.ts", import.meta.url)),
      ],
      { env: { ...process.env, DATABASE_URL: db.url }, stdio: ["ignore", "pipe", "pipe"] },
    );
    let output = "";
    child.stdout.on("data", (chunk: Buffer) => (output += chunk.toString()));
    child.stderr.on("data", (chunk: Buffer) => (output += chunk.toString()));
    const exited = new Promise<number | null>((resolve) => child.once("exit", resolve));
    const timer = setTimeout(() => child.kill("SIGKILL"), 30_000);
    const code = await exited;
    clearTimeout(timer);
    const lines = output.split("\n").filter((line) => /^(deferred|refused|tick|done)$/.test(line));
    expect(lines, output).toEqual(["deferred", "refused", ...Array(10).fill("tick"), "done"]);
    expect(code).toBe(0);
  }, 60_000);

  it("while the session is down no job runs unlocked: it waits for the reconnection and runs on its first attempt", async () => {
    const locks = newLocks({ reconnectDelay: { min: 1500, max: 1500 }, lockSessionWait: 10_000 });
    const ran: Array<{ id: number; attempts: number; at: number }> = [];
    let holding = true;
    const task = locks.exclusive("down", async (p: { id: number; hold?: boolean }, helpers) => {
      ran.push({ id: p.id, attempts: helpers.job.attempts, at: Date.now() });
      while (p.hold && holding && !helpers.abortSignal?.aborted) await sleep(10);
    });
    const r = await runner({ connectionString: db.url, concurrency: 2, taskList: { down: task } });
    cleanups.push(async () => void (holding = false)); // (runs before the runner's stop)
    const errors: unknown[] = [];
    r.events.on("job:error", ({ error }) => errors.push(error));
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({ id: 1, hold: true });
    await acquired;
    const lost = nextEvent(locks, "lock:lost");
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [locks.status().pid]);
    expect((await lost).holds).toHaveLength(1);
    // The session reconnects in 0.75 to 1.5 s; a job that starts meanwhile waits for it.
    await task.addJob({ id: 2 });
    await reconnected;
    const reconnectedAt = Date.now();
    await waitFor(async () => ran.length === 2, { message: "the second job to run" });
    expect(ran[1]).toMatchObject({ id: 2, attempts: 1 });
    expect(ran[1]!.at).toBeGreaterThanOrEqual(reconnectedAt);
    expect(errors).toEqual([]);
    holding = false;
  });

  it("a job whose lock session is lost after it took its key but before its task started does not start on the freed key: it takes the key again", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 100 } });
    // At body entry: whether the job's signal had already aborted, and the backend that held its key then.
    const entries: Array<{ aborted: boolean; holder: number | null; session: number | null }> = [];
    let key = 0n;
    const task = locks.exclusive(
      "late_start",
      async (_p: Record<string, never>, helpers) => {
        const aborted = helpers.abortSignal?.aborted ?? false;
        const { rows } = await db
          .pool()
          .query<{ pid: number }>(
            "select pid from graphile_worker_locks.held_locks where lock_key = $1",
            [key.toString()],
          );
        entries.push({ aborted, holder: rows[0]?.pid ?? null, session: locks.status().pid });
      },
      // (`pausable`: the start asks the database whether the key is paused, on a pool connection: a test can
      // hold that question up after the key was taken)
      { pausable: true },
    );
    key = task.lockKey({});
    const r = await runner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { late_start: task },
    });
    const errors: unknown[] = [];
    r.events.on("job:error", ({ error }) => errors.push(error));
    // The pause check waits on a lock of the pauses table, taken here, while the job holds its key.
    const blocker = await h.connect();
    await blocker.query("begin");
    await blocker.query("lock table graphile_worker_locks.pauses in access exclusive mode");
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    await waitFor(
      async () =>
        (
          await db
            .pool()
            .query(
              "select 1 from pg_stat_activity where wait_event_type = 'Lock' and query like '%rate_admit%'",
            )
        ).rowCount === 1,
      { message: "the pause check to wait" },
    );
    const lost = nextEvent(locks, "lock:lost");
    await db.pool().query("select pg_terminate_backend($1)", [locks.status().pid]);
    expect((await lost).holds).toHaveLength(1);
    await blocker.query("commit");
    await waitFor(async () => entries.length > 0, { message: "the job to start" });
    // It started on the session that replaced the lost one, holding its key there, its signal not aborted.
    expect(entries).toHaveLength(1);
    expect(entries[0]!.aborted).toBe(false);
    expect(entries[0]!.holder).not.toBeNull();
    expect(entries[0]!.holder).toBe(entries[0]!.session);
    expect(errors).toEqual([]);
  });

  it("refuses a negative lockSessionWait", () => {
    expect(() => makeLocks({ connectionString: db.url, lockSessionWait: -1 })).toThrow(
      InvalidArgumentError,
    );
    expect(() => makeLocks({ connectionString: db.url, lockSessionWait: -1 })).toThrow(
      /`lockSessionWait`/,
    );
  });
});

describe("a parked job leaves no row behind", () => {
  it("when the wake after the park meets a dead connection, the job does not fail and its copy runs once", async () => {
    const locks = newLocks();
    const ran: string[] = [];
    const task = locks.exclusive(
      "wake_dies",
      async (_p: unknown, helpers) => void ran.push(helpers.job.id),
      { onConflict: "reschedule", reschedule: { minDelay: 10, maxDelay: 500 } },
    );
    const held = await holdExternally(task.lockKey({}));
    await replaceWakeIfFree("perform pg_terminate_backend(pg_backend_pid()); return 0;");
    const r = await runner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { wake_dies: task },
    });
    const failures: string[] = [];
    r.events.on("job:error", ({ error }) => failures.push(String(error)));
    const rescheduled = nextEvent(locks, "job:rescheduled");
    const { job } = await task.addJob({});
    const { newJobId } = await rescheduled;
    await held.release();
    await waitFor(async () => ran.length === 1 && (await jobCount()) === 0, {
      message: "the copy to run and every row to go",
    });
    expect(ran).toEqual([newJobId]);
    expect(ran).not.toContain(job!.id);
    expect(failures).toEqual([]);
  });

  it("when the process dies after the park committed, the next connection deletes the row; the copy runs once", async () => {
    const held = await holdExternally(lockKey("exec", { k: "a" }));
    // The wake after the park hangs: the process is killed between the park's commit and the completion.
    await replaceWakeIfFree("perform pg_sleep(60); return 0;");
    const workers: WorkerProcess[] = [];
    cleanups.push(async () => {
      for (const w of workers) {
        w.child.kill("SIGKILL");
        await w.exited;
      }
    });
    const first = await startWorkerProcess(db.url, {
      name: "doomed",
      strategy: "reschedule",
      concurrency: 1,
    });
    workers.push(first);
    const job = await h.utils.addJob("exec", { k: "a" });
    await waitFor(async () => (await jobCount()) === 2, { message: "the park to commit" });
    first.child.kill("SIGKILL");
    await first.exited;
    // The original row: given up (no retries, no key), locked by a worker that is gone.
    const original = await db
      .pool()
      .query<{ locked_by: string | null; attempts: number; max_attempts: number }>(
        "select locked_by, attempts, max_attempts from graphile_worker._private_jobs where id = $1",
        [job.id],
      );
    expect(original.rows[0]).toMatchObject({ attempts: 25, max_attempts: 25 });
    expect(original.rows[0]!.locked_by).not.toBeNull();

    const locks = newLocks();
    const cleaned = nextEvent(locks, "givenBack:cleaned");
    await locks.connect();
    expect((await cleaned).jobIds).toEqual([job.id]);
    await held.release();
    workers.push(
      await startWorkerProcess(db.url, { name: "heir", strategy: "reschedule", concurrency: 1 }),
    );
    await waitFor(async () => (await jobCount()) === 0, {
      timeoutMs: 20_000,
      message: "the copy to run and every row to go",
    });
    const executions = await readExecutions(db.pool());
    expect(executions.map((e) => e.worker)).toEqual(["heir"]);
    expect(executions[0]!.jobId).not.toBe(job.id);
    await workers[1]!.stop();
  }, 60_000);
});
