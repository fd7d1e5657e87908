/**
 * The lock session's loss and reconnection: holders abort, nothing runs unlocked, a late release frees
 * nothing.
 * Real PostgreSQL, real graphile-worker runners, separate connections.
 */
import type net from "node:net";
import { describe, expect, it } from "vitest";
import { lockKey } from "../../src/index.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent, startRunner, warningsLogger } from "../support/runner.js";
import { startProxy } from "../support/proxy.js";
import { startProxy as startFreezableProxy } from "../../scripts/soak/proxy.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

describe("lock loss", () => {
  it("pg_terminate_backend of the lock session: abort fires, lock:lost, reconnect, and a late release frees nothing", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 200 } });
    const aborted = deferred<unknown>();
    const finishA = deferred();
    const finishB = deferred();
    const startedB = deferred<boolean>();
    const task = locks.exclusive(
      "victim",
      async (p: { k: string; role: string }, helpers) => {
        if (p.role === "A") {
          helpers.abortSignal!.addEventListener("abort", () =>
            aborted.resolve(helpers.abortSignal!.reason),
          );
          await finishA.promise; // ignores the abort for a while: its release comes late
        } else {
          // A job of the new connection gets a live signal (the old connection's one has aborted).
          startedB.resolve(helpers.abortSignal!.aborted);
          await finishB.promise;
        }
      },
      { key: (p) => p.k },
    );
    await runner({ connectionString: db.url, concurrency: 3, taskList: { victim: task } });
    const lost = nextEvent(locks, "lock:lost");
    const acquiredA = nextEvent(locks, "lock:acquired");
    await task.addJob({ k: "k", role: "A" });
    await acquiredA;
    const oldPid = locks.status().pid!;
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [oldPid]);

    const reason = (await aborted.promise) as { code?: string };
    expect(reason.code).toBe("GWL_LOCK_LOST");
    const lostEvent = await lost;
    expect(lostEvent.holds.map((h) => h.taskIdentifier)).toEqual(["victim"]);
    await reconnected;
    const newPid = locks.status().pid!;
    expect(newPid).not.toBe(oldPid);

    // B takes the same key on the new session while A is still running.
    await task.addJob({ k: "k", role: "B" });
    expect(await startedB.promise).toBe(false);
    const releasedA = nextEvent(locks, "lock:released", (e) => e.outcome === "lost");
    finishA.resolve();
    await releasedA;
    const held = await locks.heldLocks();
    expect(held.filter((h) => h.lockKey === lockKey("victim", "k")).map((h) => h.pid)).toEqual([
      newPid,
    ]);
    expect(await task.lockAvailable({ k: "k", role: "" })).toBe(false);
    finishB.resolve();
    await waitFor(() => task.lockAvailable({ k: "k", role: "" }), { message: "B to release" });
  });

  it("a termination read with the connect's last answer fails that connect: never a ready session on a dead backend", async () => {
    // The proxy holds back the answer to the connect's last statement (its backend pid, after LISTEN) until
    // that backend was terminated, then passes the answer and the termination on in one packet, and keeps
    // the socket open (the FIN is lost, as on a network that drops it).
    let armed = true;
    const { url } = await startProxy(db.url, cleanups, (inbound, open) => {
      const outbound = open();
      for (const socket of [inbound, outbound]) socket.on("error", () => undefined);
      let listened = false;
      let holding: Buffer[] | null = null;
      inbound.on("data", (chunk: Buffer) => {
        if (armed && chunk.includes("listen ")) listened = true;
        else if (armed && listened && chunk.includes("pg_backend_pid")) {
          armed = false;
          holding = [];
          void db
            .pool()
            .query(
              "select pg_terminate_backend(pid) from pg_stat_activity where application_name = 'gwl-connect-race'",
            );
        }
        outbound.write(chunk);
      });
      outbound.on("data", (chunk: Buffer) => {
        if (holding) holding.push(chunk);
        else inbound.write(chunk);
      });
      // (the server's side may end with a FIN or, with bytes it did not read, a reset)
      let ended = false;
      const serverGone = () => {
        if (ended) return;
        ended = true;
        if (holding) inbound.write(Buffer.concat(holding));
        else inbound.end();
      };
      outbound.on("end", serverGone);
      outbound.on("close", serverGone);
      inbound.on("close", () => outbound.destroy());
    });
    const locks = newLocks({
      lockConnectionString: url,
      applicationName: "gwl-connect-race",
      reconnectDelay: { min: 50, max: 100 },
    });
    const connected = nextEvent(locks, "session:connected");
    locks.connect().catch(() => undefined);
    const { pid } = await connected;
    const { rows } = await db
      .pool()
      .query<{ alive: boolean }>(
        "select exists (select 1 from pg_stat_activity where pid = $1) as alive",
        [pid],
      );
    expect(armed).toBe(false);
    expect(rows[0]!.alive, `the session reported ready on backend ${pid}, which is gone`).toBe(
      true,
    );
  });

  it("a connect that stalls (the network silent after LISTEN) is cut after heartbeatTimeout and tried again", async () => {
    // The proxy passes the first connection's bytes until LISTEN, then nothing more from the server (the
    // socket stays open, as on a network that drops packets).
    let stalled = false;
    const { url } = await startProxy(db.url, cleanups, (inbound, open) => {
      const outbound = open();
      for (const socket of [inbound, outbound]) socket.on("error", () => undefined);
      const first = !stalled;
      let silent = false;
      inbound.on("data", (chunk: Buffer) => {
        if (first && chunk.includes("listen ")) silent = stalled = true;
        outbound.write(chunk);
      });
      outbound.on("data", (chunk: Buffer) => {
        if (!silent) inbound.write(chunk);
      });
      inbound.on("close", () => outbound.destroy());
      outbound.on("close", () => inbound.destroy());
    });
    const locks = newLocks({
      lockConnectionString: url,
      heartbeatInterval: 200,
      heartbeatTimeout: 1000,
      reconnectDelay: { min: 50, max: 100 },
    });
    const connected = nextEvent(locks, "session:connected");
    locks.connect().catch(() => undefined);
    const { pid } = await connected;
    expect(stalled).toBe(true);
    const { rows } = await db
      .pool()
      .query<{ alive: boolean }>(
        "select exists (select 1 from pg_stat_activity where pid = $1) as alive",
        [pid],
      );
    expect(rows[0]!.alive).toBe(true);
  });

  it("a loss noticed only after a job returned is reported on that job: lock:lost with returned, and a warning naming it", async () => {
    const proxy = await startFreezableProxy(Number(new URL(db.url).port || 5432));
    cleanups.push(() => proxy.close());
    const proxied = new URL(db.url);
    proxied.hostname = "127.0.0.1";
    proxied.port = String(proxy.port);
    const { logger, warnings } = warningsLogger();
    const locks = newLocks({
      lockConnectionString: proxied.toString(),
      logger,
      heartbeatInterval: 60_000,
      reconnectDelay: { min: 50, max: 100 },
    });
    const gate = deferred();
    cleanups.push(async () => gate.resolve());
    const returned = deferred<string>();
    let abortedWhileRunning = false;
    const task = locks.exclusive("returns_first", async (_p: unknown, helpers) => {
      await gate.promise;
      abortedWhileRunning = helpers.abortSignal!.aborted;
      returned.resolve(helpers.job.id);
    });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { returns_first: task } });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    // The backend ends (PostgreSQL frees the key) while the process hears nothing of it; the job returns.
    const pid = locks.status().pid!;
    const lost = nextEvent(locks, "lock:lost");
    proxy.freeze();
    await db.pool().query("select pg_terminate_backend($1)", [pid]);
    const other = await h.holdExternally(task.lockKey({}));
    gate.resolve();
    const jobId = await returned.promise;
    expect(abortedWhileRunning).toBe(false);
    await other.release();
    proxy.thaw();
    const event = await lost;
    expect(event.holds).toEqual([
      { taskIdentifier: "returns_first", lockKey: task.lockKey({}), jobId, returned: true },
    ]);
    expect(
      warnings.filter((w) => w.includes(`job ${jobId} `) && w.includes("returned before")),
    ).toHaveLength(1);
  });

  it("an idle lock session whose backend is terminated notices at once, not at its next heartbeat", async () => {
    const locks = newLocks({ heartbeatInterval: 600_000, reconnectDelay: { min: 50, max: 100 } });
    await locks.connect();
    const pid = locks.status().pid!;
    // (nextEvent gives up after 20 s, long before a heartbeat would run)
    const lost = nextEvent(locks, "lock:lost");
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [pid]);
    expect((await lost).holds).toEqual([]);
    expect((await reconnected).pid).not.toBe(pid);
  });

  it("the same worker's next job after a reconnection gets a live abort signal", async () => {
    const locks = newLocks({ reconnectDelay: { min: 50, max: 200 } });
    const seen: Array<{ id: number; aborted: boolean }> = [];
    const release = deferred();
    const task = locks.exclusive("one_worker", async (p: { id: number }, helpers) => {
      const signal = helpers.abortSignal!;
      if (p.id === 1)
        await Promise.race([
          release.promise,
          new Promise((r) => signal.addEventListener("abort", r)),
        ]);
      seen.push({ id: p.id, aborted: signal.aborted });
    });
    // One worker: job 2 runs where job 1 ran, after the connection job 1 held its lock on was lost.
    await runner({ connectionString: db.url, concurrency: 1, taskList: { one_worker: task } });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({ id: 1 });
    await acquired;
    const reconnected = nextEvent(locks, "session:connected");
    await db.pool().query("select pg_terminate_backend($1)", [locks.status().pid]);
    await reconnected;
    await task.addJob({ id: 2 });
    await waitFor(async () => seen.length === 2, { message: "both jobs to run" });
    expect(seen).toEqual([
      { id: 1, aborted: true },
      { id: 2, aborted: false },
    ]);
    release.resolve();
  });

  it("a connection that goes silent (no reset, no answer) is given up after heartbeatTimeout: holders abort", async () => {
    // A TCP proxy in front of PostgreSQL whose connections can be frozen: bytes stop flowing both ways,
    // nothing is closed, as when a network drops packets.
    const frozen = new Set<net.Socket>();
    const { url: proxied, sockets } = await startProxy(db.url, cleanups, (inbound, open) => {
      const outbound = open();
      for (const [from, to] of [
        [inbound, outbound],
        [outbound, inbound],
      ] as const) {
        from.on("error", () => undefined);
        from.on("data", (chunk) => {
          if (!frozen.has(inbound)) to.write(chunk);
        });
        // (a frozen connection does not pass its close on either: the network is gone, not the peer)
        from.on("close", () => {
          if (!frozen.has(inbound)) to.destroy();
        });
      }
    });

    const locks = newLocks({
      lockConnectionString: proxied,
      // (generous enough that a test machine busy with the other test files is not taken for a dead one)
      heartbeatInterval: 200,
      heartbeatTimeout: 2000,
      reconnectDelay: { min: 50, max: 100 },
    });
    const aborted = deferred<{ code?: string }>();
    const task = locks.exclusive("silent", async (_p, helpers) => {
      const signal = helpers.abortSignal!;
      await new Promise<void>((resolve) =>
        signal.addEventListener("abort", () => {
          aborted.resolve(signal.reason as { code?: string });
          resolve();
        }),
      );
    });
    await runner({ connectionString: db.url, concurrency: 1, taskList: { silent: task } });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    const oldPid = locks.status().pid!;
    const lost = nextEvent(locks, "lock:lost");
    const reconnected = nextEvent(locks, "session:connected");
    for (const socket of sockets) frozen.add(socket);

    expect((await aborted.promise).code).toBe("GWL_LOCK_LOST");
    expect((await lost).error.message).toMatch(/heartbeat|unanswered/);
    // The old backend never heard of it and still holds the key: another job of the key cannot start
    // until PostgreSQL ends that backend (here by hand; in life, its own keepalive or a DBA).
    expect(await task.lockAvailable({})).toBe(false);
    await db.pool().query("select pg_terminate_backend($1)", [oldPid]);
    await reconnected;
    expect(locks.status().pid).not.toBe(oldPid);
    await waitFor(() => task.lockAvailable({}), { message: "the old backend's lock to go" });
  });

  it("graphile-worker's own shutdown abort reaches the task through the combined signal", async () => {
    const locks = newLocks();
    const aborted = deferred<void>();
    const task = locks.exclusive("shutdown", async (_p, helpers) => {
      await new Promise<void>((resolve) =>
        helpers.abortSignal!.addEventListener("abort", () => resolve()),
      );
      aborted.resolve();
    });
    const r = await startRunner({
      connectionString: db.url,
      concurrency: 1,
      taskList: { shutdown: task },
      preset: { worker: { gracefulShutdownAbortTimeout: 100 } },
    });
    const acquired = nextEvent(locks, "lock:acquired");
    await task.addJob({});
    await acquired;
    await Promise.all([r.stop(), aborted.promise]);
    await waitFor(async () => locks.status().held.length === 0, { message: "the release" });
  });
});
