/**
 * pg-boss's side of section "peers": pg-boss 12 in a database of its own on the benchmark's server.
 * Imported only on a Node.js that pg-boss supports (see peers.ts), which holds what both sides share.
 *
 * Its best settings for these rows, from its documentation and source (dist/manager.js, dist/worker.js):
 * - `useListenNotify: true` on the instance and `notify: true` on every queue: without them an idle worker
 *   waits out its polling interval (2 s by default, 0.5 s at least) before it sees a new job.
 * - `batchSize: 1` (a singleton queue hands out one job per key at a time anyway) with `localConcurrency`
 *   workers; a batch-size-1 worker otherwise sleeps its polling interval after every fetch, so at most two
 *   fetches a second per worker, unless burst mode is on: `burstWhenReadyExceeds: 1` (the least allowed)
 *   fetches again at once while the last fetch returned a job and the queue's cached ready count exceeds 1.
 *   That count is refreshed by the monitor and read through the instance's queue cache (60 s each by
 *   default), so on a fresh backlog burst mode can take up to a minute to engage. Here the count is
 *   refreshed (`getQueueStats(name, { force: true })`) and the queue cache reloaded
 *   (`queueCacheIntervalSeconds: 1`, then a wait) after the jobs are inserted and before its workers start,
 *   so burst mode is on from the first fetch; with `supervise: false` no monitor pass lowers the cached
 *   count mid-run, so it stays on to the end.
 * - Polling intervals at their minimum (0.5 s), for the fetches that come back empty (no free key).
 * - `schedule: false`, `supervise: false`: no cron or maintenance work during the measurements.
 */
import pg from "pg";
import { PgBoss, type WorkOptions } from "pg-boss";
import { createBenchDatabase, sleep, type BenchContext } from "./lib.js";
import { JOB_MS, POLICIES, Recorder, type Peer, type PeerPayload, type Policy } from "./peers.js";

const SCHEMA = "pgboss";
/** The least pg-boss allows. */
const BURST_WHEN_READY_EXCEEDS = 1;
const CONTENDED = "peers_contended";
const PICKUP = "peers_pickup";
const sendQueue = (policy: Policy) => `peers_send_${policy}`;

export async function openPgBoss(ctx: BenchContext): Promise<Peer> {
  const recorder = new Recorder();
  const database = await createBenchDatabase(ctx.url);
  const admin = new pg.Pool({
    connectionString: database.url,
    max: 2,
    application_name: "gwl-bench-admin",
  });
  admin.on("error", () => undefined);
  const boss = new PgBoss({
    connectionString: database.url,
    schema: SCHEMA,
    application_name: "gwl-bench-pgboss",
    useListenNotify: true,
    schedule: false,
    supervise: false,
    queueCacheIntervalSeconds: 1,
  });
  let reportedError = false;
  boss.on("error", (error) => {
    if (!reportedError) ctx.log(`peers: pg-boss error: ${error.message}`);
    reportedError = true;
  });
  boss.on("warning", (warning) => ctx.log(`peers: pg-boss warning: ${warning.message}`));

  const work = (localConcurrency: number): WorkOptions => ({
    batchSize: 1,
    localConcurrency,
    burstWhenReadyExceeds: BURST_WHEN_READY_EXCEEDS,
    pollingIntervalSeconds: 0.5,
    notifyPollingIntervalSeconds: 0.5,
  });
  const handler = async (jobs: Array<{ data: PeerPayload }>) => {
    for (const job of jobs) await recorder.run(job.data);
  };
  const close = async () => {
    await boss.stop({ graceful: false, close: true }).catch(() => undefined);
    await admin.end().catch(() => undefined);
    await database.drop();
  };
  try {
    await boss.start();
    for (const policy of POLICIES)
      await boss.createQueue(sendQueue(policy), { policy, notify: true });
    await boss.createQueue(CONTENDED, { policy: "singleton", notify: true });
    await boss.createQueue(PICKUP, { policy: "singleton", notify: true });
  } catch (error) {
    await close();
    throw error;
  }

  /** Empties a queue (pg-boss's own call) and refreshes its table's statistics, as ours does. */
  const reset = async (name: string) => {
    await boss.deleteAllJobs(name);
    await admin.query(`vacuum analyze ${SCHEMA}.job`);
  };
  let idleWorker: string | undefined;

  return {
    id: "pg-boss",
    recorder,
    settings: [
      "new PgBoss({ useListenNotify: true, schedule: false, supervise: false, queueCacheIntervalSeconds: 1 }); pool of 10 (default)",
      "createQueue(name, { policy, notify: true })",
      "work(name, { batchSize: 1, localConcurrency: concurrency, burstWhenReadyExceeds: 1, pollingIntervalSeconds: 0.5, notifyPollingIntervalSeconds: 0.5 })",
      "contended runs: ready count refreshed (getQueueStats force) and queue cache reloaded before the workers start: burst mode from the first fetch",
    ],
    resetSends: (policy) => reset(sendQueue(policy)),
    send: async (policy, payload) =>
      (await boss.send(sendQueue(policy), payload, { singletonKey: payload.key })) !== null,
    async contended(keys, concurrency) {
      await reset(CONTENDED);
      const data = (key: string, index: number): PeerPayload => ({ key, i: index + 1, ms: JOB_MS });
      await boss.insert(
        CONTENDED,
        keys.map((key, index) => ({ data: data(key, index), singletonKey: key })),
      );
      await admin.query(`vacuum analyze ${SCHEMA}.job`);
      // A forced reading reuses one made in the last minute (pg-boss's own rate limit), so after an earlier
      // run it may be that run's count: burst mode only needs it above the threshold.
      const [stats] = await boss.getQueueStats(CONTENDED, { force: true });
      if ((stats?.readyCount ?? 0) <= BURST_WHEN_READY_EXCEEDS) {
        throw new Error(
          `pg-boss: cached ready count ${stats?.readyCount} after inserting ${keys.length} jobs: burst mode would stay off`,
        );
      }
      // Let the instance's queue cache (reloaded every second here) pick it up: burst mode from the start.
      await sleep(1_200);
      const done = recorder.expect(keys.length, 60_000 + keys.length * JOB_MS * 4);
      const id = await boss.work<PeerPayload>(CONTENDED, work(concurrency), handler);
      try {
        await done;
        return { parked: 0 };
      } finally {
        await boss.offWork(CONTENDED, { id, wait: true });
        await reset(CONTENDED);
      }
    },
    async startIdle(concurrency) {
      await reset(PICKUP);
      idleWorker = await boss.work<PeerPayload>(PICKUP, work(concurrency), handler);
    },
    sendPickup: async (payload) =>
      void (await boss.send(PICKUP, payload, { singletonKey: payload.key })),
    async stopIdle() {
      if (idleWorker) await boss.offWork(PICKUP, { id: idleWorker, wait: true });
      idleWorker = undefined;
      await reset(PICKUP);
    },
    close,
  };
}
