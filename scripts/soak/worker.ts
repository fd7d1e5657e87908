/**
 * A worker process of `npm run soak`: a graphile-worker runner with two exclusive tasks, `soak_serial`
 * (`reschedule`) and `soak_dedupe` (`drop`), keyed by `payload.k`. Each execution writes a row with its
 * start and end from the database's clock (clock_timestamp()) while it holds its lock; an execution whose
 * lock is lost stops at once and marks its row `aborted = 'lock:lost'`. Job errors, drops, reschedules and
 * lock losses are written as rows too, and lock losses and reconnections are also sent to the soak process
 * over IPC (with this process's clock) to time their detection.
 *
 * Configured by environment variables: DATABASE_URL (records and graphile-worker), SOAK_LOCK_URL (the lock
 * session's connection, through the soak's proxy), SOAK_WORKER, SOAK_CONCURRENCY, SOAK_HEARTBEAT_INTERVAL,
 * SOAK_HEARTBEAT_TIMEOUT, and SOAK_BREAK, which only exists to prove that the soak's checks can fail:
 * `nolock` runs `soak_serial` without its lock, `twice` runs every successful execution a second time,
 * `lose` completes one job in ten without running it.
 */
import { EventEmitter } from "node:events";
import { run, type JobHelpers, type Task, type WorkerEvents } from "graphile-worker";
import { makeLocks } from "../../src/index.js";
import { makePool, SOAK_SCHEMA, soakLogger, type SoakMessage, type SoakPayload } from "./shared.js";
import { limitsTasks } from "./limits.js";
import { ratedTask } from "./rated.js";
import { supersedeTask } from "./superseding.js";

const url = process.env.DATABASE_URL;
if (!url) throw new Error("soak worker: DATABASE_URL is not set");
const name = process.env.SOAK_WORKER ?? String(process.pid);
const concurrency = Number(process.env.SOAK_CONCURRENCY ?? 4);
const breakMode = process.env.SOAK_BREAK ?? "";
const send = (message: SoakMessage): void => {
  if (process.connected) process.send?.(message);
};
const errorCode = (error: unknown): string | null => {
  const code = (error as { code?: unknown } | null | undefined)?.code;
  return typeof code === "string" ? code : null;
};

// Job failures are recorded (job_errors) and counted in the report; SOAK_VERBOSE=1 prints them too.
const logger = soakLogger(`[soak ${name}]`);
const records = makePool({
  connectionString: url,
  max: concurrency + 4,
  application_name: `gwl-soak-records/${name}`,
});
const workerPool = makePool({
  connectionString: url,
  max: concurrency + 4,
  application_name: `gwl-soak-worker/${name}`,
});

// Rows written from event listeners: retried while PostgreSQL is away (restart), for up to 20 s.
const pending = new Set<Promise<unknown>>();
const record = (text: string, values: unknown[]): void => {
  const write = (async () => {
    for (const deadline = Date.now() + 20_000; ;) {
      try {
        return await records.query(text, values);
      } catch (error) {
        if (Date.now() > deadline) {
          console.error(`[soak ${name}] could not record: ${String(error)}`);
          return;
        }
        await new Promise((resolve) => setTimeout(resolve, 250));
      }
    }
  })();
  pending.add(write);
  void write.finally(() => pending.delete(write));
};

const locks = makeLocks({
  connectionString: url,
  lockConnectionString: process.env.SOAK_LOCK_URL ?? url,
  applicationName: `graphile-worker-locks/soak-${name}`,
  heartbeatInterval: Number(process.env.SOAK_HEARTBEAT_INTERVAL ?? 500),
  heartbeatTimeout: Number(process.env.SOAK_HEARTBEAT_TIMEOUT ?? 2000),
  reconnectDelay: { min: 50, max: 500 },
  logger,
});
const refOf = (payload: unknown): string | null => (payload as SoakPayload | null)?.ref ?? null;
locks.events.on("job:dropped", ({ job }) =>
  record(
    `insert into ${SOAK_SCHEMA}.events (kind, job_id, ref, worker) values ('dropped', $1, $2, $3)`,
    [job.id, refOf(job.payload), name],
  ),
);
locks.events.on("job:rescheduled", ({ job, newJobId }) =>
  record(
    `insert into ${SOAK_SCHEMA}.events (kind, job_id, ref, worker, detail)
     values ('rescheduled', $1, $2, $3, $4)`,
    [job.id, refOf(job.payload), name, newJobId],
  ),
);
locks.events.on("lock:lost", ({ holds, error }) => {
  send({ type: "lost", at: Date.now(), holds: holds.length, code: errorCode(error) });
  record(`insert into ${SOAK_SCHEMA}.events (kind, worker, detail) values ('lock:lost', $1, $2)`, [
    name,
    JSON.stringify({ holds: holds.map((h) => h.jobId), error: error.message }),
  ]);
  // Jobs that had returned before the loss was noticed: their abort could not cover them.
  for (const h of holds) {
    if (h.returned && h.jobId !== null) {
      record(
        `insert into ${SOAK_SCHEMA}.events (kind, job_id, worker) values ('lock:lost-returned', $1, $2)`,
        [h.jobId, name],
      );
    }
  }
});
locks.events.on("session:connected", () => send({ type: "connected", at: Date.now() }));

const sleep = (ms: number, signal: AbortSignal | undefined): Promise<void> =>
  new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason as Error);
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal!.reason as Error);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });

/**
 * This process's clock on the database's (seconds to add), from the sample of least round trip: an
 * execution's start is the instant its body was entered, not when its row reached the database (which a busy
 * machine delays by up to hundreds of milliseconds, long enough to put a job that lost its lock after a
 * later holder's start). Its end stays the database's clock of a write made before the body returns, which
 * is before the release.
 */
