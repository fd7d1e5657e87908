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
import { once } from "node:events";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { Logger, makeWorkerUtils, run, runMigrations, type Job } from "graphile-worker";
import pg from "pg";
import { ErrorCodes, makeLocks, type ExclusiveOptions, type Locks } from "../src/index.js";
import { highestConcurrency } from "./overlap.js";
import { startPostgres } from "./postgres.js";

const SCHEMA = "gwl_demo";
const WORKERS = ["1", "2", "3"];
const CONCURRENCY = 4;
const ACCOUNTS = ["acme", "globex", "initech"];
/** Raised jobs retry after e^attempts s; retries due later than this after the first burst are left. */
const RETRY_HORIZON_MS = 6_000;
const SETTLE_DEADLINE_MS = 15_000;

/** Every task is keyed by the account; `run` tells this run's jobs and records from another's. */
type Payload = { account: string; run: string };
const key = (p: Payload) => p.account;
/** A task's options besides its key, the range of an execution's duration (ms), and what it shows. */
type TaskSpec = { options: ExclusiveOptions<Payload>; ms: [number, number]; about: string };
/** A rescheduled job starts as soon as its key is released; these delays are only a safety net. */
const RESCHEDULE = { minDelay: 20, maxDelay: 200, jitter: 0.5 };
// prettier-ignore
const TASKS = {
  sync_account: { options: { onConflict: "drop" }, ms: [30, 80],
    about: "a duplicate sync is redundant: dropped" },
  charge_card: { options: { onConflict: "reschedule", reschedule: RESCHEDULE }, ms: [40, 120],
    about: "all charges run, one at a time; a waiting one starts as soon as the key frees" },
  send_report: { options: { onConflict: "raise" }, ms: [100, 150],
    about: "throws a LockConflictError; graphile-worker retries the job" },
  build_export: { options: { onConflict: "drop", limit: 2 }, ms: [60, 150],
    about: "at most two per account at once; a third is dropped" },
} satisfies Record<string, TaskSpec>;
type TaskName = keyof typeof TASKS;
const NAMES = Object.keys(TASKS) as TaskName[];
const limitOf = (t: TaskName) => ((TASKS[t].options as ExclusiveOptions).limit as number) ?? 1;
/** `drop, limit 2`, or `"drop", limit 2` with the quote `"`. */
const strategyOf = (t: TaskName, quote = "") =>
  `${quote}${TASKS[t].options.onConflict}${quote}${limitOf(t) > 1 ? `, limit ${limitOf(t)}` : ""}`;

/** The tasks of TASKS, exclusive per account; `body` runs their jobs. */
function defineTasks(locks: Locks, body: (t: TaskName, p: Payload, job: Job) => Promise<void>) {
  const define = (t: TaskName) =>
    locks.exclusive<Payload>(t, (p, h) => body(t, p, h.job), { key, ...TASKS[t].options });
  return Object.fromEntries(NAMES.map((t) => [t, define(t)])) as {
    [T in TaskName]: ReturnType<typeof define>;
  };
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
  let stopping: Promise<unknown> | undefined;
  const logger = makeLogger(`[worker ${name}]`, () => stopping !== undefined);
  const db = new pg.Pool({ connectionString: url, max: CONCURRENCY + 2 });
  db.on("error", () => undefined);
  const locks = makeLocks({ connectionString: url, applicationName: `gwl-demo/${name}`, logger });
  // Listeners are synchronous: conflicts are recorded in the background, and stopping awaits them.
  const pending = new Set<Promise<unknown>>();
  // `local`: the key was held by this very process, so no round trip was needed to know.
  const local = new Map<string, boolean>();
  const recordConflict = (job: Job, outcome: string, newJobId: string | null = null) => {
    const { run, account } = job.payload as Payload;
    const write = db
      .query(
        `insert into ${SCHEMA}.conflicts (run, job_id, task, key, worker, outcome, new_job_id, local)
         values ($1, $2, $3, $4, $5, $6, $7, $8)`,
        [run, job.id, job.task_identifier, account, name, outcome, newJobId, local.get(job.id)],
      )
      .catch((e: Error) => logger.error(`could not record a conflict: ${e.message}`))
      .finally(() => pending.delete(write));
    pending.add(write);
    local.delete(job.id);
  };
  locks.events.on("lock:conflict", ({ job, strategy, local: isLocal }) => {
    local.set(job.id, isLocal);
    if (strategy === "raise") recordConflict(job, "raised");
  });
  locks.events.on("job:dropped", ({ job }) => recordConflict(job, "dropped"));
  locks.events.on("job:rescheduled", ({ job, newJobId }) => {
    recordConflict(job, "rescheduled", newJobId);
  });
  // Both ends of the record are written while the wrapper holds the job's lock.
  const taskList = defineTasks(locks, async (task, p, job) => {
    const { rows } = await db.query<{ id: string }>(
      `insert into ${SCHEMA}.executions (run, job_id, task, key, lock_key, worker)
       values ($1, $2, $3, $4, $5, $6) returning id`,
      [p.run, job.id, task, p.account, taskList[task].lockKey(p).toString(), name],
    );
    const [min, max] = TASKS[task].ms;
    await sleep(min + Math.random() * (max - min));
    const end = `update ${SCHEMA}.executions set ended_at = clock_timestamp() where id = $1`;
    await db.query(end, [rows[0]!.id]);
  });
  // Rescheduled jobs are due in the future, which graphile-worker finds only by polling: poll often.
  const options = { concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 100 };
  const runner = await run({ ...options, connectionString: url, taskList, logger });
  const stop = async () => {
    if (stopping) return;
    setTimeout(() => process.exit(1), 10_000).unref();
    stopping = runner.stop().then(async () => {
      while (pending.size > 0) await Promise.allSettled([...pending]);
    });
    const failed = await stopping.catch(() => true);
    await locks.release().catch(() => undefined);
    await db.end().catch(() => undefined);
    process.exit(failed ? 1 : 0);
  };
  process.on("message", (m) => m === "stop" && void stop());
  for (const event of ["disconnect", "SIGINT", "SIGTERM"]) process.on(event, () => void stop());
  process.send!("ready");
}

