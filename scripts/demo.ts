/**
 * `npm run demo`: graphile-worker-locks at work, in under ten seconds. Starts PostgreSQL (scripts/postgres.ts),
 * forks this file as three worker processes (DEMO_WORKER=1..3, concurrency 4) running one exclusive task per
 * conflict strategy plus a semaphore, fires bursts of duplicate jobs (in bulk through graphile-worker, so that
 * they meet at run time, and one by one through the library, whose preemptive check drops them at enqueue),
 * waits until the queue settles, and prints a timeline per key and a summary built from the records the
 * workers wrote while holding their locks (schema `gwl_demo`, kept for inspection). Exits 1 if a key ran more
 * jobs at once than its limit or a job is unaccounted for; on SIGINT or SIGTERM cleans up, exits 130 / 143.
 */
import { fork, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { Logger, makeWorkerUtils, run, runMigrations, type Job } from "graphile-worker";
import pg from "pg";
import {
  ErrorCodes,
  makeLocks,
  type ExclusiveOptions,
  type ExclusiveTask,
  type Locks,
} from "../src/index.js";
import { highestConcurrency } from "./overlap.js";
import { startPostgres } from "./postgres.js";

const SCHEMA = "gwl_demo";
const WORKERS = ["1", "2", "3"];
const CONCURRENCY = 4;
const ACCOUNTS = ["acme", "globex", "initech"];
/** Raised jobs retry after e^attempts s; retries due later than this after the first burst are left. */
const RETRY_HORIZON_MS = 6_000;
const SETTLE_DEADLINE_MS = 15_000;

/** The key of every task is the account; `run` tells this run's jobs and records from another's. */
interface Payload {
  account: string;
  run: string;
}
const byAccount = (p: Payload) => p.account;
interface TaskSpec {
  options: ExclusiveOptions<Payload>;
  description: string;
  /** An execution's duration, uniformly random in this range (ms). */
  ms: readonly [number, number];
}
const TASKS = {
  sync_account: {
    options: { onConflict: "drop", key: byAccount },
    description: "a duplicate sync is redundant: dropped",
    ms: [30, 80],
  },
  // The safety-net delay only matters if no release wakes the parked job.
  charge_card: {
    options: {
      onConflict: "reschedule",
      key: byAccount,
      reschedule: { minDelay: 20, maxDelay: 200, jitter: 0.5 },
    },
    description: "all charges run, one at a time; a waiting one starts as soon as the key frees",
    ms: [40, 120],
  },
  send_report: {
    options: { onConflict: "raise", key: byAccount },
    description: "throws a LockConflictError; graphile-worker retries the job",
    ms: [100, 150],
  },
  build_export: {
    options: { onConflict: "drop", key: byAccount, limit: 2 },
    description: "at most two per account at once; a third is dropped",
    ms: [60, 150],
  },
} satisfies Record<string, TaskSpec>;
type TaskName = keyof typeof TASKS;
const NAMES = Object.keys(TASKS) as TaskName[];
const limitOf = (t: TaskName) => (TASKS[t].options as { limit?: number }).limit ?? 1;
const strategyOf = (t: TaskName) =>
  `${TASKS[t].options.onConflict}${limitOf(t) > 1 ? `, limit ${limitOf(t)}` : ""}`;

function defineTasks(locks: Locks, body: (task: TaskName, p: Payload, job: Job) => Promise<void>) {
  return Object.fromEntries(
    NAMES.map((t) => [
      t,
      locks.exclusive<Payload>(
        t,
        (p, h) => body(t, p, h.job),
        TASKS[t].options as TaskSpec["options"],
      ),
    ]),
  ) as Record<TaskName, ExclusiveTask<Payload>>;
}

/** Warnings and errors only, without the expected LockConflictError of `raise` jobs. */
const makeLogger = (prefix: string, quiet: () => boolean) =>
  new Logger(() => (level, message, meta) => {
    const code = (meta as { error?: { code?: unknown } } | undefined)?.error?.code;
    if ((level === "error" || level === "warning") && code !== ErrorCodes.LOCK_CONFLICT && !quiet())
      console.error(`${prefix} ${level}: ${message}`);
  });

// ---------------------------------------------------------------------------------------------------------
// A worker process: runs the tasks, records every execution and conflict; stops on "stop" over IPC.

async function worker(name: string, url: string): Promise<void> {
  let stopping: Promise<void> | undefined;
  const logger = makeLogger(`[worker ${name}]`, () => stopping !== undefined);
  const records = new pg.Pool({ connectionString: url, max: CONCURRENCY + 2 });
  records.on("error", () => undefined);
  const pending = new Set<Promise<unknown>>();
  const recordConflict = (
    job: Job,
    outcome: string,
    newJobId: string | null,
    local: boolean | null,
  ) => {
    const p = job.payload as Payload;
    const write = records
      .query(
        `insert into ${SCHEMA}.conflicts (run, job_id, task, key, worker, outcome, new_job_id, local)
         values ($1, $2, $3, $4, $5, $6, $7, $8)`,
        [p.run, job.id, job.task_identifier, p.account, name, outcome, newJobId, local],
      )
      .catch((e: Error) => logger.error(`could not record a conflict: ${e.message}`))
      .finally(() => pending.delete(write));
    pending.add(write);
  };
  const locks = makeLocks({ connectionString: url, applicationName: `gwl-demo/${name}`, logger });
  // `local`: the key was held by this very process, so no round trip was needed to know.
  const local = new Map<string, boolean>();
  const takeLocal = (job: Job) =>
    [local.get(job.id) ?? null, local.delete(job.id)][0] as boolean | null;
  locks.events.on("lock:conflict", ({ job, strategy, local: l }) => {
    if (strategy === "raise") recordConflict(job, "raised", null, l);
    else local.set(job.id, l);
  });
  locks.events.on("job:dropped", ({ job }) => recordConflict(job, "dropped", null, takeLocal(job)));
  locks.events.on("job:rescheduled", ({ job, newJobId }) =>
    recordConflict(job, "rescheduled", newJobId, takeLocal(job)),
  );
  // Both ends of the record are written while the wrapper holds the job's lock.
  const taskList = defineTasks(locks, async (task, p, job) => {
    const lockKey = taskList[task].lockKey(p).toString();
    const { rows } = await records.query<{ id: string }>(
      `insert into ${SCHEMA}.executions (run, job_id, task, key, lock_key, worker)
       values ($1, $2, $3, $4, $5, $6) returning id`,
      [p.run, job.id, task, p.account, lockKey, name],
    );
    const [min, max] = TASKS[task].ms;
    await sleep(min + Math.random() * (max - min));
    await records.query(
      `update ${SCHEMA}.executions set ended_at = clock_timestamp() where id = $1`,
      [rows[0]!.id],
    );
  });
  // Rescheduled jobs are due in the future, which graphile-worker finds only by polling: poll often.
  const runner = await run({
    connectionString: url,
    concurrency: CONCURRENCY,
    taskList,
    noHandleSignals: true,
    pollInterval: 100,
    logger,
  });
  const stop = (code: number) =>
    (stopping ??= (async () => {
      setTimeout(() => process.exit(1), 10_000).unref();
      try {
        await runner.stop();
        while (pending.size > 0) await Promise.allSettled([...pending]);
      } finally {
        await locks.release().catch(() => undefined);
        await records.end().catch(() => undefined);
      }
    })()).then(
      () =>
        process.connected ? process.send!("stopped", () => process.exit(code)) : process.exit(code),
      () => process.exit(1),
    );
  process.on("message", (m) => {
    if (m === "stop") void stop(0);
  });
  for (const event of ["disconnect", "SIGINT", "SIGTERM"]) process.on(event, () => void stop(0));
  process.send!("ready");
}

// ---------------------------------------------------------------------------------------------------------
// The demo

/** `via`: graphile-worker's bulk `addJobs` (no check), or one by one through the library, `spacingMs` apart. */
interface Burst {
  at: number;
  task: TaskName;
  accounts: string[];
  copies: number;
  via: "addJobs" | "task.addJob" | "locks.addJob";
  spacingMs?: number;
}
// prettier-ignore
const BURSTS: Burst[] = [
  { at: 0,    task: "send_report",  accounts: ["acme", "globex"], copies: 3,  via: "addJobs" },
  { at: 0,    task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "addJobs" },
  { at: 400,  task: "charge_card",  accounts: ACCOUNTS,           copies: 6,  via: "addJobs" },
  { at: 700,  task: "build_export", accounts: ["acme"],           copies: 20, via: "addJobs" },
  { at: 1200, task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "task.addJob", spacingMs: 20 },
  { at: 1800, task: "charge_card",  accounts: ACCOUNTS,           copies: 4,  via: "task.addJob", spacingMs: 40 },
  { at: 2400, task: "build_export", accounts: ["acme"],           copies: 20, via: "locks.addJob", spacingMs: 15 },
  { at: 3000, task: "sync_account", accounts: ACCOUNTS,           copies: 30, via: "addJobs" },
];

const color = process.stdout.isTTY && !process.env.NO_COLOR;
const paint = (code: string) => (s: string) => (color ? `\x1b[${code}m${s}\x1b[0m` : s);
const [bold, dim, red, green] = [paint("1"), paint("2"), paint("1;31"), paint("1;32")];
const say = (...lines: string[]) =>
  process.stdout.write(`${(lines.length ? lines : [""]).join("\n")}\n`);
const secs = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const pad = (n: number, w: number) => String(n).padStart(w);
type Run = { start: number; end: number; worker: string };
/** The executions of one advisory lock key (what the lock protects). */
type Group = { label: string; task: TaskName; account: string; limit: number; runs: Run[] };

const SCHEMA_SQL = `
  create schema if not exists ${SCHEMA};
  create table if not exists ${SCHEMA}.executions (id bigserial primary key, run text not null,
    job_id bigint not null, task text not null, key text not null, lock_key bigint not null,
    worker text not null, started_at timestamptz not null default clock_timestamp(), ended_at timestamptz);
  create table if not exists ${SCHEMA}.conflicts (id bigserial primary key, run text not null,
    job_id bigint not null, task text not null, key text not null, worker text not null,
    outcome text not null, new_job_id bigint, local boolean, at timestamptz not null default clock_timestamp());`;

let interrupted: NodeJS.Signals | undefined;
const check = () => {
  if (interrupted) throw new Error(`interrupted by ${interrupted}`);
};

async function startWorker(url: string, name: string): Promise<ChildProcess> {
  const child = fork(fileURLToPath(import.meta.url), [], {
    execArgv: ["--import", "tsx"],
    env: { ...process.env, DATABASE_URL: url, DEMO_WORKER: name },
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  await new Promise<void>((resolve, reject) => {
    child.once("message", () => resolve());
    child.once("exit", (code) =>
      reject(new Error(`worker ${name} exited at start (code ${code})`)),
    );
  });
  return child;
}

async function stopWorker(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((resolve) => child.once("exit", resolve));
  child.send("stop");
  if ((await Promise.race([exited, sleep(15_000, "timeout", { ref: false })])) === "timeout") {
    child.kill("SIGKILL");
    await exited;
  }
}

type Tallies = Record<TaskName, { fired: number; droppedAtEnqueue: number; added: string[] }>;

/** Draws each key's executions in lanes (one per concurrent execution), a column per time step. */
function timeline(groups: Group[], originUs: number, burstsMs: number[]): string[] {
  const width = Math.max(...groups.map((g) => g.label.length)) + 1;
  const ms = (us: number) => (us - originUs) / 1000;
  const endMs = Math.max(1, ...burstsMs, ...groups.flatMap((g) => g.runs.map((r) => ms(r.end))));
  const steps = [10, 20, 25, 40, 50, 80, 100, 125, 200, 250, 500, 1000];
  const step = steps.find((s) => endMs / s <= 98 - width) ?? 2000;
  const columns = Math.ceil(endMs / step);
  const tick = [1, 2, 5, 10].find((s) => (s * 1000) / step >= 5) ?? 30;
  let axis = "";
  for (let s = 0; (s * 1000) / step < columns; s += tick)
    axis = axis.padEnd(Math.round((s * 1000) / step)) + `${s}s`;
  const fired = Array<string>(columns).fill(" ");
  for (const t of burstsMs) fired[Math.min(columns - 1, Math.floor(t / step))] = "^";
  const out = [
    `${"".padEnd(width)}  ${axis}`,
    `${"bursts fired".padEnd(width)}  ${fired.join("")}`,
  ];
  for (const g of groups) {
    const lanes: Run[][] = [];
    for (const r of [...g.runs].sort((a, b) => a.start - b.start)) {
      const lane = lanes.find((l) => l.at(-1)!.end <= r.start);
      if (lane) lane.push(r);
      else lanes.push([r]);
    }
    lanes.forEach((lane, i) => {
      // A column shows the worker whose execution covers the largest part of it.
      const cells = Array<string>(columns).fill(dim("."));
      const cover = Array<number>(columns).fill(0);
      for (const r of lane) {
        const [s, e] = [ms(r.start), ms(r.end)];
        for (let c = Math.floor(s / step); c <= Math.min(columns - 1, Math.floor(e / step)); c++) {
          const overlap = Math.min(e, (c + 1) * step) - Math.max(s, c * step);
          if (c >= 0 && overlap > cover[c]!) [cover[c], cells[c]] = [overlap, r.worker];
        }
      }
      const over = i >= g.limit;
      const label = (i === 0 ? g.label : "").padEnd(width);
      out.push(
        `${label}${over ? red("!") : "│"} ${cells.join("")}${over ? red("  <- OVERLAP") : ""}`,
      );
    });
  }
  out.push(
    dim(
      `one column = ${step} ms; ${WORKERS.join("/")} = the worker running a job of the key; . = none`,
    ),
    dim("a key with limit 2 gets two lanes; a lane beyond a key's limit would mean an overlap"),
  );
  return out;
}

interface Execution {
  job_id: string;
  task: TaskName;
  key: string;
  lock_key: string;
  worker: string;
  start: number;
  end: number | null;
}
interface Conflict {
  job_id: string;
  task: TaskName;
  outcome: string;
  new_job_id: string | null;
  local: boolean;
}
const US = (col: string) => `(extract(epoch from ${col}) * 1000000)::float8`;

/** Reads this run's records, prints the timeline and the summary; returns the problems found. */
async function report(
  pool: pg.Pool,
  run: string,
  tallies: Tallies,
  originUs: number,
  at: number[],
) {
  const problems: string[] = [];
  const q = async <T>(sql: string, values: unknown[]) =>
    (await pool.query(sql, values)).rows as T[];
  const executions = await q<Execution>(
    `select job_id::text, task, key, lock_key::text, worker, ${US("started_at")} as start,
            ${US("ended_at")} as end from ${SCHEMA}.executions where run = $1 order by started_at`,
    [run],
  );
  const conflicts = await q<Conflict>(
    `select job_id::text, task, outcome, new_job_id::text, local from ${SCHEMA}.conflicts
      where run = $1 order by id`,
    [run],
  );
  // Every job of this run: those added, and the copies rescheduling made.
  const jobs = new Map(NAMES.flatMap((t) => tallies[t].added.map((id) => [id, t] as const)));
  for (const c of conflicts) if (c.new_job_id) jobs.set(c.new_job_id, c.task);
  const queued = new Map(
    (
      await q<{ id: string; attempts: number; last_error: string | null }>(
        "select id::text, attempts, last_error from graphile_worker.jobs where id = any($1::bigint[])",
        [[...jobs.keys()]],
      )
    ).map((r) => [r.id, r]),
  );
  // A raised job is retried under the same id, so "raised" is not an outcome of the job.
  const outcomes = new Map<string, string[]>();
  const add = (id: string, o: string) => outcomes.set(id, [...(outcomes.get(id) ?? []), o]);
  for (const e of executions) add(e.job_id, e.end === null ? "unfinished" : "executed");
  for (const c of conflicts) if (c.outcome !== "raised") add(c.job_id, c.outcome);
  const awaiting = Object.fromEntries(NAMES.map((t) => [t, 0])) as Record<TaskName, number>;
  for (const [id, task] of jobs) {
    const [o, waiting, job] = [outcomes.get(id) ?? [], queued.get(id), `job ${id} (${task})`];
    if (o.includes("unfinished")) problems.push(`${job} started but never finished`);
    if (o.length > 1) problems.push(`${job} has ${o.length} outcomes: ${o.join(", ")}`);
    if (waiting && TASKS[task].options.onConflict === "raise" && waiting.attempts > 0 && !o.length)
      awaiting[task]++;
    else if (waiting)
      problems.push(`${job} is still queued (attempts ${waiting.attempts}, ${waiting.last_error})`);
    else if (o.length === 0)
      problems.push(`${job} is unaccounted for: not executed, dropped nor rescheduled`);
  }
  for (const id of new Set([...executions, ...conflicts].map((r) => r.job_id)))
    if (!jobs.has(id)) problems.push(`job ${id} has records but the demo never added it`);

  // Grouped by the advisory lock key itself: that is what the lock protects.
  const byKey = new Map<string, Group>();
  for (const e of executions) {
    if (e.end === null) continue;
    const id = `${e.task} ${e.lock_key}`;
    const label = `${e.task} ${e.key}`;
    if (!byKey.has(id))
      byKey.set(id, { label, task: e.task, account: e.key, limit: limitOf(e.task), runs: [] });
    byKey.get(id)!.runs.push({ start: e.start, end: e.end, worker: e.worker });
  }
  const order = (g: Group) => NAMES.indexOf(g.task) * 100 + ACCOUNTS.indexOf(g.account);
  const groups = [...byKey.values()].sort((a, b) => order(a) - order(b));
  say("", bold("Timeline per key"), ...timeline(groups, originUs, at));

  const count = (t: TaskName, outcome: string) =>
    conflicts.filter((c) => c.task === t && c.outcome === outcome).length;
  const executedOf = (t: TaskName) => executions.filter((e) => e.task === t && e.end !== null);
  // prettier-ignore
  const rows: Array<[string, string, ...number[]]> = NAMES.map((t) => [t, strategyOf(t), tallies[t].fired, tallies[t].droppedAtEnqueue, tallies[t].added.length, count(t, "dropped"), count(t, "rescheduled"), count(t, "raised"), executedOf(t).length, awaiting[t]]);
  const sums = [2, 3, 4, 5, 6, 7, 8, 9].map((i) => rows.reduce((n, r) => n + (r[i] as number), 0));
  const [fired, atEnqueue, added, dropped, rescheduled, raised, executed, awaitingRetry] = sums as [
    number,
    number,
    number,
    number,
    number,
    number,
    number,
    number,
  ];
  const widths = [8, 8, 7, 9, 9, 7, 9, 6];
  const copies = conflicts.filter((c) => c.new_job_id).length;
  const perWorker = WORKERS.map(
    (w) => `worker ${w}: ${executions.filter((e) => e.worker === w).length}`,
  );
  // prettier-ignore
  say(
    "",
    bold("Summary"),
    dim("                                      dropped at          conflicts at run time            awaiting"),
    dim("task          strategy        enqueued  enqueue   added   dropped  resched.  raised  executed  retry"),
    ...[...rows, ["total", "", ...sums] as typeof rows[number]].map(([label, strategy, ...n]) =>
      `${label.padEnd(13)} ${strategy.padEnd(15)} ${n.map((v, i) => pad(v, widths[i]!)).join(" ")}`),
    "",
    `  enqueued:              ${pad(fired, 4)} jobs fired, ${added} added`,
    `  dropped at enqueue:    ${pad(atEnqueue, 4)} (the preemptive check found the key held)`,
    `  conflicts at run time: ${pad(dropped + rescheduled + raised, 4)} (dropped ${dropped}, rescheduled ${rescheduled}, raised ${raised})`,
    dim(`                              ${conflicts.filter((c) => c.local).length} of them noticed in-process, without a round trip`),
    `  executed:              ${pad(executed, 4)} (${perWorker.join(", ")})`,
    `  awaiting retry:        ${pad(awaitingRetry, 4)} (raised, next attempt due after the demo: removed)`,
    `  accounted for:         ${pad(added + copies, 4)} jobs = ${added} added + ${copies} rescheduled copies`,
    `                              = ${executed} executed + ${dropped} dropped + ${rescheduled} rescheduled + ${awaitingRetry} awaiting retry`,
    dim("  (graphile-worker retries a raised job with its own backoff, e^attempts seconds: 2.7, 7.4, 20, ...)"),
    "",
    bold("Highest concurrency per key (sweep over the start and end instants of the execution records)"),
  );
  if (executed + dropped + rescheduled + awaitingRetry !== added + copies)
    problems.push("the totals do not add up (see above)");
  for (const g of groups) {
    const highest = highestConcurrency(g.runs);
    const verdict =
      highest <= g.limit ? green("ok") : red(`OVERLAP: above the limit of ${g.limit}`);
    // prettier-ignore
    say(`  highest concurrency  ${g.task.padEnd(13)} ${g.account.padEnd(8)} ${highest} (limit ${g.limit})  ${pad(g.runs.length, 3)} executions  ${verdict}`);
    if (highest > g.limit)
      problems.push(`${g.label} ran ${highest} jobs at once, above its limit of ${g.limit}`);
  }
  if (dropped + rescheduled + raised === 0)
    say(dim("  (no conflicts happened this time: the machine was too fast to contend)"));
  return problems;
}

async function main(): Promise<number> {
  const t0 = performance.now();
  const elapsed = () => secs(performance.now() - t0);
  const cleanups: Array<() => Promise<unknown>> = [];
  const problems: string[] = [];
  for (const signal of ["SIGINT", "SIGTERM"] as const)
    process.once(signal, () => {
      interrupted = signal;
      console.error(red(`\n${signal}: stopping the demo and cleaning up`));
    });
  say(bold("graphile-worker-locks demo"));
  try {
    const postgres = await startPostgres({ envVar: "DATABASE_URL" });
    cleanups.push(() => postgres.stop());
    const url = new URL(postgres.url);
    say(
      process.env.DATABASE_URL
        ? `  PostgreSQL: DATABASE_URL (${url.host}${url.pathname})`
        : `  PostgreSQL: embedded, in a temp dir, ready at ${elapsed()}`,
    );
    const logger = makeLogger("[demo]", () => false);
    await runMigrations({ connectionString: postgres.url, logger });
    const pool = new pg.Pool({
      connectionString: postgres.url,
      max: 10,
      application_name: "gwl-demo",
    });
    pool.on("error", () => undefined);
    pool.on("connect", (client) => client.on("error", () => undefined));
    cleanups.push(() => pool.end());
    await pool.query(SCHEMA_SQL);
    const utils = await makeWorkerUtils({ pgPool: pool, logger });
    cleanups.push(async () => utils.release());
    const locks = makeLocks({ pgPool: pool, applicationName: "gwl-demo", logger });
    cleanups.push(() => locks.release());
    await locks.migrate(); // before the workers start, so that they do not race to install it
    // The workers' definitions, for `task.addJob`'s preemptive check; never run here.
    const tasks = defineTasks(locks, () => Promise.reject(new Error("tasks run in the workers")));
    say(`  Schemas: graphile-worker, graphile-worker-locks and ${SCHEMA} ready at ${elapsed()}`);

    const run = randomBytes(4).toString("hex");
    const tallies = Object.fromEntries(
      NAMES.map((t) => [t, { fired: 0, droppedAtEnqueue: 0, added: [] }]),
    ) as unknown as Tallies;
    // Runs after the workers stopped: this run's jobs still queued (late retries) are removed.
    cleanups.push(async () => {
      const { rows } = await pool.query<{ id: string }>(
        `select new_job_id::text as id from ${SCHEMA}.conflicts where run = $1 and new_job_id is not null`,
        [run],
      );
      const ids = [...NAMES.flatMap((t) => tallies[t].added), ...rows.map((r) => r.id)];
      if (ids.length > 0) await utils.completeJobs(ids);
    });
    const workers: ChildProcess[] = [];
    cleanups.push(() => Promise.all(workers.map(stopWorker)));
    const starts = await Promise.allSettled(
      WORKERS.map(async (w) => (workers[Number(w) - 1] = await startWorker(postgres.url, w))),
    );
    for (const s of starts) if (s.status === "rejected") throw s.reason;
    check();
    say(
      `  Workers: ${workers.length} processes × concurrency ${CONCURRENCY}, ready at ${elapsed()}`,
    );
    say("  Tasks (each keyed by the account of its payload):");
    for (const t of NAMES)
      say(
        `    ${t.padEnd(13)} ${`"${strategyOf(t)}`.replace(/(,|$)/, '"$1').padEnd(16)} ${dim(TASKS[t].description)}`,
      );

    say();
    say(bold(`Firing bursts of duplicate jobs (run ${run})`));
    const originUs = (
      await pool.query<{ us: number }>(
        `select ${"(extract(epoch from clock_timestamp()) * 1000000)::float8"} as us`,
      )
    ).rows[0]!.us;
    const first = performance.now();
    const fire = async (b: Burst): Promise<string> => {
      const tally = tallies[b.task];
      const what =
        `${b.accounts.length} key${b.accounts.length > 1 ? "s" : ""} × ${b.copies}`.padEnd(11);
      const payloads = b.accounts.map((account) => ({ account, run }));
      if (b.via === "addJobs") {
        const specs = payloads.flatMap((payload) =>
          Array.from({ length: b.copies }, () => ({ identifier: b.task, payload })),
        );
        const jobs = await utils.addJobs(specs);
        tally.fired += specs.length;
        tally.added.push(...jobs.map((j) => j.id));
        return `${what} ${"utils.addJobs (bulk)".padEnd(29)} ${jobs.length} added`;
      }
      let [added, dropped] = [0, 0];
      await Promise.all(
        payloads.map(async (payload) => {
          for (let i = 0; i < b.copies; i++) {
            if (i > 0) await sleep(b.spacingMs ?? 0);
            check();
            const { job } =
              b.via === "task.addJob"
                ? await tasks[b.task].addJob(payload)
                : await locks.addJob(b.task, payload);
            tally.fired++;
            if (!job) dropped++;
            else if (++added) tally.added.push(job.id);
          }
        }),
      );
      tally.droppedAtEnqueue += dropped;
      return `${what} ${`${b.via}, ${b.spacingMs ?? 0} ms apart`.padEnd(29)} ${added} added, ${dropped} dropped at enqueue`;
    };
    // allSettled: on a failure, the other bursts must be done with the pool before the cleanup ends it.
    const firing = await Promise.allSettled(
      BURSTS.map(async (b) => {
        await sleep(Math.max(0, b.at - (performance.now() - first)));
        check();
        const at = performance.now() - first;
        return { at, line: `  +${secs(at).padStart(6)}  ${b.task.padEnd(13)} ${await fire(b)}` };
      }),
    );
    const fired = firing.map((r) => {
      if (r.status === "rejected") throw r.reason;
      return r.value;
    });
    for (const { line } of fired.sort((a, b) => a.at - b.at)) say(line);

    // Settled when only raised jobs whose retry is due after the horizon remain (counted by creation
    // time: a rescheduled copy is queued before the conflict record naming it is written).
    const raising = NAMES.filter((t) => TASKS[t].options.onConflict === "raise");
    let settled = false;
    while (!settled && performance.now() - first < SETTLE_DEADLINE_MS) {
      check();
      if (workers.some((w) => w.exitCode !== null)) throw new Error("a worker exited unexpectedly");
      const { rows } = await pool.query<{ queued: number; deferred: number }>(
        `select count(*)::int as queued, count(*) filter (where task_identifier = any($2) and attempts > 0
                and locked_at is null and run_at > to_timestamp($3::float8 / 1000000))::int as deferred
           from graphile_worker.jobs where task_identifier = any($1) and created_at >= to_timestamp($4::float8 / 1000000)`,
        [NAMES, raising, originUs + RETRY_HORIZON_MS * 1000, originUs],
      );
      settled = rows[0]!.queued === rows[0]!.deferred;
      if (!settled) await sleep(100);
    }
    const settleLine = settled
      ? `  Queue settled ${secs(performance.now() - first)} after the first burst; stopping the workers`
      : red(`  The queue did not settle within ${secs(SETTLE_DEADLINE_MS)}; stopping the workers`);
    say(settleLine);
    await Promise.all(workers.map(stopWorker));
    problems.push(
      ...(await report(
        pool,
        run,
        tallies,
        originUs,
        fired.map((f) => f.at),
      )),
    );
    if (!settled) problems.push(`the queue did not settle within ${secs(SETTLE_DEADLINE_MS)}`);
  } catch (error) {
    if (!interrupted)
      problems.push(
        `the demo failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}`,
      );
  } finally {
    for (const cleanup of cleanups.reverse()) {
      // After an interruption PostgreSQL may be gone already: cleaning up is best effort then.
      await cleanup().catch(
        (e: unknown) => interrupted || problems.push(`cleanup failed: ${String(e)}`),
      );
    }
  }
  say();
  if (interrupted) {
    say(red(`Interrupted by ${interrupted}; cleaned up.`));
    return interrupted === "SIGINT" ? 130 : 143;
  }
  if (problems.length > 0) {
    say(red("!!! DEMO FAILED !!!"));
    for (const p of problems) say(red(`  - ${p}`));
    return 1;
  }
  say(
    green(
      `OK: no key ran more jobs at once than its limit, and every job is accounted for (${elapsed()}).`,
    ),
  );
  return 0;
}

if (process.env.DEMO_WORKER) {
  await worker(process.env.DEMO_WORKER, process.env.DATABASE_URL!).catch((error: unknown) => {
    console.error(`[worker ${process.env.DEMO_WORKER}] failed:`, error);
    process.exit(1);
  });
} else {
  process.exitCode = await main();
  // Everything is closed by now; do not hang on a stray handle.
  setTimeout(() => process.exit(process.exitCode ?? 1), 5_000).unref();
}
