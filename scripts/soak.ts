/**
 * `npm run soak`: a chaos soak of exclusive execution and unique jobs.
 *
 * Several worker processes (scripts/soak/worker.ts) run a `reschedule` and a `drop` exclusive task while a
 * separate process (scripts/soak/enqueuer.ts) enqueues jobs, some of them unique. Meanwhile a chaos loop,
 * driven by `--seed`, kills workers with SIGKILL (and starts them again, unlocking their graphile-worker
 * jobs with force_unlock_workers as an operator would), terminates lock sessions and graphile-worker
 * connections with pg_terminate_backend, restarts PostgreSQL once, and freezes the lock sessions' network
 * (every worker's lock session goes through a proxy in this process) for longer than the heartbeat timeout.
 * Then the queue is drained and the records (on the database's clock: an execution starts when its body
 * is entered, and ends with a write made before it returns) are checked.
 *
 *   npm run soak -- [--duration S] [--seed N] [--workers N] [--hunt] [--json] [--dump FILE]
 *
 * `--dump FILE` writes the run's records (executions, events, job errors, enqueues) and its report to FILE as
 * JSON when a violation is found.
 *
 * Exits 1 on any violation: overlapping executions of a key not preceded by a `lock:lost` abort, a job
 * lost, a successful execution repeated without a chaos event to explain it, an attempt burned by a lock
 * session outage (GWL_LOCK_SESSION_UNAVAILABLE), locks or library rows left after draining, a lock holder
 * that did not notice the partition, a worker that exited on its own, or a loop that ran out of time.
 * Uses DATABASE_URL when set (a fresh database is created on that server and dropped afterwards; the
 * restart is then skipped), else an embedded PostgreSQL.
 */