// ---------------------------------------------------------------------------------------------------------
// The demo

/** `via`: graphile-worker's bulk `addJobs` (no check), or one by one through the library, `spacingMs` apart. */
type Burst = { at: number; task: TaskName; accounts: string[]; copies: number } & (
  { via: "addJobs" } | { via: "task.addJob" | "locks.addJob"; spacingMs: number }
);
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
/** A job a burst enqueued: its id, or null when the preemptive check dropped it. */
type Enqueued = { burst: Burst; id: string | null };

const color = process.stdout.isTTY && !process.env.NO_COLOR;
const paint = (code: string) => (s: string) => (color ? `\x1b[${code}m${s}\x1b[0m` : s);
const [bold, dim, red, green] = [paint("1"), paint("2"), paint("1;31"), paint("1;32")];
const say = (...lines: string[]) => process.stdout.write(`${lines.join("\n")}\n`);
const secs = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const pad = (n: number | string, width: number) => String(n).padStart(width);

const SCHEMA_SQL = `
  create schema if not exists ${SCHEMA};
  create table if not exists ${SCHEMA}.executions (id bigserial primary key, run text not null,
    job_id bigint not null, task text not null, key text not null, lock_key bigint not null,
    worker text not null, started_at timestamptz not null default clock_timestamp(), ended_at timestamptz);
  create table if not exists ${SCHEMA}.conflicts (id bigserial primary key, run text not null,
    job_id bigint not null, task text not null, key text not null, worker text not null,
    outcome text not null, new_job_id bigint, local boolean, at timestamptz not null default clock_timestamp());`;
/** A timestamp in microseconds since the epoch. */
const US = (col: string) => `(extract(epoch from ${col}) * 1000000)::float8`;

let interrupted: NodeJS.Signals | undefined;
const check = () => {
  if (interrupted) throw new Error(`interrupted by ${interrupted}`);
};
/** Promise.all that lets every promise settle before it throws: none may outlive the cleanup. */
async function all<T>(promises: Array<Promise<T>>): Promise<T[]> {
  const results = await Promise.allSettled(promises);
  for (const r of results) if (r.status === "rejected") throw r.reason;
  return results.map((r) => (r as PromiseFulfilledResult<T>).value);
}

