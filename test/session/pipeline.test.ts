/**
 * The lock session pipelines its statements: a lock request made while an earlier lock statement is still
 * unanswered leaves at once, in a statement of its own, instead of waiting a round trip for that answer;
 * an unlock nobody waits for leaves at once on an idle connection (with lock-ahead in use, after up to 2 ms
 * waiting for a statement to ride) and otherwise waits for a statement to ride with. Real PostgreSQL and a
 * real runner; the lock session connects through a TCP proxy that, once it is connected, delays every answer
 * by DELAY_MS, so that a statement's round trip is long enough to see what is sent during it.
 */
import { afterEach, describe, expect, it } from "vitest";
import { setTimingProbe } from "../../src/session/timing-probe.js";
import { deferred } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent } from "../support/runner.js";
import { startProxy } from "../support/proxy.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

/** How long the proxy holds every chunk from PostgreSQL to the client. */
const DELAY_MS = 250;

/**
 * A TCP proxy in front of PostgreSQL that, once `slow()` was called, delays what the server sends by
 * `delayMs` (in order). Before, it passes everything at once: a session connects at full speed.
 */
async function slowProxy(delayMs: number): Promise<{ url: string; slow(): void }> {
  let delay = 0;
  const { url } = await startProxy(db.url, cleanups, (inbound, open) => {
    const outbound = open();
    inbound.pipe(outbound);
    outbound.on("data", (chunk: Buffer) => {
      if (delay === 0) inbound.write(chunk);
      else
        setTimeout(() => {
          if (!inbound.destroyed) inbound.write(chunk);
        }, delay);
    });
    const close = () => {
      inbound.destroy();
      outbound.destroy();
    };
    inbound.on("error", close).on("close", close);
    outbound.on("error", close).on("close", () => setTimeout(close, delay));
  });
  return { url, slow: () => void (delay = delayMs) };
}

afterEach(() => setTimingProbe(null));

/** When a probed request was queued, its statement sent, and the answer read (`performance.now()`). */
interface Timing {
  queuedAt: number;
  sentAt: number;
  answeredAt: number;
}

/**
 * A `raise` task keyed by `k` running `body`, on a lock session behind the slow proxy and a runner of
 * `concurrency`, whose lock and unlock requests are recorded (in the order of their answers); `allRan`
 * resolves once jobs of `count` distinct keys ran. `lockAhead`: the runner has a local queue and is given
 * to `locks.attach`.
 */
async function pipelinedTask(
  identifier: string,
  concurrency: number,
  count: number,
  body: (k: string) => unknown = () => undefined,
  lockAhead = false,
) {
  const proxy = await slowProxy(DELAY_MS);
  const locks = newLocks({ lockConnectionString: proxy.url });
  await locks.connect();
  proxy.slow();
  const requests: Timing[] = [];
  const unlocks: Timing[] = [];
  setTimingProbe({
    lock: (queuedAt, sentAt, answeredAt) => requests.push({ queuedAt, sentAt, answeredAt }),
    unlock: (queuedAt, sentAt, answeredAt) => unlocks.push({ queuedAt, sentAt, answeredAt }),
  });
  const ran = new Set<string>();
  const allRan = deferred();
  const task = locks.exclusive(
    identifier,
    async (p: { k: string }) => {
      await body(p.k);
      ran.add(p.k);
      if (ran.size === count) allRan.resolve();
    },
    { key: (p) => p.k, onConflict: "raise" },
  );
  const r = await runner({
    connectionString: db.url,
    concurrency,
    taskList: { [identifier]: task },
    ...(lockAhead ? { preset: { worker: { localQueue: { size: 5 } } } } : {}),
  });
  if (lockAhead) locks.attach(r);
  return { locks, task, r, requests, unlocks, ran, allRan: allRan.promise };
}

/**
 * Counts the lock statements sent from now on (by any client: only the lock session sends them), and
 * resolves `reached(n)` once n were sent. `markReturn()`, called as a task's body returns, records the count
 * then (`atReturn`) and when the first timer of the event loop fires after it (`atFirstTimer`).
 */
function countLockStatements() {
  const waiting: Array<{ n: number; resolve(): void }> = [];
  const counter = {
    sent: 0,
    atReturn: -1,
    atFirstTimer: -1,
    reached: (n: number) =>
      new Promise<void>((resolve) => {
        if (counter.sent >= n) resolve();
        else waiting.push({ n, resolve });
      }),
    markReturn: () => {
      counter.atReturn = counter.sent;
      setTimeout(() => (counter.atFirstTimer = counter.sent), 0);
    },
  };
  h.watchLockStatements(() => {
    counter.sent++;
    for (const w of waiting) if (counter.sent >= w.n) w.resolve();
  });
  return counter;
}