import { fork, type ChildProcess } from "node:child_process";
import { randomInt } from "node:crypto";
import { writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { setTimeout as sleep } from "node:timers/promises";
import pg from "pg";
import { runMigrations } from "graphile-worker";
import { makeLocks } from "../src/index.js";
import { databaseUrl, startPostgres } from "./postgres.js";
import { between, seeded } from "./soak/random.js";
import { startProxy } from "./soak/proxy.js";
import { SOAK_SCHEMA, type SoakMessage, type SoakWorkerStatus } from "./soak/shared.js";
import { limitsViolations } from "./soak/limits.js";
import { RATED_SCHEMA, rateViolations } from "./soak/rated.js";
import { SUPER_SCHEMA, supersedeViolations } from "./soak/superseding.js";

const WORKER = fileURLToPath(new URL("./soak/worker.ts", import.meta.url));
const ENQUEUER = fileURLToPath(new URL("./soak/enqueuer.ts", import.meta.url));
const HEARTBEAT_INTERVAL = 500;
const HEARTBEAT_TIMEOUT = 2000;
const CONCURRENCY = 4;
const LIBRARY_TABLES = ["lock_holders", "waiters", "wakes", "prewakes", "unique_windows"];

class UsageError extends Error {}

function parseOptions(argv: string[]) {
  const { values } = parseArgs({
    args: argv,
    options: {
      seed: { type: "string" },
      duration: { type: "string" },
      workers: { type: "string" },
      json: { type: "boolean", default: false },
      hunt: { type: "boolean", default: false },
      dump: { type: "string" },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help) {
    console.log(
      "usage: npm run soak -- [--duration S] [--seed N] [--workers N] [--hunt] [--json] [--dump FILE]",
    );
    process.exit(0);
  }
  const integer = (
    name: string,
    text: string | undefined,
    fallback: number,
    min: number,
    max: number,
  ) => {
    if (text === undefined) return fallback;
    const value = Number(text);
    if (!Number.isInteger(value) || value < min || value > max) {
      throw new UsageError(
        `--${name} must be an integer from ${min} to ${max}, got ${JSON.stringify(text)}`,
      );
    }
    return value;
  };
  return {
    seed: integer("seed", values.seed, randomInt(1, 2 ** 31), 0, 2 ** 31),
    duration: integer("duration", values.duration, 60, 20, 3600),
    workers: integer("workers", values.workers, 3, 2, 16),
    json: values.json,
    hunt: values.hunt,
    dump: values.dump,
  };
}

interface ChaosEvent {
  kind:
    "kill" | "terminate-lock-session" | "terminate-worker-connections" | "restart" | "partition";
  /** ms after the start of the load. */
  at: number;
  /** The worker slot, for kills and terminations. */
  slot: number;
  /** When set, the event runs this long after the previous one ended, rather than at `at`. */
  afterMs?: number;
}

/** The chaos schedule of a run, from its seed alone. */
function schedule(
  seed: number,
  loadMs: number,
  workers: number,
  partitionMs: number,
  hunt: boolean,
): ChaosEvent[] {
  const random = seeded(seed);
  const restartAt = Math.round(loadMs * 0.4);
  const partitionAt = Math.round(loadMs * 0.65);
  const events: ChaosEvent[] = [
    { kind: "restart", at: restartAt, slot: 0 },
    { kind: "partition", at: partitionAt, slot: 0 },
  ];
  // Hunting: lock sessions terminated within a second of the server's return, while they reconnect, hand
  // keys over and defer the jobs met during the outage.
  if (hunt) {
    for (let i = 0; i < 3; i++) {
      events.push({
        kind: "terminate-lock-session",
        at: restartAt,
        slot: between(random, 0, workers - 1),
        afterMs: between(random, 50, 600),
      });
    }
  }
  const kinds = ["kill", "kill", "terminate-lock-session", "terminate-worker-connections"] as const;
  for (
    let at = 2000 + between(random, 0, 1000);
    at < loadMs - 2000;
    at += between(random, 1200, 3500)
  ) {
    const kind = kinds[between(random, 0, kinds.length - 1)]!;
    const slot = between(random, 0, workers - 1);
    const quiet =
      (at > restartAt - 1500 && at < restartAt + 4000) ||
      (at > partitionAt - 1500 && at < partitionAt + partitionMs + 2000);
    if (!quiet) events.push({ kind, at, slot });
  }
  // (stable: the hunt's terminations follow the restart they share `at` with)
  return events.sort(
    (a, b) =>
      a.at - b.at || (a.afterMs === undefined ? -1 : 0) - (b.afterMs === undefined ? -1 : 0),
  );
}

interface Slot {
  index: number;
  incarnation: number;
  name: string;
  child: ChildProcess;
  workerIds: string[];
  lost: Array<{ at: number; holds: number; code: string | null }>;
  /** When its lock session (re)connected, by its clock. */
  connected: number[];
  /** What it was doing each second after the restart (asked over IPC). */
  afterRestart: SoakWorkerStatus[];
  killing: boolean;
  ready: boolean;
}

interface Recorded {
  kind: string;
  target: string;
  /** Microseconds since the epoch, by the database's clock, taken just before the event. */
  us: bigint | null;
  /** For a kill: when the process was seen gone (its jobs may write until then). */
  untilUs?: bigint | null;
  detail?: string;
}

async function main(): Promise<number> {
  const options = parseOptions(process.argv.slice(2));
  const log = (line: string) => {
    if (!options.json) console.log(line);
  };
  log(
    `soak: seed ${options.seed}, duration ${options.duration} s, ${options.workers} workers x ${CONCURRENCY}`,
  );
  const startedAt = Date.now();
  const loadMs = Math.round(options.duration * 1000 * 0.8);
  const partitionMs = HEARTBEAT_TIMEOUT + 2500;
  const plan = schedule(options.seed, loadMs, options.workers, partitionMs, options.hunt);

  const server = await startPostgres({ envVar: "DATABASE_URL" });
  const violations: string[] = [];
  const notes: string[] = [];
  const children = new Set<ChildProcess>();
  process.on("exit", () => {
    for (const child of children) child.kill("SIGKILL");
  });

  // A fresh database, so that nothing from before is counted.
  const database = `gwl_soak_${process.pid}_${Date.now()}`;
  const maintenance = new pg.Client({ connectionString: server.url });
  await maintenance.connect();
  await maintenance.query(`create database ${database}`);
  await maintenance.end();
  const url = databaseUrl(server.url, database);
  const port = Number(new URL(url).port || 5432);
  const proxy = await startProxy(port);
  const lockUrl = new URL(url);
  lockUrl.hostname = "127.0.0.1";
  lockUrl.port = String(proxy.port);

  const admin = new pg.Pool({ connectionString: url, max: 3, application_name: "gwl-soak-admin" });
  admin.on("error", () => undefined);
  admin.on("connect", (client) => client.on("error", () => undefined));
  try {
    await runMigrations({ connectionString: url, logger: undefined });
    const migrator = makeLocks({ connectionString: url });
    await migrator.migrate();
    await migrator.release();
    await admin.query(`
      create schema ${SOAK_SCHEMA};
      create table ${SOAK_SCHEMA}.executions (
        id bigserial primary key, ref text not null, job_id bigint not null, task text not null,
        lock_key text not null, worker text not null, attempts int not null,
        started_at timestamptz not null default clock_timestamp(), ended_at timestamptz, aborted text);
      create table ${SOAK_SCHEMA}.events (
        id bigserial primary key, kind text not null, job_id bigint, ref text, worker text, detail text,
        at timestamptz not null default clock_timestamp());
      create table ${SOAK_SCHEMA}.job_errors (
        id bigserial primary key, job_id bigint, ref text, worker text, code text, message text,
        at timestamptz not null default clock_timestamp());
      create table ${SOAK_SCHEMA}.enqueues (
        ref text primary key, task text not null, k text not null, unique_key text, outcome text not null,
        job_id bigint, at timestamptz not null default clock_timestamp());
      ${RATED_SCHEMA}
      ${SUPER_SCHEMA}`);

    // Database clock, in microseconds since the epoch; null while PostgreSQL is away.
    const dbNow = async (): Promise<bigint | null> => {
      try {
        const { rows } = await admin.query<{ us: string }>(
          "select (extract(epoch from clock_timestamp()) * 1000000)::bigint::text as us",
        );
        return BigInt(rows[0]!.us);
      } catch {
        return null;
      }
    };
    const recorded: Recorded[] = [];

    // Workers.
    const slots: Slot[] = [];
    const poolNames = new Map<string, string>();
    const unexpectedExits: string[] = [];
    /** Jobs whose end graphile-worker reported (job:complete), with the worker that ran them. */
    const completions = new Map<string, { worker: string; attempts: number; failed: boolean }>();
    const liveWorkerIds = () => new Set(slots.flatMap((s) => (s.killing ? [] : s.workerIds)));
    const spawnWorker = async (index: number, incarnation: number): Promise<Slot> => {
      const name = incarnation === 0 ? `w${index + 1}` : `w${index + 1}.${incarnation}`;
      const child = fork(WORKER, [], {
        execArgv: ["--import", "tsx"],
        env: {
          ...process.env,
          DATABASE_URL: url,
          SOAK_LOCK_URL: lockUrl.toString(),
          SOAK_WORKER: name,
          SOAK_CONCURRENCY: String(CONCURRENCY),
          SOAK_HEARTBEAT_INTERVAL: String(HEARTBEAT_INTERVAL),
          SOAK_HEARTBEAT_TIMEOUT: String(HEARTBEAT_TIMEOUT),
        },
        stdio: ["ignore", "inherit", "inherit", "ipc"],
      });
      children.add(child);
      const slot: Slot = {
        index,
        incarnation,
        name,
        child,
        workerIds: [],
        lost: [],
        connected: [],
        afterRestart: [],
        killing: false,
        ready: false,
      };
      child.on("message", (message: SoakMessage) => {
        if (message.type === "workerId") {
          slot.workerIds.push(message.workerId);
          poolNames.set(message.workerId, name);
        }
        if (message.type === "lost") slot.lost.push(message);
        if (message.type === "connected") slot.connected.push(message.at);
        if (message.type === "status") slot.afterRestart.push(message.status);
        if (message.type === "completed")
          completions.set(message.jobId, {
            worker: name,
            attempts: message.attempts,
            failed: message.failed,
          });
      });
      child.once("exit", (code, signal) => {
        children.delete(child);
        if (slot.ready && !slot.killing && !stopping) {
          unexpectedExits.push(`${name} (${signal ?? code})`);
          violations.push(`worker ${name} exited on its own (${signal ?? `code ${code}`})`);
          // Its jobs stay locked: hand them back, and start a new incarnation in its place.
          void unlock(slot.workerIds);
          slot.killing = true;
          void respawn(index, incarnation + 100).then(
            (next) => (slots[index] = next),
            (error: unknown) =>
              violations.push(`could not restart worker ${name}: ${String(error)}`),
          );
        }
      });
      await new Promise<void>((resolve, reject) => {
        const timer = setTimeout(
          () => reject(new Error(`worker ${name} not ready in 30 s`)),
          30_000,
        );
        child.on("message", (message: SoakMessage) => {
          if (message.type === "ready") {
            slot.ready = true;
            clearTimeout(timer);
            resolve();
          }
        });
        child.once("exit", () => {
          clearTimeout(timer);
          reject(new Error(`worker ${name} exited before it was ready`));
        });
      });
      return slot;
    };
    const unlock = async (workerIds: string[]): Promise<void> => {
      for (let tries = 0; workerIds.length > 0 && tries < 40; tries++) {
        try {
          await admin.query("select graphile_worker.force_unlock_workers($1::text[])", [workerIds]);
          return;
        } catch {
          await sleep(250);
        }
      }
    };
    // A worker started while PostgreSQL is away fails to start: try again, for up to 30 s.
    const respawn = async (index: number, incarnation: number): Promise<Slot> => {
      for (let attempt = 0; ; attempt++) {
        try {
          return await spawnWorker(index, incarnation + attempt * 1000);
        } catch (error) {
          if (attempt >= 30) throw error;
          await sleep(1000);
        }
      }
    };
    let stopping = false;
    for (let i = 0; i < options.workers; i++) slots.push(await spawnWorker(i, 0));

    // The enqueuer.
    const loadStart = Date.now();
    const enqueuer = fork(ENQUEUER, [], {
      execArgv: ["--import", "tsx"],
      env: {
        ...process.env,
        DATABASE_URL: url,
        SOAK_SEED: String(options.seed + 1),
        SOAK_UNTIL: String(loadStart + loadMs),
      },
      stdio: ["ignore", "inherit", "inherit", "ipc"],
    });
    children.add(enqueuer);
    const enqueued = new Promise<{ enqueued: number; errors: number } | null>((resolve) => {
      enqueuer.on("message", (m: { type: string; enqueued: number; errors: number }) => {
        if (m.type === "done") resolve(m);
      });
      enqueuer.once("exit", () => resolve(null));
    });

    // The chaos loop.
    const restarts: Array<Promise<unknown>> = [];
    let restartDone: bigint | null = null;
    let restartUs: bigint | null = null;
    let restartMs: number | null = null;
    let partition: { at: number; us: bigint | null; until: number } | null = null;
    /** Runnable jobs in the queue, each second of the 5 s after the restart. */
    const queuedAfterRestart: number[] = [];
    /** Terminations of lock sessions (this process's clock), to time their detection. */
    const terminations: Array<{ at: number; slot: Slot }> = [];
    const runEvent = async (event: ChaosEvent): Promise<void> => {
      const slot = slots[event.slot]!;
      switch (event.kind) {
        case "kill": {
          if (slot.killing) return;
          slot.killing = true;
          const us = await dbNow();
          slot.child.kill("SIGKILL");
          const killed: Recorded = { kind: "kill", target: slot.name, us };
          recorded.push(killed);
          await new Promise((resolve) =>
            slot.child.exitCode !== null || slot.child.signalCode !== null
              ? resolve(null)
              : slot.child.once("exit", resolve),
          );
          killed.untilUs = await dbNow();
          // graphile-worker would leave its jobs locked for 4 hours: unlock them as an operator would.
          await unlock(slot.workerIds);
          restarts.push(
            (async () => {
              await sleep(300 + (event.at % 1200));
              slots[event.slot] = await respawn(event.slot, slot.incarnation + 1);
            })().catch((error: unknown) =>
              violations.push(`could not restart worker ${slot.name}: ${String(error)}`),
            ),
          );
          return;
        }
        case "terminate-lock-session":
        case "terminate-worker-connections": {
          const like =
            event.kind === "terminate-lock-session"
              ? `graphile-worker-locks/soak-${slot.name}`
              : `gwl-soak-worker/${slot.name}`;
          const us = await dbNow();
          const at = Date.now();
          const { rows } = await admin
            .query<{ n: number }>(
              "select count(pg_terminate_backend(pid))::int as n from pg_stat_activity where application_name = $1",
              [like],
            )
            .catch(() => ({ rows: [{ n: 0 }] }));
          if (event.kind === "terminate-lock-session" && rows[0]!.n > 0)
            terminations.push({ at, slot });
          recorded.push({
            kind: event.kind,
            target: slot.name,
            us,
            detail: `${rows[0]!.n} backend(s)`,
          });
          return;
        }
        case "restart": {
          if (!server.restart) {
            notes.push(
              "PostgreSQL restart skipped: DATABASE_URL names a server this soak cannot restart",
            );
            return;
          }
          const us = await dbNow();
          const t0 = Date.now();
          await server.restart();
          restartMs = Date.now() - t0;
          restartUs = us;
          for (let i = 0; i < 100 && restartDone === null; i++) {
            restartDone = await dbNow();
            if (restartDone === null) await sleep(100);
          }
          recorded.push({
            kind: "restart",
            target: "postgres",
            us,
            detail: `${restartMs} ms down`,
          });
          // What each process does in the 5 s after the restart, once a second: a process that runs
          // nothing while jobs wait shows whether its jobs wait in the library (for the session, or to be
          // given back) or whether it fetches nothing.
          const waiting = (async () => {
            for (let second = 0; second < 5; second++) {
              await sleep(1000);
              for (const slot of slots) {
                if (slot.child.connected && !slot.killing) slot.child.send({ type: "status" });
              }
              queuedAfterRestart.push(
                await admin
                  .query<{ n: number }>(
                    "select count(*)::int as n from graphile_worker.jobs where task_identifier like 'soak_%' and locked_at is null and run_at <= now()",
                  )
                  .then(
                    ({ rows }) => rows[0]!.n,
                    () => -1,
                  ),
              );
            }
          })();
          restarts.push(waiting);
          return;
        }
        case "partition": {
          const us = await dbNow();
          const at = Date.now();
          proxy.freeze();
          partition = { at, us, until: at + partitionMs };
          recorded.push({
            kind: "partition",
            target: "lock sessions",
            us,
            detail: `${partitionMs} ms`,
          });
          await sleep(partitionMs);
          proxy.thaw();
          return;
        }
      }
    };
    for (const event of plan) {
      const wait = event.afterMs !== undefined ? event.afterMs : loadStart + event.at - Date.now();
      if (wait > 0) await sleep(wait);
      log(
        `  ${((Date.now() - loadStart) / 1000).toFixed(1).padStart(5)} s  ${event.kind} ${event.kind === "restart" || event.kind === "partition" ? "" : slots[event.slot]!.name}`,
      );
      const limit = new AbortController();
      await Promise.race([
        runEvent(event).catch((error: unknown) => {
          notes.push(`${event.kind} at ${event.at} ms failed: ${String(error)}`);
        }),
        sleep(30_000, undefined, { signal: limit.signal }).then(
          () => violations.push(`chaos event ${event.kind} did not finish in 30 s`),
          () => undefined,
        ),
      ]);
      limit.abort();
    }
    const enqueueResult = await Promise.race([enqueued, sleep(60_000).then(() => null)]);
    if (!enqueueResult) violations.push("the enqueuer did not finish");
    await Promise.race([Promise.allSettled(restarts), sleep(40_000)]);

    // Drain: wait for the queue to empty. Jobs that failed (an attempt burned) wait out graphile-worker's
    // backoff, which outlasts the soak: they are rescheduled to now. Jobs locked by a worker that is gone
    // are unlocked.
    log("  draining");
    const drainStart = Date.now();
    let hurried = 0;
    const completionsLost: string[] = [];
    /** Jobs whose completion graphile-worker lost (unlocked here to run again). */
    const completionLostIds = new Set<string>();
    let remaining = -1;
    while (Date.now() - drainStart < 30_000) {
      try {
        const { rows } = await admin.query<{ n: number }>(
          "select count(*)::int as n from graphile_worker.jobs where task_identifier like 'soak_%'",
        );
        remaining = rows[0]!.n;
        if (remaining === 0) break;
        const hurry = await admin.query(
          `select graphile_worker.reschedule_jobs(array_agg(id), run_at := now())
           from graphile_worker.jobs
           where task_identifier like 'soak_%' and locked_at is null and attempts > 0
             and run_at > now() + interval '1 second'
           having count(*) > 0`,
        );
        hurried += hurry.rowCount ? Number(hurry.rowCount) : 0;
        const live = liveWorkerIds();
        const stale = await admin.query<{ locked_by: string }>(
          "select distinct locked_by from graphile_worker.jobs where locked_by is not null",
        );
        const gone = stale.rows.map((r) => r.locked_by).filter((id) => !live.has(id));
        if (gone.length > 0) await unlock(gone);
        // graphile-worker writes a job's success or failure after job:complete without waiting for it, and
        // retries that statement only on a few error codes: one that meets the restart (57P01, a connection
        // ended) is dropped (an unhandled rejection), and the job stays locked by a live worker until its
        // lock expires, hours later. Such jobs (the worker reported their end, their row is still locked
        // by it) are counted and unlocked here, as an operator would, so that they run again.
        const orphans = await admin.query<{ id: string; locked_by: string; attempts: number }>(
          `select id::text, locked_by, attempts from graphile_worker.jobs
           where task_identifier like 'soak_%' and locked_at < now() - interval '5 seconds'`,
        );
        // (the same attempt: a job retried since has been fetched again, its attempts counted again)
        const uncompleted = orphans.rows.filter((r) => {
          const completion = completions.get(r.id);
          return (
            completion !== undefined &&
            completion.worker === poolNames.get(r.locked_by) &&
            completion.attempts === r.attempts
          );
        });
        if (uncompleted.length > 0) {
          await admin.query(
            `update graphile_worker._private_jobs set locked_at = null, locked_by = null
             where id = any($1::bigint[])`,
            [uncompleted.map((r) => r.id)],
          );
          for (const r of uncompleted) {
            const { worker, failed } = completions.get(r.id)!;
            completionLostIds.add(r.id);
            completionsLost.push(
              `job ${r.id} on ${worker} (${failed ? "failed" : "succeeded"}): its end was never recorded`,
            );
          }
        }
      } catch {
        // PostgreSQL unreachable for a moment: try again.
      }
      await sleep(500);
    }
    const drainMs = Date.now() - drainStart;
    const stuck = await admin
      .query<{ line: string }>(
        `select format('job %s (%s): locked_by %s, run_at in %s s, attempts %s/%s, last_error %s',
           id, task_identifier, coalesce(locked_by, '-'),
           round(extract(epoch from run_at - now())::numeric, 1), attempts, max_attempts,
           coalesce(left(last_error, 120), '-')) as line
         from graphile_worker.jobs where task_identifier like 'soak_%' order by id limit 10`,
      )
      .catch((error: unknown) => ({ rows: [{ line: `(could not list them: ${String(error)})` }] }));
    const owner = (line: string) =>
      line.replace(/locked_by (\S+),/, (all, id: string) => {
        const name = poolNames.get(id);
        return name ? `locked_by ${id} (worker ${name}),` : all;
      });
    for (const row of stuck.rows) notes.push(`left in the queue: ${owner(row.line)}`);
    // The lock sessions' holder registry is refreshed about twice a second.
    await sleep(1500);
    const leftovers: Record<string, number> = {};
    leftovers["soak jobs"] = (
      await admin.query<{ n: number }>(
        "select count(*)::int as n from graphile_worker.jobs where task_identifier like 'soak_%'",
      )
    ).rows[0]!.n;
    leftovers["advisory locks"] = (
      await admin.query<{ n: number }>(
        "select count(*)::int as n from pg_locks where locktype = 'advisory' and database = (select oid from pg_database where datname = current_database())",
      )
    ).rows[0]!.n;
    for (const table of LIBRARY_TABLES) {
      leftovers[`graphile_worker_locks.${table}`] = (
        await admin.query<{ n: number }>(
          `select count(*)::int as n from graphile_worker_locks.${table}`,
        )
      ).rows[0]!.n;
    }
    for (const [what, n] of Object.entries(leftovers)) {
      if (n !== 0) violations.push(`${n} ${what} left after draining`);
    }

    stopping = true;
    await Promise.all(
      slots.map(async (slot) => {
        if (slot.child.exitCode !== null || slot.child.signalCode !== null) return;
        const exited = new Promise((resolve) => slot.child.once("exit", resolve));
        slot.child.send({ type: "stop" });
        await Promise.race([exited, sleep(20_000).then(() => slot.child.kill("SIGKILL"))]);
      }),
    );

    const analysis = await analyse(admin, recorded, violations, {
      restartDone,
      partition,
      slots,
      restartMs,
      restartUs,
      terminations,
      completionLostIds,
      queuedAfterRestart,
    });
    const rates = await rateViolations(admin);
    if (rates.violations > 0)
      violations.push(`${rates.violations} rate violation(s) of soak_rated and soak_rated_locked`);
    const supersede = await supersedeViolations(admin);
    violations.push(...supersede.violations);
    const report = {
      rates,
      supersede: supersede.counts,
      seed: options.seed,
      durationS: options.duration,
      workers: options.workers,
      concurrency: CONCURRENCY,
      heartbeat: { intervalMs: HEARTBEAT_INTERVAL, timeoutMs: HEARTBEAT_TIMEOUT },
      elapsedS: Math.round((Date.now() - startedAt) / 100) / 10,
      enqueuer: enqueueResult,
      chaos: countBy(recorded.map((r) => r.kind)),
      drain: {
        ms: drainMs,
        remainingAtEnd: remaining,
        failedJobsRescheduledToNow: hurried,
        completionsLostByGraphileWorker: completionsLost,
      },
      ...analysis,
      leftovers,
      unexpectedWorkerExits: unexpectedExits,
      notes,
      violations,
    };
    if (options.json) console.log(JSON.stringify(report, null, 2));
    else printReport(report);
    // The run's own records, for reading a violation beside the chaos that came with it.
    if (options.dump && violations.length > 0) {
      const dump: Record<string, unknown> = { report };
      for (const table of ["executions", "events", "job_errors", "enqueues"])
        dump[table] = (await admin.query(`select * from ${SOAK_SCHEMA}.${table} order by 1`)).rows;
      await writeFile(options.dump, JSON.stringify(dump, null, 1));
      console.log(`records written to ${options.dump}`);
    }
    return violations.length > 0 ? 1 : 0;
  } finally {
    for (const child of children) child.kill("SIGKILL");
    await proxy.close().catch(() => undefined);
    await admin.end().catch(() => undefined);
    if (process.env.DATABASE_URL) {
      const cleanup = new pg.Client({ connectionString: server.url });
      await cleanup.connect().catch(() => undefined);
      await cleanup
        .query(`drop database if exists ${database} with (force)`)
        .catch(() => undefined);
      await cleanup.end().catch(() => undefined);
    }
    await server.stop();
  }
}

/** The chaos events of the 5 s before and after `us`, with their distance from it. */
function describeChaos(recorded: Recorded[], us: bigint): string {
  const near = recorded
    .filter((r) => r.us !== null && r.us >= us - 5_000_000n && r.us <= us + 5_000_000n)
    .map((r) => `${r.kind} ${r.target} at ${Number(r.us! - us) / 1000} ms`);
  return near.length > 0 ? `; chaos: ${near.join(", ")}` : "";
}

function countBy(items: string[]): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const item of items) counts[item] = (counts[item] ?? 0) + 1;
  return counts;
}

interface Execution {
  id: number;
  ref: string;
  jobId: string;
  task: string;
  lockKey: string;
  worker: string;
  start: bigint;
  end: bigint | null;
  aborted: string | null;
  /** What ended an execution that has no end of its own (its end is then the time of that event). */
  interrupted: string | null;
}

async function analyse(
  admin: pg.Pool,
  recorded: Recorded[],
  violations: string[],
  context: {
    restartDone: bigint | null;
    restartMs: number | null;
    restartUs: bigint | null;
    partition: { at: number; us: bigint | null; until: number } | null;
    slots: Slot[];
    terminations: Array<{ at: number; slot: Slot }>;
    completionLostIds: Set<string>;
    queuedAfterRestart: number[];
  },
) {
  const us = (column: string) => `(extract(epoch from ${column}) * 1000000)::bigint::text`;
  const executions: Execution[] = (
    await admin.query<{
      id: string;
      ref: string;
      job_id: string;
      task: string;
      lock_key: string;
      worker: string;
      s: string;
      e: string | null;
      aborted: string | null;
    }>(
      // (ordered by the bigint column: the output column `id` is text, whose order puts 120 before 47)
      `select id::text, ref, job_id::text, task, lock_key, worker, ${us("started_at")} as s,
         ${us("ended_at")} as e, aborted from ${SOAK_SCHEMA}.executions order by executions.id`,
    )
  ).rows.map((r) => ({
    id: Number(r.id),
    ref: r.ref,
    jobId: r.job_id,
    task: r.task,
    lockKey: r.lock_key,
    worker: r.worker,
    start: BigInt(r.s),
    end: r.e === null ? null : BigInt(r.e),
    aborted: r.aborted,
    interrupted: null,
  }));

  // An execution without an end was cut short by its process's death or by the server's restart. The
  // restart is taken just before it begins (`us`) and lasts until the server answers again (`restartDone`):
  // an execution that started in between wrote its start just before the server went down, and its end
  // could not be written (its end is then its start). Likewise a kill lasts from its timestamp until the
  // process was seen gone.
  const unended: string[] = [];
  for (const e of executions) {
    if (e.end !== null) continue;
    const cause = recorded
      .filter(
        (r) =>
          r.us !== null &&
          ((r.kind === "kill" && r.target === e.worker && (r.untilUs ?? r.us) >= e.start) ||
            (r.kind === "restart" && (context.restartDone ?? r.us) >= e.start)),
      )
      .sort((a, b) => (a.us! < b.us! ? -1 : 1))[0];
    if (cause) {
      e.end = cause.us! > e.start ? cause.us : e.start;
      e.interrupted = cause.kind === "kill" ? "worker killed" : "PostgreSQL restart";
    } else {
      unended.push(`job ${e.jobId} on ${e.worker}`);
      e.end = e.start;
      e.interrupted = "never ended";
    }
  }
  if (unended.length > 0) {
    violations.push(
      `${unended.length} execution(s) never ended: ${unended.slice(0, 5).join(", ")}`,
    );
  }

  // Overlaps, per key: a later start before an earlier end, unless the earlier one lost its lock.
  const byKey = new Map<string, Execution[]>();
  for (const e of executions) byKey.set(e.lockKey, [...(byKey.get(e.lockKey) ?? []), e]);
  // Jobs whose lock session's loss was noticed only after they returned (lock:lost with `returned`).
  const returnedLoss = new Set(
    (
      await admin.query<{ job_id: string }>(
        `select job_id::text from ${SOAK_SCHEMA}.events where kind = 'lock:lost-returned'`,
      )
    ).rows.map((r) => r.job_id),
  );
  // The jobs each process's lock:lost listed as running when it noticed the loss (worker/job id). One whose
  // signal had already fired for another reason (a superseded job finishing) could not be aborted again: the
  // loss is reported on the event, and the job had been told to stop before it.
  const lostWhileRunning = new Set(
    (
      await admin.query<{ worker: string; detail: string }>(
        `select worker, detail from ${SOAK_SCHEMA}.events where kind = 'lock:lost'`,
      )
    ).rows.flatMap((r) =>
      ((JSON.parse(r.detail) as { holds: Array<string | null> }).holds ?? []).map(
        (jobId) => `${r.worker}/${jobId}`,
      ),
    ),
  );
  let overlaps = 0;
  let excusedOverlaps = 0;
  let overlapsNoticedAfterReturn = 0;
  let overlapsAbortedBeforeLoss = 0;
  const overlapExamples: string[] = [];
  for (const list of byKey.values()) {
    list.sort((a, b) => (a.start < b.start ? -1 : a.start > b.start ? 1 : a.id - b.id));
    for (let i = 0; i < list.length; i++) {
      for (let j = i + 1; j < list.length && list[j]!.start < list[i]!.end!; j++) {
        const [a, b] = [list[i]!, list[j]!];
        if (a.aborted === "lock:lost") {
          excusedOverlaps++;
          continue;
        }
        // A loss its process noticed only after the job returned, reported on the job: the time its
        // process took to hear of the termination, not a hold that outlived its key in the library.
        if (returnedLoss.has(a.jobId)) {
          overlapsNoticedAfterReturn++;
          continue;
        }
        if (a.aborted !== null && lostWhileRunning.has(`${a.worker}/${a.jobId}`)) {
          overlapsAbortedBeforeLoss++;
          continue;
        }
        overlaps++;
        if (overlapExamples.length < 5) {
          const near = recorded
            .filter((r) => r.us !== null && r.us >= b.start - 3_000_000n && r.us <= a.end!)
            .map(
              (r) =>
                `${r.kind} ${r.target} ${Number(r.us! - b.start) / 1000} ms from the 2nd start`,
            );
          overlapExamples.push(
            `${a.lockKey}: job ${a.jobId} on ${a.worker} (${a.aborted ?? a.interrupted ?? "ended"}) and job ${b.jobId} on ${b.worker} (${b.aborted ?? b.interrupted ?? "ended"}), ${Number(a.end! - b.start) / 1000} ms${near.length ? `; chaos: ${near.join(", ")}` : ""}`,
          );
        }
      }
    }
  }
  violations.push(...limitsViolations(executions));
  if (overlaps > 0) {
    violations.push(
      `${overlaps} overlap(s) not preceded by a lock:lost abort: ${overlapExamples.join("; ")}`,
    );
  }

  // Every committed enqueue: executed to success once, or dropped (at enqueue or when it ran), or a
  // duplicate answered with the existing job.
  const enqueues = (
    await admin.query<{ ref: string; outcome: string; job_id: string | null }>(
      `select ref, outcome, job_id::text from ${SOAK_SCHEMA}.enqueues`,
    )
  ).rows;
  const dropped = new Set(
    (
      await admin.query<{ ref: string }>(
        `select ref from ${SOAK_SCHEMA}.events where kind = 'dropped' and ref is not null`,
      )
    ).rows.map((r) => r.ref),
  );
  const byRef = new Map<string, Execution[]>();
  for (const e of executions) byRef.set(e.ref, [...(byRef.get(e.ref) ?? []), e]);
  const success = (e: Execution) => e.aborted === null && e.interrupted === null;
  const lost: string[] = [];
  const repeated: string[] = [];
  const reruns: Record<string, number> = {};
  const chaosBetween = (worker: string, from: bigint, to: bigint): string | null => {
    const hit = recorded.find(
      (r) =>
        r.us !== null &&
        // (a kill takes effect between its `us` and its `untilUs`: a job may write its end in between)
        (r.untilUs ?? r.us) >= from - 1000n &&
        r.us <= to &&
        // Only what can lose graphile-worker's completion of a job explains a second run after a first
        // that ran to its end: a kill, the restart, a termination of graphile-worker's connections. The lock
        // session has no part in completing a job.
        (r.kind === "restart" ||
          (r.target === worker &&
            (r.kind === "kill" || r.kind === "terminate-worker-connections"))),
    );
    return hit ? `${hit.kind} before the job was completed` : null;
  };
  for (const enqueue of enqueues) {
    if (enqueue.outcome !== "added") continue;
    const runs = byRef.get(enqueue.ref) ?? [];
    const successes = runs.filter(success);
    if (successes.length === 0 && !dropped.has(enqueue.ref)) lost.push(enqueue.ref);
    for (let i = 0; i < runs.length - 1; i++) {
      const run = runs[i]!;
      let why: string;
      if (run.aborted !== null) why = `aborted (${run.aborted})`;
      else if (run.interrupted !== null) why = run.interrupted;
      else if (context.completionLostIds.has(run.jobId)) why = "completion lost by graphile-worker";
      else {
        why =
          chaosBetween(run.worker, run.end!, runs[i + 1]!.start) ?? "ran to the end, then again";
        if (why === "ran to the end, then again") {
          const next = runs[i + 1]!;
          repeated.push(
            `${enqueue.ref} (job ${run.jobId} on ${run.worker}, then job ${next.jobId} on ${next.worker} ${Number(next.start - run.end!) / 1000} ms after its end; runs: ${runs.map((r) => `#${r.id} ${r.worker} ${Number(r.start - runs[0]!.start) / 1000}..${Number(r.end! - runs[0]!.start) / 1000} ms ${r.aborted ?? r.interrupted ?? "ended"}`).join(", ")}${describeChaos(recorded, run.end!)})`,
          );
        }
      }
      reruns[why] = (reruns[why] ?? 0) + 1;
    }
  }
  if (lost.length > 0)
    violations.push(`${lost.length} job(s) lost: ${lost.slice(0, 10).join(", ")}`);
  if (repeated.length > 0) {
    violations.push(
      `${repeated.length} job(s) ran to success twice with no chaos to explain it: ${repeated.slice(0, 5).join(", ")}`,
    );
  }

  // Job errors: an attempt burned each.
  const errors = (
    await admin.query<{ code: string | null; n: number }>(
      `select coalesce(code, 'none') as code, count(*)::int as n from ${SOAK_SCHEMA}.job_errors group by 1 order by 2 desc`,
    )
  ).rows;
  const jobErrors = Object.fromEntries(errors.map((r) => [r.code, r.n]));
  const burned = jobErrors["GWL_LOCK_SESSION_UNAVAILABLE"] ?? 0;
  if (burned > 0)
    violations.push(
      `${burned} attempt(s) burned by lock-session outages (GWL_LOCK_SESSION_UNAVAILABLE)`,
    );

  // Recovery after the restart: from the server accepting connections again to each worker's first
  // execution (by workers that were not restarted meanwhile).
  let recovery: Record<string, number | string> | null = null;
  if (context.restartDone !== null) {
    recovery = {};
    const done = context.restartDone;
    // Every worker process that ran jobs before the restart and was still alive at its end.
    const names = new Set(executions.filter((e) => e.start < done).map((e) => e.worker));
    for (const name of names) {
      const killedBefore = recorded.some(
        (r) => r.kind === "kill" && r.target === name && r.us !== null && r.us < done,
      );
      if (killedBefore) continue;
      const first = executions
        .filter((e) => e.worker === name && e.start >= done)
        .sort((a, b) => (a.start < b.start ? -1 : 1))[0];
      const killedAfter = recorded.find((r) => r.kind === "kill" && r.target === name);
      if (first) recovery[name] = Number(first.start - done) / 1000;
      else if (killedAfter) recovery[name] = "killed before it ran again";
      else {
        recovery[name] = "ran nothing after the restart";
        violations.push(`worker ${name} ran nothing after the PostgreSQL restart`);
      }
      const slot = context.slots.find((s) => s.name === name);
      const slow = typeof recovery[name] === "string" || (recovery[name] as number) > 2000;
      if (slot && slow) {
        recovery[`${name} each second after`] = slot.afterRestart
          .map(
            (s, i) =>
              `${s.startedSinceLast} started, ${s.running} running, ${s.waitingForSession} waiting for the session, ${s.givingBack} being given back, session ${s.session}, ${context.queuedAfterRestart[i] ?? "?"} runnable in the queue`,
          )
          .join("; ");
      }
    }
  }

  // The partition: every worker that held a lock when its lock session froze must notice.
  let partition: Record<string, number | string> | null = null;
  const window = context.partition;
  if (window) {
    partition = {};
    // (an execution aborted by a lock loss is not counted: its loss, if not the partition's, came first)
    const holders = new Set(
      executions
        .filter(
          (e) =>
            window.us !== null &&
            e.start <= window.us &&
            e.end! > window.us &&
            e.aborted !== "lock:lost",
        )
        .map((e) => e.worker),
    );
    for (const slot of context.slots) {
      const lost = slot.lost.find((l) => l.at >= window.at && l.at <= window.until);
      if (lost) partition[slot.name] = lost.at - window.at;
      else if (holders.has(slot.name)) {
        partition[slot.name] = "not noticed";
        violations.push(`worker ${slot.name} held a lock and did not notice the partition`);
      } else partition[slot.name] = "held no lock";
    }
  }

  // From the termination of a lock session that was up (connected, not lost since) to its process's
  // lock:lost, both on this machine's clock. A termination that meets a session while it connects fails
  // that connection attempt instead, with no lock:lost (nothing was held on it).
  const up = context.terminations.filter(({ at, slot }) => {
    const since = slot.connected.filter((c) => c < at).at(-1);
    return since !== undefined && !slot.lost.some((l) => l.at > since && l.at < at);
  });
  const detection = up
    .map(({ at, slot }) => {
      const lostAt = slot.lost.find((l) => l.at >= at)?.at;
      return lostAt === undefined ? null : lostAt - at;
    })
    .filter((ms): ms is number => ms !== null)
    .sort((a, b) => a - b);
  if (detection.length < up.length)
    violations.push(
      `${up.length - detection.length} termination(s) of a lock session that was up went unnoticed`,
    );
  const quantile = (q: number) =>
    detection.length === 0
      ? null
      : detection[Math.min(detection.length - 1, Math.floor(q * detection.length))];

  const outcomes = countBy(enqueues.map((e) => e.outcome));
  return {
    executions: {
      total: executions.length,
      abortedByLockLoss: executions.filter((e) => e.aborted === "lock:lost").length,
      interrupted: countBy(executions.flatMap((e) => (e.interrupted ? [e.interrupted] : []))),
      keys: byKey.size,
    },
    enqueues: outcomes,
    overlaps,
    overlapsAfterLockLoss: excusedOverlaps,
    overlapsLossNoticedAfterReturn: overlapsNoticedAfterReturn,
    overlapsAbortedBeforeLoss,
    lockLossDetectionMs: {
      terminations: context.terminations.length,
      ofSessionsUp: up.length,
      noticed: detection.length,
      p50: quantile(0.5),
      p99: quantile(0.99),
      max: detection.at(-1) ?? null,
      each: detection.join(" "),
    },
    jobsLost: lost.length,
    repeatedWithoutCause: repeated.length,
    reruns,
    jobErrors,
    attemptsBurnedByLockSessionOutages: burned,
    restart:
      context.restartDone === null
        ? null
        : { downMs: context.restartMs, recoveryMsPerWorker: recovery },
    partitionDetectionMs: partition,
  };
}

function printReport(report: Record<string, unknown>): void {
  const rows: Array<[string, string]> = [];
  const flatten = (prefix: string, value: unknown): void => {
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      const entries = Object.entries(value);
      if (entries.length === 0) rows.push([prefix, "-"]);
      for (const [k, v] of entries) flatten(prefix ? `${prefix}.${k}` : k, v);
    } else if (Array.isArray(value)) {
      if (value.length === 0) rows.push([prefix, "none"]);
      value.forEach((v, i) => rows.push([`${prefix}[${i}]`, String(v)]));
    } else rows.push([prefix, String(value)]);
  };
  flatten("", report);
  const width = Math.max(...rows.map(([k]) => k.length));
  console.log("\nsoak report");
  for (const [k, v] of rows) console.log(`  ${k.padEnd(width)}  ${v}`);
  const violations = report.violations as string[];
  console.log(
    violations.length === 0 ? "\nOK: no violation" : `\nFAILED: ${violations.length} violation(s)`,
  );
}

const timeLimit =
  (Number(
    process.argv.includes("--duration") ? process.argv[process.argv.indexOf("--duration") + 1] : 60,
  ) || 60) *
    1000 +
  150_000;
const guard = setTimeout(() => {
  console.error(`soak: did not finish within ${timeLimit / 1000} s; giving up`);
  process.exit(1);
}, timeLimit);
guard.unref();

main().then(
  (code) => {
    process.exitCode = code;
    process.exit(code);
  },
  (error: unknown) => {
    console.error(error instanceof UsageError ? `soak: ${error.message}` : error);
    process.exit(error instanceof UsageError ? 2 : 1);
  },
);