async function startWorker(url: string, name: string): Promise<ChildProcess> {
  const child = fork(fileURLToPath(import.meta.url), [], {
    execArgv: ["--import", "tsx"],
    env: { ...process.env, DATABASE_URL: url, DEMO_WORKER: name },
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const exit = once(child, "exit").then(
    ([code]) => `worker ${name} exited at start (code ${code})`,
  );
  const failure = await Promise.race([once(child, "message").then(() => null), exit]);
  if (failure) throw new Error(failure);
  return child;
}

async function stopWorker(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const kill = setTimeout(() => child.kill("SIGKILL"), 15_000);
  child.send("stop");
  await once(child, "exit");
  clearTimeout(kill);
}

type Run = { start: number; end: number; worker: string };
/** The executions of one advisory lock key (what the lock protects). */
type Group = { task: TaskName; account: string; limit: number; runs: Run[] };
const labelOf = (g: Group) => `${g.task} ${g.account}`;

/** Draws each key's executions in lanes (one per concurrent execution), a column per time step. */
function timeline(groups: Group[], originUs: number, firedAtMs: number[]): string[] {
  const width = Math.max(...groups.map((g) => labelOf(g).length)) + 1;
  const ms = (us: number) => (us - originUs) / 1000;
  const endMs = Math.max(1, ...firedAtMs, ...groups.flatMap((g) => g.runs.map((r) => ms(r.end))));
  const steps = [10, 20, 25, 40, 50, 80, 100, 125, 200, 250, 500, 1000];
  const step = steps.find((s) => endMs / s <= 98 - width) ?? 2000;
  const columns = Math.ceil(endMs / step);
  const tick = [1, 2, 5, 10].find((s) => (s * 1000) / step >= 5) ?? 30;
  let axis = "";
  for (let s = 0; (s * 1000) / step < columns; s += tick)
    axis = axis.padEnd(Math.round((s * 1000) / step)) + `${s}s`;
  const fired = Array<string>(columns).fill(" ");
  for (const t of firedAtMs) fired[Math.min(columns - 1, Math.floor(t / step))] = "^";
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
      const [label, over] = [(i === 0 ? labelOf(g) : "").padEnd(width), i >= g.limit];
      out.push(
        `${label}${over ? red("!") : "│"} ${cells.join("")}${over ? red("  <- OVERLAP") : ""}`,
      );
    });
  }
  return [
    ...out,
    dim(
      `one column = ${step} ms; ${WORKERS.join("/")} = the worker running a job of the key; . = none`,
    ),
    dim("a key with limit 2 gets two lanes; a lane beyond a key's limit would mean an overlap"),
  ];
}

/** The summary's columns of counts, in order, with their widths, under the two lines of HEADINGS. */
// prettier-ignore
const COLUMNS = { fired: 8, atEnqueue: 8, added: 7, dropped: 9, rescheduled: 9, raised: 7, executed: 9, awaiting: 6 };
const HEADINGS = [
  "                                      dropped at          conflicts at run time            awaiting",
  "task          strategy        enqueued  enqueue   added   dropped  resched.  raised  executed  retry",
];
type Column = keyof typeof COLUMNS;
type Row = { job: string; task: TaskName; worker: string };
type Execution = Row & { account: string; lock: string; start: number; end: number | null };
type Conflict = Row & { outcome: "dropped" | "rescheduled" | "raised"; copy: string | null };

