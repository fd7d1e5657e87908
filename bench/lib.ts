/**
 * What the sections share: the shape of a section, its tables and goals; timing and statistics; the
 * benchmark database and its job table; the machine's description; and the worker processes (forked,
 * served and asked over IPC) that the throughput, contention and latency sections run their runners in.
 */
import { execFileSync, fork } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { rename, writeFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { cpus, loadavg } from "node:os";
import { basename, dirname, join } from "node:path";
import { performance } from "node:perf_hooks";
import { fileURLToPath, pathToFileURL } from "node:url";
import pg from "pg";
import { Logger, run, runMigrations, type RunnerOptions } from "graphile-worker";
import { databaseUrl, startPostgres } from "../scripts/postgres.js";
import { SERVER_STATS_FLAGS } from "./server-stats.js";
import { library, libraryBuild } from "./library.js";

// ---------------------------------------------------------------------------------------------------------
// Sections, tables and goals

export interface BenchContext {
  /** The benchmark's own database (graphile-worker's and this library's schemas installed). */
  url: string;
  /** A small pool to it, for setup, reset and polling (not used by the code under test). */
  pool: pg.Pool;
  /** `BENCH_QUICK=1`: small job counts, for a smoke run; figures are not meaningful then. */
  quick: boolean;
  /** Progress output (stderr): stdout carries only the results. */
  log(message: string): void;
  /** "embedded" runs on this machine, so its backends can be read from /proc. */
  postgresServer: "embedded" | "DATABASE_URL";
}

/** A goal, reported and never enforced; run.ts adds the section's id. */
export interface Goal {
  section?: string;
  name: string;
  /** e.g. "wrapped/plain ≥ 0.90" */
  target: string;
  value: number;
  met: boolean;
}

export const goal = (name: string, target: string, value: number, met: boolean): Goal => ({
  name,
  target,
  value,
  met,
});

export interface Table {
  title: string;
  columns: Array<{ header: string; align?: "left" | "right" }>;
  rows: string[][];
  notes?: string[];
}

/**
 * A table; `headers` are separated by " | ", and its columns right-aligned except the first and those
 * whose header starts with "<".
 */
export function table(title: string, headers: string, rows: string[][], notes?: string[]): Table {
  const columns = headers.split(" | ").map((h, i) => ({
    header: h.replace(/^</, ""),
    align: i === 0 || h.startsWith("<") ? ("left" as const) : ("right" as const),
  }));
  return { title, columns, rows, notes: notes?.filter((n) => n !== "") };
}

export interface SectionResult {
  tables: Table[];
  goals: Goal[];
  /** Every figure of the section, for results.full.json. */
  figures: unknown;
}

export interface Section {
  /** Used on the command line (`npm run bench -- throughput`) and in the results. */
  id: string;
  title: string;
  run(ctx: BenchContext): Promise<SectionResult>;
}

/** A section run at `sizes.full` and `rounds` rounds, or with BENCH_QUICK at `sizes.quick` and 1 round. */
export const sizedSection = <S>(
  {
    id,
    title,
    sizes,
    rounds,
  }: { id: string; title: string; sizes: { full: S; quick: S }; rounds: number },
  run: (ctx: BenchContext, size: S, rounds: number) => Promise<SectionResult>,
): Section => ({
  id,
  title,
  run: (ctx) => run(ctx, ctx.quick ? sizes.quick : sizes.full, ctx.quick ? 1 : rounds),
});

/** A plain-text table with aligned columns, its notes indented below. */
export function formatTable(t: Table): string {
  const widths = t.columns.map((c, i) =>
    Math.max(c.header.length, ...t.rows.map((r) => (r[i] ?? "").length)),
  );
  const line = (cells: string[]) =>
    cells
      .map((text, i) =>
        t.columns[i]!.align === "left" ? text.padEnd(widths[i]!) : text.padStart(widths[i]!),
      )
      .join("  ")
      .trimEnd();
  const out = [
    t.title,
    line(t.columns.map((c) => c.header)),
    line(widths.map((w) => "-".repeat(w))),
  ];
  return [...out, ...t.rows.map(line), ...(t.notes ?? []).map((n) => `  ${n}`)].join("\n");
}

/** A table's rows for results.json: the first cell, then every other non-empty one after its header. */
export const summaryRows = (t: Table): string[] =>
  t.rows.map((row) =>
    [
      row[0] ?? "",
      ...row.slice(1).flatMap((cell, i) => {
        const header = t.columns[i + 1]?.header ?? "";
        return cell === "" || cell === "–" ? [] : [header ? `${header}: ${cell}` : cell];
      }),
    ].join("; "),
  );

// ---------------------------------------------------------------------------------------------------------
// Timing, statistics, formatting

export const now = (): number => performance.now();
/**
 * Milliseconds on the machine's monotonic clock, one clock for every process of the machine: for instants
 * recorded in different processes and compared. (`performance.timeOrigin` is not one: each process takes it
 * from the wall clock as it starts, and a wall clock adjusted meanwhile leaves processes of one run
 * milliseconds apart, which turns a hand-off between them into an overlap.)
 */
export const machineClock = (): number => Number(process.hrtime.bigint()) / 1e6;
export const sleep = (ms: number): Promise<void> =>
  new Promise((resolve) => setTimeout(resolve, ms));

/** Measured rounds per configuration: BENCH_ROUNDS, else the section's default. */
export const benchRounds = (fallback: number): number =>
  Math.max(1, Number(process.env.BENCH_ROUNDS ?? fallback) || fallback);

export function median(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

/** The `p`-th percentile (0–100) by nearest rank; `above`: on an exact rank, the value after it. */
export function percentile(values: readonly number[], p: number, above = false): number {
  if (values.length === 0) return Number.NaN;
  const sorted = Float64Array.from(values).sort();
  const rank = above
    ? Math.floor((p / 100) * sorted.length) + 1
    : Math.ceil((p / 100) * sorted.length);
  return sorted[Math.min(sorted.length, Math.max(1, rank)) - 1]!;
}

/** (max − min) / median: a rough measure of run-to-run noise. */
export const spread = (values: readonly number[]): number =>
  values.length < 2 ? 0 : (Math.max(...values) - Math.min(...values)) / median(values);

export const round = (value: number, digits: number): number =>
  Math.round(value * 10 ** digits) / 10 ** digits;

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
export const fmtInt = (value: number): string =>
  Number.isFinite(value) ? integer.format(value) : "–";
export const fmtFixed = (value: number, digits: number): string =>
  Number.isFinite(value) ? value.toFixed(digits) : "–";
export const fmtPercent = (fraction: number): string =>
  Number.isFinite(fraction) ? `${(fraction * 100).toFixed(0)}%` : "–";

// ---------------------------------------------------------------------------------------------------------
// Database

/** graphile-worker's logger, silenced: logging every job would dominate a no-op benchmark. */
export const quietLogger = new Logger(() => () => undefined);

export interface BenchDatabase {
  url: string;
  drop(): Promise<void>;
}

/** A fresh database on the server of `serverUrl` (the bench truncates job tables: not the user's). */
export async function createBenchDatabase(serverUrl: string): Promise<BenchDatabase> {
  const name = pg.escapeIdentifier(`gwl_bench_${randomBytes(4).toString("hex")}`);
  const admin = async (sql: string) => {
    const client = new pg.Client({
      connectionString: serverUrl,
      application_name: "gwl-bench-admin",
    });
    client.on("error", () => undefined);
    await client.connect();
    await client.query(sql).finally(() => client.end().catch(() => undefined));
  };
  await admin(`create database ${name}`);
  return {
    url: databaseUrl(serverUrl, name.slice(1, -1)),
    drop: () => admin(`drop database if exists ${name} with (force)`),
  };
}

/** Empties graphile-worker's job tables (its task table stays: runners cache task ids). */
export async function resetJobs(pool: pg.Pool): Promise<void> {
  await pool.query("truncate graphile_worker._private_jobs, graphile_worker._private_job_queues");
}

/**
 * Empties the job tables and inserts `count` jobs of `task` with payload `{ i }` (i = 1..count) through
 * graphile-worker's own `add_jobs`, in one statement built on the server, then refreshes the table's
 * statistics, so that every run starts from the same state (and autovacuum has nothing to do mid-run).
 */
export async function insertJobs(pool: pg.Pool, task: string, count: number): Promise<void> {
  await resetJobs(pool);
  await pool.query(
    `select count(*) from graphile_worker.add_jobs(
       array(select row($1::text, json_build_object('i', i), null, null, null, null, null, null)::graphile_worker.job_spec
             from generate_series(1, $2::int) as i))`,
    [task, count],
  );
  await pool.query("vacuum analyze graphile_worker._private_jobs");
}

export async function countJobs(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query<{ n: string }>(
    "select count(*) as n from graphile_worker._private_jobs",
  );
  return Number(rows[0]!.n);
}

/** Polls every 5 ms until graphile-worker's job table is empty; rejects after `timeoutMs`. */
export async function waitUntilNoJobs(pool: pg.Pool, timeoutMs: number): Promise<void> {
  const deadline = now() + timeoutMs;
  for (let left = await countJobs(pool); left > 0; left = await countJobs(pool)) {
    if (now() > deadline)
      throw new Error(`${left} job(s) still in the table after ${timeoutMs} ms`);
    await sleep(5);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Machine and set-up

export type MachineInfo = Awaited<ReturnType<typeof machineInfo>>;

async function machineInfo(pool: pg.Pool, postgresServer: BenchContext["postgresServer"]) {
  const { rows } = await pool.query<{ server_version: string }>("show server_version");
  const root = fileURLToPath(new URL("..", import.meta.url));
  const git = (...args: string[]) =>
    execFileSync("git", args, { cwd: root, encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
  let state = { commit: "unknown", srcDirty: false };
  try {
    state = {
      commit: git("rev-parse", "HEAD").trim(),
      srcDirty: git("status", "--porcelain", "--", "src") !== "",
    };
  } catch {
    // not a git checkout
  }
  let graphileWorker = "unknown";
  try {
    // graphile-worker exports only its entry point, not its package.json: read it next to that.
    const entry = createRequire(import.meta.url).resolve("graphile-worker");
    graphileWorker = (
      JSON.parse(readFileSync(join(dirname(entry), "..", "package.json"), "utf8")) as {
        version: string;
      }
    ).version;
  } catch {
    // left unknown
  }
  return {
    cpuModel: cpus()[0]?.model.trim() ?? "unknown",
    cores: cpus().length,
    node: process.version,
    postgres: rows[0]!.server_version,
    postgresServer,
    graphileWorker,
    /** dist (the default), src (through tsx) or another build: BENCH_LIB. */
    library: libraryBuild,
    ...state,
    /** When the benchmark started: other work on the machine skews every figure. */
    loadAverage1m: round(loadavg()[0] ?? 0, 2),
    date: new Date().toISOString(),
  };
}

export const describeMachine = (m: MachineInfo): string =>
  `${m.cpuModel}, ${m.cores} cores; Node ${m.node}; PostgreSQL ${m.postgres} (${m.postgresServer}); ` +
  `graphile-worker ${m.graphileWorker}; library from ${m.library === "src" ? "src/ via tsx" : `${m.library}/`}` +
  `${m.srcDirty ? " (uncommitted changes in src/)" : ""}; load average ${m.loadAverage1m} at start`;

/**
 * Starts PostgreSQL (DATABASE_URL if set, else embedded), creates the benchmark's own database on it and
 * installs graphile-worker's and this library's schemas there. `close` drops it and stops the server.
 */
export async function openBench(log: (message: string) => void, quick: boolean) {
  const server = process.env.DATABASE_URL ? "DATABASE_URL" : "embedded";
  log(
    `starting PostgreSQL (${server})${quick ? "; BENCH_QUICK: small job counts, figures not meaningful" : ""}`,
  );
  const postgres = await startPostgres({ envVar: "DATABASE_URL", serverFlags: SERVER_STATS_FLAGS });
  let database: BenchDatabase | undefined;
  let pool: pg.Pool | undefined;
  const close = async () => {
    await pool?.end().catch(() => undefined);
    await database
      ?.drop()
      .catch((error: unknown) => log(`could not drop the benchmark database: ${String(error)}`));
    await postgres.stop();
  };
  try {
    database = await createBenchDatabase(postgres.url);
    pool = new pg.Pool({ connectionString: database.url, max: 4, application_name: "gwl-bench" });
    pool.on("error", (error) => log(`pool error: ${error.message}`));
    await runMigrations({ connectionString: database.url, logger: quietLogger });
    await library.migrate({ pgPool: pool });
    const machine = await machineInfo(pool, server);
    log(describeMachine(machine));
    if (machine.loadAverage1m > machine.cores / 2) {
      log(
        `warning: load average ${machine.loadAverage1m} on ${machine.cores} cores: other work will skew the figures`,
      );
    }
    const ctx: BenchContext = { url: database.url, pool, quick, log, postgresServer: server };
    return { ctx, machine, close };
  } catch (error) {
    await close();
    throw error;
  }
}

/**
 * Writes JSON (bigints as strings) through a temporary file, so a crash never leaves half a file, formatted
 * by the repository's Prettier settings so that `npm run lint` accepts the file as written.
 */
export async function writeJsonAtomic(file: URL, data: unknown): Promise<void> {
  const replacer = (_key: string, value: unknown) =>
    typeof value === "bigint" ? value.toString() : value;
  let text = `${JSON.stringify(data, replacer, 2)}\n`;
  try {
    const prettier = await import("prettier");
    const options = await prettier.resolveConfig(fileURLToPath(file));
    text = await prettier.format(text, { ...options, parser: "json" });
  } catch {
    // unformatted, then
  }
  await writeFile(new URL(`${file.href}.tmp`), text);
  await rename(new URL(`${file.href}.tmp`), file);
}

// ---------------------------------------------------------------------------------------------------------
// Worker processes: the parent's side

/** A request to a worker process; `type` names the handler that answers it. */
export type Request = { type: string } & Record<string, unknown>;
type Reply = { id: number; answer?: unknown; error?: string } | { event: string; data?: unknown };

/** A promise that rejects after `ms` (unless cleared). */
export function timeout(ms: number, message: string): { promise: Promise<never>; clear(): void } {
  let timer: NodeJS.Timeout | undefined;
  const promise = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(message)), ms);
  });
  promise.catch(() => undefined);
  return { promise, clear: () => clearTimeout(timer) };
}

export interface WorkerProcess {
  name: string;
  /** Resolves the handler's answer; rejects on its error, after `timeoutMs`, or when the process exits. */
  request<T = unknown>(request: Request, timeoutMs?: number): Promise<T>;
  /** Rejects when the process reports a failure (event `failed`) or exits unasked. */
  failed: Promise<never>;
  /** Receives the process's other events. */
  onEvent: ((event: string, data: unknown) => void) | undefined;
  /** Asks the process to leave, and kills it if it has not within 15 s. */
  stop(): Promise<void>;
}

/**
 * Forks `count` processes of `script` (through tsx; WORKER_NAME w1, w2, ... and `env` in their
 * environment), waits until each has sent `ready`, runs `fn` with them and stops them.
 */
export async function withWorkers<T>(
  script: URL,
  count: number,
  env: Record<string, string>,
  fn: (workers: WorkerProcess[]) => Promise<T>,
  execArgv: string[] = [],
): Promise<T> {
  const started = await Promise.allSettled(
    Array.from({ length: count }, (_, i) => forkWorker(script, `w${i + 1}`, env, execArgv)),
  );
  const workers = started.flatMap((s) => (s.status === "fulfilled" ? [s.value] : []));
  try {
    const failure = started.find((s): s is PromiseRejectedResult => s.status === "rejected");
    if (failure) throw failure.reason;
    return await fn(workers);
  } finally {
    await Promise.all(workers.map((w) => w.stop()));
  }
}

async function forkWorker(
  script: URL,
  name: string,
  env: Record<string, string>,
  execArgv: string[],
): Promise<WorkerProcess> {
  const label = `${basename(fileURLToPath(script), ".ts")} ${name}`;
  const child = fork(fileURLToPath(script), [], {
    execArgv: ["--import", "tsx", ...execArgv],
    env: { ...process.env, ...env, WORKER_NAME: name },
    // The child's stdout goes to our stderr: our stdout carries only the results.
    stdio: ["ignore", 2, 2, "ipc"],
  });
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const alive = () => child.exitCode === null && child.signalCode === null;
  const kill = async () => {
    if (alive()) child.kill("SIGKILL");
    await exited;
  };
  let leaving = false;
  let fail!: (error: Error) => void;
  const failed = new Promise<never>((_resolve, reject) => (fail = reject));
  failed.catch(() => undefined);
  let ready!: () => void;
  const isReady = new Promise<void>((resolve) => (ready = resolve));
  const waiting = new Map<number, { resolve(answer: unknown): void; reject(error: Error): void }>();
  let nextId = 1;

  const worker: WorkerProcess = {
    name,
    failed,
    onEvent: undefined,
    request: <T>(request: Request, timeoutMs = 60_000) =>
      new Promise<T>((resolve, reject) => {
        if (!alive()) return reject(new Error(`${label} is not running`));
        const id = nextId++;
        const timer = setTimeout(() => {
          waiting.delete(id);
          reject(new Error(`${label}: no answer to '${request.type}'`));
        }, timeoutMs);
        waiting.set(id, {
          resolve: (answer) => (clearTimeout(timer), resolve(answer as T)),
          reject: (error) => (clearTimeout(timer), reject(error)),
        });
        child.send({ id, request });
      }),
    async stop() {
      if (!alive()) return;
      leaving = true;
      await worker.request({ type: "leave" }, 15_000).catch(() => undefined);
      await Promise.race([exited, sleep(5_000)]);
      await kill();
    },
  };
  child.on("message", (reply: Reply) => {
    if ("event" in reply) {
      if (reply.event === "ready") ready();
      else if (reply.event === "failed") fail(new Error(`${label}: ${String(reply.data)}`));
      else worker.onEvent?.(reply.event, reply.data);
      return;
    }
    const waiter = waiting.get(reply.id);
    waiting.delete(reply.id);
    if (reply.error !== undefined) waiter?.reject(new Error(`${label}: ${reply.error}`));
    else waiter?.resolve(reply.answer);
  });
  child.once("exit", (code, signal) => {
    const error = new Error(`${label} exited (${signal ?? code})`);
    for (const waiter of waiting.values()) waiter.reject(error);
    waiting.clear();
    if (!leaving) fail(error);
  });
  const notReady = timeout(60_000, `${label} was not ready within 60 s`);
  try {
    await Promise.race([isReady, failed, notReady.promise]);
  } catch (error) {
    await kill();
    throw error;
  } finally {
    notReady.clear();
  }
  return worker;
}

/**
 * One run of the jobs already in the table: sends `start` to every worker, waits for `done` (if given)
 * and then an empty table, racing the workers' failures and `timeoutMs`; calls `atEnd` with the runners
 * still running, then sends `stop`. Resolves the workers' answers to `stop` and the time from sending
 * `start` to the empty table.
 */
export async function runWorkers<R>(
  workers: WorkerProcess[],
  pool: pg.Pool,
  start: Request,
  options: { timeoutMs: number; done?: Promise<void>; atEnd?: () => Promise<void> },
): Promise<{ reports: R[]; ms: number }> {
  const failed = Promise.race(workers.map((w) => w.failed));
  failed.catch(() => undefined);
  const limit = timeout(options.timeoutMs, `${start.type}: the jobs did not complete in time`);
  const within = <T>(promise: Promise<T>) => Promise.race([promise, failed, limit.promise]);
  try {
    const t0 = now();
    await within(Promise.all(workers.map((w) => w.request(start))));
    if (options.done) await within(options.done);
    await within(waitUntilNoJobs(pool, options.timeoutMs));
    const ms = now() - t0;
    await options.atEnd?.();
    return { reports: await Promise.all(workers.map((w) => w.request<R>({ type: "stop" }))), ms };
  } finally {
    limit.clear();
  }
}

// ---------------------------------------------------------------------------------------------------------
// Worker processes: the child's side

type Handlers<R extends Request> = {
  [K in R["type"]]: (request: Extract<R, { type: K }>) => unknown;
};

/** Sends an event to the parent: `failed` when a run cannot finish, any other for its `onEvent`. */
export const sendEvent = (event: string, data?: unknown): void => {
  process.send!({ event, data } satisfies Reply);
};

/**
 * A worker process's entry point: when `moduleUrl` is the script node was started with (not a module the
 * parent imports for its types and constants), calls `setup` with DATABASE_URL and the process's name,
 * serves the handlers it returns and sends `ready`; exits with 1 if setting up fails.
 */
export function workerMain<R extends Request>(
  moduleUrl: string,
  setup: (url: string, name: string) => Promise<{ handlers: Handlers<R>; leave(): Promise<void> }>,
): void {
  if (process.argv[1] === undefined || moduleUrl !== pathToFileURL(process.argv[1]).href) return;
  const name = process.env.WORKER_NAME ?? String(process.pid);
  setup(process.env.DATABASE_URL!, name).then(
    ({ handlers, leave }) => {
      serve(handlers, leave);
      sendEvent("ready");
    },
    (error: unknown) => {
      console.error(`[${basename(fileURLToPath(moduleUrl), ".ts")} ${name}] failed:`, error);
      process.exit(1);
    },
  );
}

/** graphile-worker's worker options (`preset.worker`), as the sections' configurations give them. */
export type WorkerPreset = NonNullable<GraphileConfig.Preset["worker"]>;

/** A run's `start` request to a worker process: its variant, concurrency and worker options, and `Extra`. */
export type RunStart<V extends string, Extra = unknown> = {
  type: "start";
  variant: V;
  concurrency: number;
  worker: WorkerPreset;
} & Extra;

/** graphile-worker's `run()` as the bench's runners start: quiet, no signal handlers. */
export const startRunner = (options: RunnerOptions) =>
  run({ noHandleSignals: true, logger: quietLogger, ...options });

/**
 * Answers each request with its handler's result (or its error). On `leave`, or when the parent goes
 * away, runs `leave` and exits.
 */
function serve<R extends Request>(handlers: Handlers<R>, leave: () => Promise<void>): void {
  const send = (reply: Reply, then?: () => void) =>
    process.send!(reply, undefined, {}, () => then?.());
  const exit = (then: (code: number) => void) => {
    setTimeout(() => process.exit(1), 10_000).unref(); // leave anyway if stopping hangs
    leave().then(
      () => then(0),
      () => then(1),
    );
  };
  process.on("message", ({ id, request }: { id: number; request: R }) => {
    if (request.type === "leave") return exit((code) => send({ id }, () => process.exit(code)));
    const handler = handlers[request.type as R["type"]] as (request: R) => unknown;
    Promise.resolve()
      .then(() => handler(request))
      .then(
        (answer) => send({ id, answer }),
        (error: unknown) =>
          send({
            id,
            error: error instanceof Error ? (error.stack ?? error.message) : String(error),
          }),
      );
  });
  process.on("disconnect", () => exit((code) => process.exit(code)));
}
