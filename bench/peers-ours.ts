/**
 * Our side of section "peers": this library on graphile-worker, in the benchmark's own database.
 *
 * - Sends: `locks.addJob(identifier, payload, spec)`, one round trip each, on the Locks pool. For each pg-boss
 *   policy the closest rule (OUR_MATCH in peers-common.ts): `short` (one queued job per key, any number
 *   running) is `unique: "queued"`; `singleton` (one running job per key, any number queued: every send is
 *   stored) is an exclusive task without uniqueness (plain add_job; exclusivity is applied when jobs run);
 *   `stately` (one queued and one running per key) is `unique: "queued"` on that exclusive task; `exclusive`
 *   (one queued or running per key) is `unique: "active"`.
 * - Processing: `locks.exclusive(identifier, fn, { onConflict: "reschedule", key })` under graphile-worker's
 *   `run()`; a job meeting a held key is parked and the releasing worker wakes it.
 */
import { EventEmitter } from "node:events";
import { run } from "graphile-worker";
import type { Runner, WorkerEvents } from "graphile-worker";
import type { AddJobSpec, Locks } from "../src/index.js";
import { library } from "./library.js";
import { now, quietLogger, resetJobs, type BenchContext } from "./lib.js";
import {
  Recorder,
  type ContendedRun,
  type Peer,
  type PeerPayload,
  type Policy,
  type SendFigures,
} from "./peers-common.js";

/** The exclusive task (processing, pickup, and the `singleton` and `stately` sends). */
const EXCLUSIVE = "peers_exclusive";
/** A unique-only task (the `short` and `exclusive` sends). */
const PLAIN = "peers_plain";

const SEND: Record<Policy, { identifier: string; spec: AddJobSpec }> = {
  short: { identifier: PLAIN, spec: { unique: "queued" } },
  singleton: { identifier: EXCLUSIVE, spec: {} },
  stately: { identifier: EXCLUSIVE, spec: { unique: "queued" } },
  exclusive: { identifier: PLAIN, spec: { unique: "active" } },
};

export async function openOurs(ctx: BenchContext): Promise<Peer> {
  const recorder = new Recorder();
  const locks: Locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  const task = locks.exclusive<PeerPayload>(EXCLUSIVE, recorder.run, {
    onConflict: "reschedule",
    key: (p) => p.key,
  });
  locks.define<PeerPayload>(PLAIN, { uniqueKey: (p) => p.key });
  try {
    await locks.migrate();
    // The lock session otherwise opens with the first job, which would count in the first pickup.
    await locks.connect();
  } catch (error) {
    await locks.release();
    throw error;
  }

  const reset = async () => {
    await resetJobs(ctx.pool);
    await ctx.pool.query("truncate graphile_worker_locks.waiters");
  };

  const startRunner = async (concurrency: number): Promise<Runner> => {
    const events = new EventEmitter() as WorkerEvents;
    let reported = false;
    events.on("job:error", ({ error }) => {
      if (reported) return;
      reported = true;
      ctx.log(`peers: ours: a job failed (graphile-worker retries it): ${String(error)}`);
    });
    // Early wakes go to this runner's idle workers (detached when it stops).
    locks.attach({ events });
    return run({
      connectionString: ctx.url,
      concurrency,
      taskList: { [EXCLUSIVE]: task },
      noHandleSignals: true,
      logger: quietLogger,
      events,
      // Jobs of a key this process holds are not fetched only to be parked (they carry the key's flag).
      forbiddenFlags: locks.forbiddenFlags,
    });
  };

  let idle: Runner | undefined;

  return {
    id: "ours",
    settings: [
      "graphile-worker run({ concurrency, forbiddenFlags: locks.forbiddenFlags }), defaults otherwise (LISTEN/NOTIFY, pollInterval 2 s, no local queue), its events given to locks.attach",
      'locks.exclusive(..., { onConflict: "reschedule", key: (p) => p.key }); makeLocks() defaults (pool of 10)',
    ],

    async send(policy, keys, round): Promise<SendFigures> {
      await reset();
      const { identifier, spec } = SEND[policy];
      let added = 0;
      let duplicates = 0;
      const t0 = now();
      for (let i = 0; i < keys.length; i++) {
        const payload: PeerPayload = { key: keys[i]!, i: round * 1_000_000 + i, ms: 0 };
        const { outcome } = await locks.addJob(identifier, payload, spec);
        if (outcome === "added") added++;
        else if (outcome === "duplicate") duplicates++;
        else throw new Error(`ours: unexpected outcome ${outcome} of a ${policy} send`);
      }
      const seconds = (now() - t0) / 1000;
      return { seconds, opsPerSecond: keys.length / seconds, added, duplicates };
    },

    async contended(keys, jobMs, concurrency): Promise<ContendedRun> {
      await reset();
      // Each job carries its key's flag, as locks.addJob gives it to a `reschedule` task's jobs.
      const flags = keys.map((k) => library.lockFlag(task.lockKey({ key: k, i: 0, ms: 0 })));
      await ctx.pool.query(
        `select count(*) from graphile_worker.add_jobs(array(
           select row($1::text, json_build_object('key', t.k, 'i', t.i, 'ms', $3::int),
             null, null, null, null, null, array[t.flag])::graphile_worker.job_spec
           from unnest($2::text[], $4::text[]) with ordinality as t(k, flag, i) order by t.i))`,
        [EXCLUSIVE, keys, jobMs, flags],
      );
      await ctx.pool.query("vacuum analyze graphile_worker._private_jobs");
      const done = recorder.expect(keys.length, 60_000 + keys.length * jobMs * 4);
      const parked: number[] = [];
      const onParked = ({ job }: { job: { payload: unknown } }) => {
        parked.push((job.payload as PeerPayload).i);
      };
      locks.events.on("job:rescheduled", onParked);
      const runner = await startRunner(concurrency);
      try {
        return { spans: await done, parked };
      } finally {
        locks.events.off("job:rescheduled", onParked);
        await runner.stop();
        await reset();
      }
    },

    async startIdle(concurrency) {
      await reset();
      idle = await startRunner(concurrency);
    },

    async pickup(i): Promise<number> {
      const started = recorder.started(i, 10_000);
      const t0 = now();
      await locks.addJob(EXCLUSIVE, { key: `pickup-${i}`, i, ms: 0 } satisfies PeerPayload);
      return (await started) - t0;
    },

    async stopIdle() {
      await idle?.stop();
      idle = undefined;
      await reset();
    },

    async close() {
      await idle?.stop().catch(() => undefined);
      await locks.release();
    },
  };
}