/** Reads this run's records, prints the timeline and the summary; returns the problems found. */
async function report(
  pool: pg.Pool,
  run: string,
  enqueued: Enqueued[],
  originUs: number,
  firedAtMs: number[],
): Promise<string[]> {
  const problems: string[] = [];
  const { rows: executions } = await pool.query<Execution>(
    `select job_id::text as job, task, worker, key as account, lock_key::text as lock,
            ${US("started_at")} as start, ${US("ended_at")} as end
       from ${SCHEMA}.executions where run = $1 order by started_at`,
    [run],
  );
  const { rows: conflicts } = await pool.query<Conflict & { local: boolean }>(
    `select job_id::text as job, task, worker, outcome, new_job_id::text as copy, local
       from ${SCHEMA}.conflicts where run = $1 order by id`,
    [run],
  );
  // The summary's counts, an entry [task, column] each: every enqueue, every raised conflict, and the
  // outcome of every job. A raised job is retried under the same id, so "raised" is not an outcome.
  const tally: Array<[TaskName, Column]> = [];
  for (const { burst, id } of enqueued)
    tally.push([burst.task, "fired"], [burst.task, id ? "added" : "atEnqueue"]);
  for (const c of conflicts) if (c.outcome === "raised") tally.push([c.task, "raised"]);

  // Every job of this run (those added, and the copies rescheduling made) has exactly one outcome:
  // executed, dropped, rescheduled, or awaiting its retry (a raised job still queued).
  const jobs = new Map<string, TaskName>();
  for (const { burst, id } of enqueued) if (id) jobs.set(id, burst.task);
  for (const c of conflicts) if (c.copy) jobs.set(c.copy, c.task);
  const { rows: queued } = await pool.query<{ id: string; attempts: number; error: string }>(
    "select id::text, attempts, last_error as error from graphile_worker.jobs where id = any($1)",
    [[...jobs.keys()]],
  );
  const outcomes = new Map<string, string[]>();
  const add = (id: string, o: string) => outcomes.set(id, [...(outcomes.get(id) ?? []), o]);
  for (const e of executions)
    add(e.job, e.end === null ? "started but never finished" : "executed");
  for (const c of conflicts) if (c.outcome !== "raised") add(c.job, c.outcome);
  for (const { id, attempts, error } of queued)
    add(
      id,
      TASKS[jobs.get(id)!].options.onConflict === "raise" && attempts > 0
        ? "awaiting"
        : `is still queued (attempts ${attempts}, ${error})`,
    );
  for (const [id, task] of jobs) {
    const [o = "is unaccounted for: not executed, dropped nor rescheduled", ...more] =
      outcomes.get(id) ?? [];
    const job = `job ${id} (${task})`;
    if (more.length > 0)
      problems.push(`${job} has ${more.length + 1} outcomes: ${[o, ...more].join(", ")}`);
    else if (o in COLUMNS) tally.push([task, o as Column]);
    else problems.push(`${job} ${o}`);
  }
  for (const id of new Set([...executions, ...conflicts].map((r) => r.job)))
    if (!jobs.has(id)) problems.push(`job ${id} has records but the demo never added it`);

  // Grouped by the advisory lock key itself: that is what the lock protects.
  const byKey = new Map<string, Group>();
  for (const { task, account, lock, worker, start, end } of executions) {
    if (end === null) continue;
    const id = `${task} ${lock}`;
    if (!byKey.has(id)) byKey.set(id, { task, account, limit: limitOf(task), runs: [] });
    byKey.get(id)!.runs.push({ start, end, worker });
  }
  const order = (g: Group) => NAMES.indexOf(g.task) * 100 + ACCOUNTS.indexOf(g.account);
  const groups = [...byKey.values()].sort((a, b) => order(a) - order(b));
  say("", bold("Timeline per key"), ...timeline(groups, originUs, firedAtMs));

  const n = (column: Column, task?: TaskName) =>
    tally.filter(([t, c]) => c === column && (task ?? t) === t).length;
  const row = (label: string, strategy: string, task?: TaskName) =>
    `${label.padEnd(13)} ${strategy.padEnd(15)} ${Object.entries(COLUMNS)
      .map(([column, width]) => pad(n(column as Column, task), width))
      .join(" ")}`;
  const atRunTime = n("dropped") + n("rescheduled") + n("raised");
  const copies = conflicts.filter((c) => c.copy).length;
  const local = conflicts.filter((c) => c.local).length;
  const perWorker = WORKERS.map(
    (w) => `worker ${w}: ${executions.filter((e) => e.worker === w).length}`,
  );
  // prettier-ignore
  const facts: Array<[string, number | "", string]> = [
    ["enqueued", n("fired"), `jobs fired, ${n("added")} added`],
    ["dropped at enqueue", n("atEnqueue"), "(the preemptive check found the key held)"],
    ["conflicts at run time", atRunTime, `(dropped ${n("dropped")}, rescheduled ${n("rescheduled")}, raised ${n("raised")})`],
    ["", "", dim(`${local} of them noticed in-process, without a round trip`)],
    ["executed", n("executed"), `(${perWorker.join(", ")})`],
    ["awaiting retry", n("awaiting"), "(raised, next attempt due after the demo: removed)"],
    ["accounted for", n("added") + copies, `jobs = ${n("added")} added + ${copies} rescheduled copies`],
    ["", "", `= ${n("executed")} executed + ${n("dropped")} dropped + ${n("rescheduled")} rescheduled + ${n("awaiting")} awaiting retry`],
  ];
  say(
    "",
    bold("Summary"),
    ...HEADINGS.map(dim),
    ...NAMES.map((t) => row(t, strategyOf(t), t)),
    row("total", ""),
    "",
    ...facts.map(
      ([label, n, text]) => `  ${(label && `${label}:`).padEnd(22)} ${pad(n, 4)} ${text}`,
    ),
    dim(
      "  (graphile-worker retries a raised job with its own backoff, e^attempts seconds: 2.7, 7.4, 20, ...)",
    ),
    "",
    bold(
      "Highest concurrency per key (sweep over the start and end instants of the execution records)",
    ),
  );
  if (n("executed") + n("dropped") + n("rescheduled") + n("awaiting") !== n("added") + copies)
    problems.push("the totals do not add up (see above)");
  for (const g of groups) {
    const highest = highestConcurrency(g.runs);
    const ok = highest <= g.limit;
    const figures = `${highest} (limit ${g.limit})  ${pad(g.runs.length, 3)} executions`;
    const verdict = ok ? green("ok") : red(`OVERLAP: above the limit of ${g.limit}`);
    say(
      `  highest concurrency  ${g.task.padEnd(13)} ${g.account.padEnd(8)} ${figures}  ${verdict}`,
    );
    if (!ok)
      problems.push(`${labelOf(g)} ran ${highest} jobs at once, above its limit of ${g.limit}`);
  }
  if (atRunTime === 0)
    say(dim("  (no conflicts happened this time: the machine was too fast to contend)"));
  return problems;
}