describe("pipelined lock statements", () => {
  it("a lock request made while another lock statement is unanswered is sent before that answer", async () => {
    const { locks, task, r, requests, ran, allRan } = await pipelinedTask("pipelined", 2, 2);
    // B is enqueued as A's job starts: a worker fetches it while A's lock statement is still unanswered.
    const startedA = new Promise<void>((resolve) =>
      r.events.once("job:start", () => {
        void task.addJob({ k: "b" }).then(() => resolve());
      }),
    );
    const released = nextEvent(
      locks,
      "lock:released",
      (e) => (e.job.payload as { k: string }).k === "b",
    );
    await task.addJob({ k: "a" });
    await startedA;
    await allRan;
    await released;

    expect(ran).toEqual(new Set(["a", "b"]));
    expect(requests).toHaveLength(2);
    const [first, second] = requests as [(typeof requests)[0], (typeof requests)[0]];
    // Both statements were in flight at once: the second left before the first was answered.
    expect(second.queuedAt).toBeLessThan(first.answeredAt);
    expect(second.sentAt).toBeLessThan(first.answeredAt);
    expect(first.answeredAt - first.sentAt).toBeGreaterThanOrEqual(DELAY_MS - 1);
  });

  it("up to four lock statements are in flight at once: no request waits for an answer while fewer are", async () => {
    const { task, r, requests, allRan } = await pipelinedTask("pipelined4", 4, 4);
    // B, C and D are enqueued as A's job starts: idle workers fetch them while A's lock statement is still
    // unanswered, each on its own turn of the event loop.
    const added = new Promise<void>((resolve) =>
      r.events.once("job:start", () => {
        void Promise.all(["b", "c", "d"].map((k) => task.addJob({ k }))).then(() => resolve());
      }),
    );
    await task.addJob({ k: "a" });
    await added;
    await allRan;

    expect(requests).toHaveLength(4);
    const first = requests.reduce((a, b) => (b.sentAt < a.sentAt ? b : a));
    // With two in flight, the fourth request (or the third) would have waited for the first answer.
    for (const request of requests) expect(request.sentAt).toBeLessThan(first.answeredAt);
    expect(new Set(requests.map((q) => q.sentAt)).size).toBeGreaterThanOrEqual(3);
  });

  it("an unlock nobody waits for leaves at once on an idle connection, and rides or follows a statement in flight", async () => {
    const statements = countLockStatements();
    const { task, requests, unlocks, allRan } = await pipelinedTask(
      "quietUnlocks",
      2,
      3,
      async (k) => {
        if (k === "a") {
          // A returns once B's lock statement is on its way: A's unlock is queued while it is in flight.
          await task.addJob({ k: "b" });
          await statements.reached(2);
        } else if (k === "c") {
          // C runs alone: its unlock must leave before the first timer of the event loop fires.
          statements.markReturn();
        }
      },
    );
    await task.addJob({ k: "a" });
    await expect.poll(() => unlocks.length, { timeout: 10_000 }).toBe(2);
    await task.addJob({ k: "c" });
    await allRan;
    await expect.poll(() => statements.atFirstTimer, { timeout: 10_000 }).toBeGreaterThanOrEqual(0);
    await expect.poll(() => unlocks.length, { timeout: 10_000 }).toBe(3);

    expect(requests).toHaveLength(3);
    const lockB = requests[1]!;
    const unlockA = unlocks.reduce((x, y) => (y.queuedAt < x.queuedAt ? y : x));
    // A's unlock was queued while B's lock statement was in flight, and waited for its answer instead of
    // going alone ahead of it.
    expect(unlockA.queuedAt).toBeGreaterThan(lockB.sentAt);
    expect(unlockA.queuedAt).toBeLessThan(lockB.answeredAt);
    expect(unlockA.sentAt).toBeGreaterThanOrEqual(lockB.answeredAt);
    // On the idle connection, C's unlock left within the same turn, in a statement of its own.
    expect(statements.atFirstTimer).toBe(statements.atReturn + 1);
    const unlockC = unlocks.reduce((x, y) => (y.queuedAt > x.queuedAt ? y : x));
    expect(unlockC.sentAt - unlockC.queuedAt).toBeLessThan(DELAY_MS);
  });

  it("with lock-ahead in use, an unlock nobody waits for waits on an idle connection for a statement to ride, 2 ms at most", async () => {
    const statements = countLockStatements();
    const { task, requests, unlocks, allRan } = await pipelinedTask(
      "quietUnlocksAhead",
      1,
      1,
      () => statements.markReturn(),
      true,
    );
    await task.addJob({ k: "a" });
    await allRan;
    await expect.poll(() => statements.atFirstTimer, { timeout: 10_000 }).toBeGreaterThanOrEqual(0);
    await expect.poll(() => unlocks.length, { timeout: 10_000 }).toBe(1);

    // The lock was taken ahead, when the local queue fetched the job.
    expect(requests).toHaveLength(1);
    // Nothing was sent as the job returned, nor before the first timer of the event loop fired...
    expect(statements.atFirstTimer).toBe(statements.atReturn);
    // ...and with no lock statement coming, the unlock left alone once the hold was over. (Node's timers
    // count from the event loop's cached clock, so the hold may end up to about a millisecond early.)
    expect(statements.sent).toBe(statements.atReturn + 1);
    const [unlock] = unlocks as [Timing];
    expect(unlock.sentAt - unlock.queuedAt).toBeLessThan(DELAY_MS);
  });

  it("an unlock still waiting for a statement to ride when the Locks instance is released is answered as released", async () => {
    const { locks, task, r, unlocks } = await pipelinedTask(
      "quietUnlocksClose",
      1,
      1,
      () => undefined,
      true,
    );
    const released = nextEvent(locks, "lock:released");
    // As the job succeeds its unlock is queued (its task has returned) and waits for a statement to ride.
    const closed = new Promise<void>((resolve, reject) =>
      r.events.once("job:success", () => {
        locks.release().then(resolve, reject);
      }),
    );
    await task.addJob({ k: "a" });
    await closed;

    const { outcome } = await released;
    expect(outcome).toBe("ok");
    expect(unlocks).toHaveLength(1);
  });
});