const clockOffset = await (async () => {
  let best = { rtt: Number.POSITIVE_INFINITY, offset: 0 };
  for (let i = 0, failures = 0; i < 7; i++) {
    const sent = performance.now();
    let rows: Array<{ t: number }>;
    try {
      ({ rows } = await records.query<{ t: number }>(
        "select extract(epoch from clock_timestamp())::float8 as t",
      ));
    } catch (error) {
      // (PostgreSQL restarting as this process starts)
      if (++failures > 80) throw error;
      i--;
      await new Promise((resolve) => setTimeout(resolve, 250));
      continue;
    }
    const rtt = performance.now() - sent;
    const mid = (performance.timeOrigin + sent + rtt / 2) / 1000;
    if (rtt < best.rtt) best = { rtt, offset: Number(rows[0]!.t) - mid };
  }
  return best.offset;
})();
const databaseNow = (): number => (performance.timeOrigin + performance.now()) / 1000 + clockOffset;

let executions = 0;
const body = async (task: string, payload: SoakPayload, helpers: JobHelpers): Promise<void> => {
  if (breakMode === "lose" && ++executions % 10 === 0) return;
  const runOnce = async (): Promise<void> => {
    const entered = databaseNow();
    const { rows } = await records.query<{ id: string }>(
      `insert into ${SOAK_SCHEMA}.executions (ref, job_id, task, lock_key, worker, attempts, started_at)
       values ($1, $2, $3, $4, $5, $6, to_timestamp($7)) returning id`,
      [
        payload.ref,
        helpers.job.id,
        task,
        `${task}:${payload.k}`,
        name,
        helpers.job.attempts,
        entered,
      ],
    );
    const id = rows[0]!.id;
    try {
      await sleep(payload.ms, helpers.abortSignal);
    } catch (error) {
      const code =
        errorCode(error) === "GWL_LOCK_LOST" ? "lock:lost" : (errorCode(error) ?? "abort");
      await records.query(
        `update ${SOAK_SCHEMA}.executions set ended_at = clock_timestamp(), aborted = $2 where id = $1`,
        [id, code],
      );
      throw error;
    }
    await records.query(
      `update ${SOAK_SCHEMA}.executions set ended_at = clock_timestamp() where id = $1`,
      [id],
    );
  };
  await runOnce();
  if (breakMode === "twice") await runOnce();
};

const serial = locks.exclusive<SoakPayload>(
  "soak_serial",
  (payload, helpers) => body("soak_serial", payload, helpers),
  {
    onConflict: "reschedule",
    key: (p) => p.k,
    reschedule: { minDelay: 20, maxDelay: 200 },
  },
);
const dedupe = locks.exclusive<SoakPayload>(
  "soak_dedupe",
  (payload, helpers) => body("soak_dedupe", payload, helpers),
  { onConflict: "drop", key: (p) => p.k },
);
const unlocked: Task = (payload, helpers) => body("soak_serial", payload as SoakPayload, helpers);

const events: WorkerEvents = new EventEmitter();
let running = 0;
let started = 0;
let startedAtLastStatus = 0;
events.on("job:start", () => {
  running++;
  started++;
});
events.on("job:complete", () => running--);
// graphile-worker 0.18 locks jobs in the pool's name (`locked_by`), not the worker's: the soak process
// needs it to unlock this process's jobs after killing it.
events.on("pool:create", ({ workerPool }) => send({ type: "workerId", workerId: workerPool.id }));
// graphile-worker records a job's outcome after job:complete, without waiting for it: the soak process checks
// that every job it was told of here left the queue.
events.on("job:complete", ({ job, error }) =>
  send({
    type: "completed",
    jobId: job.id,
    attempts: job.attempts,
    failed: error !== undefined && error !== null,
  }),
);
events.on("job:error", ({ job, error }) =>
  record(
    `insert into ${SOAK_SCHEMA}.job_errors (job_id, ref, worker, code, message) values ($1, $2, $3, $4, $5)`,
    [
      job.id,
      refOf(job.payload),
      name,
      errorCode(error),
      String((error as Error)?.message ?? error),
    ],
  ),
);

// While PostgreSQL restarts, graphile-worker leaves some rejections unhandled: they are not fatal here.
process.on("unhandledRejection", (reason) => {
  console.error(`[soak ${name}] unhandled rejection: ${String(reason)}`);
});

const runner = await run({
  pgPool: workerPool,
  concurrency,
  taskList: {
    soak_serial: breakMode === "nolock" ? unlocked : serial,
    soak_dedupe: dedupe,
    ...limitsTasks(locks, body),
    ...ratedTask(locks, record),
    ...supersedeTask(locks, body, record),
  },
  noHandleSignals: true,
  pollInterval: 100,
  logger,
  events,
});
locks.attach(runner);

let stopping: Promise<void> | undefined;
process.on("message", (message: { type?: string }) => {
  if (message?.type === "status") {
    const status = locks.status();
    send({
      type: "status",
      at: Date.now(),
      status: {
        session: status.state,
        held: status.held.length,
        waitingForSession: status.outage.waitingForSession,
        givingBack: status.outage.givingBack,
        running,
        startedSinceLast: started - startedAtLastStatus,
      },
    });
    startedAtLastStatus = started;
    return;
  }
  if (message?.type !== "stop") return;
  stopping ??= (async () => {
    setTimeout(() => process.exit(1), 15_000).unref();
    await runner.stop();
    while (pending.size > 0) await Promise.allSettled([...pending]);
    await locks.release();
    await Promise.all([records.end(), workerPool.end()]);
    send({ type: "stopped" });
    process.exit(0);
  })();
});
process.on("disconnect", () => process.exit(1));
send({ type: "ready", pid: process.pid });