async function main(): Promise<number> {
  const t0 = performance.now();
  const elapsed = () => secs(performance.now() - t0);
  const problems: string[] = [];
  const cleanups: Array<() => Promise<unknown>> = [];
  /** Registers the cleanup of `value`; the cleanups run in reverse order at the end. */
  const keep = <T>(value: T, cleanup: (value: T) => Promise<unknown>) => {
    cleanups.push(() => cleanup(value));
    return value;
  };
  for (const signal of ["SIGINT", "SIGTERM"] as const)
    process.once(signal, () => {
      interrupted = signal;
      console.error(red(`\n${signal}: stopping the demo and cleaning up`));
    });
  say(bold("graphile-worker-locks demo"));
  try {
    const postgres = keep(await startPostgres({ envVar: "DATABASE_URL" }), (p) => p.stop());
    const { host, pathname } = new URL(postgres.url);
    say(
      process.env.DATABASE_URL
        ? `  PostgreSQL: DATABASE_URL (${host}${pathname})`
        : `  PostgreSQL: embedded, in a temp dir, ready at ${elapsed()}`,
    );
    const logger = makeLogger("[demo]", () => false);
    await runMigrations({ connectionString: postgres.url, logger });
    const pool = keep(
      new pg.Pool({ connectionString: postgres.url, application_name: "gwl-demo" }),
      (p) => p.end(),
    );
    pool.on("error", () => undefined);
    pool.on("connect", (client) => client.on("error", () => undefined));
    await pool.query(SCHEMA_SQL);
    const utils = keep(await makeWorkerUtils({ pgPool: pool, logger }), async (u) => u.release());
    const locks = keep(makeLocks({ pgPool: pool, applicationName: "gwl-demo", logger }), (l) =>
      l.release(),
    );
    await locks.migrate(); // before the workers start, so that they do not race to install it
    // The workers' definitions, for `task.addJob`'s preemptive check; never run here.
    const tasks = defineTasks(locks, () => Promise.reject(new Error("tasks run in the workers")));
    say(`  Schemas: graphile-worker, graphile-worker-locks and ${SCHEMA} ready at ${elapsed()}`);

    const run = randomBytes(4).toString("hex");
    const enqueued: Enqueued[] = [];
    // Runs after the workers stopped: this run's jobs still queued (late retries) are removed.
    cleanups.push(async () => {
      const { rows } = await pool.query<{ id: string }>(
        `select new_job_id::text as id from ${SCHEMA}.conflicts where run = $1 and new_job_id is not null`,
        [run],
      );
      const ids = [...enqueued.flatMap((e) => e.id ?? []), ...rows.map((r) => r.id)];
      if (ids.length > 0) await utils.completeJobs(ids);
    });
    const workers = keep<ChildProcess[]>([], (all) => Promise.all(all.map(stopWorker)));
    await all(WORKERS.map(async (w, i) => (workers[i] = await startWorker(postgres.url, w))));
    check();
    say(
      `  Workers: ${workers.length} processes × concurrency ${CONCURRENCY}, ready at ${elapsed()}`,
      "  Tasks (each keyed by the account of its payload):",
      ...NAMES.map(
        (t) => `    ${t.padEnd(13)} ${strategyOf(t, '"').padEnd(16)} ${dim(TASKS[t].about)}`,
      ),
      "",
      bold(`Firing bursts of duplicate jobs (run ${run})`),
    );

    /** Fires a burst: in one `addJobs` call, or each key's copies one by one; says what it did. */
    const fire = async (b: Burst) => {
      const payloads = b.accounts.map((account) => ({ account, run }));
      if (b.via === "addJobs") {
        const specs = payloads.flatMap((payload) =>
          Array(b.copies).fill({ identifier: b.task, payload }),
        );
        for (const { id } of await utils.addJobs(specs)) enqueued.push({ burst: b, id });
      } else {
        const addJob = (p: Payload) =>
          b.via === "task.addJob" ? tasks[b.task].addJob(p) : locks.addJob(b.task, p);
        const oneByOne = async (payload: Payload) => {
          for (let i = 0; i < b.copies; i++) {
            if (i > 0) await sleep(b.spacingMs);
            check();
            enqueued.push({ burst: b, id: (await addJob(payload)).job?.id ?? null });
          }
        };
        await all(payloads.map(oneByOne));
      }
      const ids = enqueued.filter((e) => e.burst === b).map((e) => e.id);
      const added = ids.filter((id) => id !== null).length;
      const what = `${b.accounts.length} key${b.accounts.length > 1 ? "s" : ""} × ${b.copies}`;
      return b.via === "addJobs"
        ? `${what.padEnd(11)} ${"utils.addJobs (bulk)".padEnd(29)} ${added} added`
        : `${what.padEnd(11)} ${`${b.via}, ${b.spacingMs} ms apart`.padEnd(29)} ${added} added, ${ids.length - added} dropped at enqueue`;
    };
    const { rows } = await pool.query<{ us: number }>(`select ${US("clock_timestamp()")} as us`);
    const [originUs, first] = [rows[0]!.us, performance.now()];
    const fired = await all(
      BURSTS.map(async (b) => {
        await sleep(Math.max(0, b.at - (performance.now() - first)));
        check();
        const at = performance.now() - first;
        return { at, line: `  +${secs(at).padStart(6)}  ${b.task.padEnd(13)} ${await fire(b)}` };
      }),
    );
    say(...fired.map((f) => f.line));

    // Settled when only raised jobs whose retry is due after the horizon remain (counted by creation
    // time: a rescheduled copy is queued before the conflict record naming it is written).
    const raising = NAMES.filter((t) => TASKS[t].options.onConflict === "raise");
    const settledSql = `select bool_and(task_identifier = any($2) and attempts > 0 and locked_at is null
        and run_at > to_timestamp($3)) is not false as settled from graphile_worker.jobs
      where task_identifier = any($1) and created_at >= to_timestamp($4)`;
    const times = [(originUs + RETRY_HORIZON_MS * 1000) / 1e6, originUs / 1e6];
    let settled = false;
    while (!settled && performance.now() - first < SETTLE_DEADLINE_MS) {
      check();
      if (workers.some((w) => w.exitCode !== null)) throw new Error("a worker exited unexpectedly");
      settled = (await pool.query(settledSql, [NAMES, raising, ...times])).rows[0].settled;
      if (!settled) await sleep(100);
    }
    say(
      settled
        ? `  Queue settled ${secs(performance.now() - first)} after the first burst; stopping the workers`
        : red(
            `  The queue did not settle within ${secs(SETTLE_DEADLINE_MS)}; stopping the workers`,
          ),
    );
    await Promise.all(workers.map(stopWorker));
    problems.push(
      ...(await report(
        pool,
        run,
        enqueued,
        originUs,
        fired.map((f) => f.at),
      )),
    );
    if (!settled) problems.push(`the queue did not settle within ${secs(SETTLE_DEADLINE_MS)}`);
  } catch (error) {
    const message = error instanceof Error ? (error.stack ?? error.message) : String(error);
    if (!interrupted) problems.push(`the demo failed: ${message}`);
  } finally {
    // After an interruption PostgreSQL may be gone already: cleaning up is best effort then.
    for (const cleanup of cleanups.reverse())
      await cleanup().catch((e: unknown) => interrupted || problems.push(`cleanup failed: ${e}`));
  }
  say("");
  if (interrupted) {
    say(red(`Interrupted by ${interrupted}; cleaned up.`));
    return interrupted === "SIGINT" ? 130 : 143;
  }
  if (problems.length > 0) {
    say(red("!!! DEMO FAILED !!!"), ...problems.map((p) => red(`  - ${p}`)));
    return 1;
  }
  const ok = "no key ran more jobs at once than its limit, and every job is accounted for";
  say(green(`OK: ${ok} (${elapsed()}).`));
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
