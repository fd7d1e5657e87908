/**
 * Shared helpers of the benchmark: timing and statistics, table printing, the benchmark database, job
 * insertion and reset, machine information, and the shape of a section.
 */
import { execFileSync, fork } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { rename, writeFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { availableParallelism, cpus, loadavg, platform, release, totalmem } from "node:os";
import { basename, dirname, join } from "node:path";
import { performance } from "node:perf_hooks";
import { fileURLToPath, pathToFileURL } from "node:url";
import pg from "pg";
import { Logger, runMigrations } from "graphile-worker";
import { databaseUrl, startPostgres } from "../scripts/postgres.js";
import { library, libraryBuild } from "./library.js";

// ---------------------------------------------------------------------------------------------------------
// Sections

/** What every section gets from the orchestrator. */
export interface BenchContext {
  /** Connection URL of the benchmark's own database (graphile-worker's and this library's schemas installed). */
  url: string;
  /** A small pool to that database, for setup, reset and polling (not used by the code under test). */
  pool: pg.Pool;
  /** `BENCH_QUICK=1`: small job counts, for a smoke run. Figures are not meaningful then. */
  quick: boolean;
  /** Progress output (stderr), so that stdout carries only the results. */
  log(message: string): void;
  /** Where the server runs: "embedded" is on this machine, so its processes can be read from /proc. */
  postgresServer: MachineInfo["postgresServer"];
}

/** A target from the issue, checked and reported, never enforced (a missed goal does not fail the run). */
export interface Goal {
  section: string;
  name: string;
  /** e.g. "wrapped/plain ≥ 0.90" */
  target: string;
  value: number;
  threshold: number;
  met: boolean;
}

export interface Table {
  title: string;
  columns: Array<{ header: string; align?: "left" | "right" }>;
  rows: string[][];
  notes?: string[];
}

export interface SectionResult {
  tables: Table[];
  goals: Goal[];
  /** Every figure of the section, for results.json. */
  figures: unknown;
}

export interface Section {
  /** Short id, used on the command line (`npm run bench -- throughput`) and in results.json. */
  id: string;
  title: string;
  run(ctx: BenchContext): Promise<SectionResult>;
}

// ---------------------------------------------------------------------------------------------------------
// Timing and statistics

export const now = (): number => performance.now();

/** Measured rounds per configuration: BENCH_ROUNDS, else the section's default. */
export const benchRounds = (fallback: number): number =>
  Math.max(1, Number(process.env.BENCH_ROUNDS ?? fallback) || fallback);

export const sleep = (ms: number): Promise<void> =>
  new Promise((resolve) => setTimeout(resolve, ms));

export function median(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

/** (max − min) / median, as a fraction: a rough measure of run-to-run noise. */
export function spread(values: readonly number[]): number {
  if (values.length < 2) return 0;
  return (Math.max(...values) - Math.min(...values)) / median(values);
}

export function round(value: number, digits: number): number {
  const f = 10 ** digits;
  return Math.round(value * f) / f;
}

// ---------------------------------------------------------------------------------------------------------
// Formatting

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

export const fmtInt = (value: number): string =>
  Number.isFinite(value) ? integer.format(value) : "–";
export const fmtFixed = (value: number, digits: number): string =>
  Number.isFinite(value) ? value.toFixed(digits) : "–";
export const fmtPercent = (fraction: number): string =>
  Number.isFinite(fraction) ? `${(fraction * 100).toFixed(0)}%` : "–";

/** A plain-text table with aligned columns. */
export function formatTable(table: Table): string {
  const widths = table.columns.map((c, i) =>
    Math.max(c.header.length, ...table.rows.map((r) => (r[i] ?? "").length)),
  );
  const cell = (text: string, i: number) =>
    table.columns[i]!.align === "left" ? text.padEnd(widths[i]!) : text.padStart(widths[i]!);
  const line = (cells: string[]) =>
    cells
      .map((text, i) => cell(text, i))
      .join("  ")
      .trimEnd();
  const out = [
    table.title,
    line(table.columns.map((c) => c.header)),
    line(widths.map((w) => "-".repeat(w))),
    ...table.rows.map((r) => line(r)),
  ];
  for (const note of table.notes ?? []) out.push(`  ${note}`);
  return out.join("\n");
}

/**
 * A table's rows as one line each, for results.json: the row's first cell, then every other non-empty cell
 * after its column's header.
 */
export function summaryRows(table: Table): string[] {
  return table.rows.map((row) =>
    [
      row[0] ?? "",
      ...row.slice(1).flatMap((cell, i) => {
        const header = table.columns[i + 1]?.header ?? "";
        return cell === "" || cell === "–" ? [] : [header ? `${header}: ${cell}` : cell];
      }),
    ].join("; "),
  );
}

// ---------------------------------------------------------------------------------------------------------
// Database

/** graphile-worker's logger, silenced: logging every job would dominate a no-op benchmark. */
export const quietLogger = new Logger(() => () => undefined);

export interface BenchDatabase {
  url: string;
  drop(): Promise<void>;
}

/**
 * Creates a fresh database for the benchmark on the server of `serverUrl`, so that a server given through
 * DATABASE_URL keeps its own data: the benchmark truncates job tables.
 */
export async function createBenchDatabase(serverUrl: string): Promise<BenchDatabase> {
  const name = `gwl_bench_${randomBytes(4).toString("hex")}`;
  await withClient(serverUrl, (c) => c.query(`create database ${pg.escapeIdentifier(name)}`));
  return {
    url: databaseUrl(serverUrl, name),
    drop: () =>
      withClient(serverUrl, async (c) => {
        await c.query(`drop database if exists ${pg.escapeIdentifier(name)} with (force)`);
      }),
  };
}

export async function withClient<T>(
  url: string,
  fn: (client: pg.Client) => Promise<T>,
): Promise<T> {
  const client = new pg.Client({ connectionString: url, application_name: "gwl-bench-admin" });
  client.on("error", () => undefined);
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end().catch(() => undefined);
  }
}

/** Empties graphile-worker's job tables (its task table stays: task ids are cached by runners). */
export async function resetJobs(pool: pg.Pool): Promise<void> {
  await pool.query("truncate graphile_worker._private_jobs, graphile_worker._private_job_queues");
}

/**
 * Inserts `count` jobs of `taskIdentifier` with payload `{ i }` (i = 1..count) through graphile-worker's
 * own `add_jobs`, in one statement built on the server, then refreshes the table's statistics so that
 * every run starts from the same state (and autovacuum has nothing to do mid-run).
 */
export async function insertJobs(
  pool: pg.Pool,
  taskIdentifier: string,
  count: number,
): Promise<void> {
  await pool.query(
    `select count(*) from graphile_worker.add_jobs(
       array(select row($1::text, json_build_object('i', i), null, null, null, null, null, null)::graphile_worker.job_spec
             from generate_series(1, $2::int) as i))`,
    [taskIdentifier, count],
  );
  await pool.query("vacuum analyze graphile_worker._private_jobs");
}

export async function countJobs(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query<{ n: string }>(
    "select count(*) as n from graphile_worker._private_jobs",
  );
  return Number(rows[0]!.n);
}

/** Polls (every `intervalMs`) until graphile-worker's job table is empty; rejects after `timeoutMs`. */
export async function waitUntilNoJobs(
  pool: pg.Pool,
  timeoutMs: number,
  intervalMs = 5,
): Promise<void> {
  const deadline = now() + timeoutMs;
  for (;;) {
    const left = await countJobs(pool);
    if (left === 0) return;
    if (now() > deadline)
      throw new Error(`${left} job(s) still in the table after ${Math.round(timeoutMs)} ms`);
    await sleep(intervalMs);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Machine

export interface MachineInfo {
  cpuModel: string;
  cores: number;
  availableParallelism: number;
  totalMemoryGiB: number;
  platform: string;
  osRelease: string;
  node: string;
  postgres: string;
  postgresServer: "embedded" | "DATABASE_URL";
  graphileWorker: string;
  /** Which build of the library was measured: dist/ (the default), or src/ through tsx (BENCH_LIB=src), or another build (BENCH_LIB=<directory>). */
  library: string;
  /** The commit measured, and whether src/ differed from it (uncommitted changes). */
  commit: string;
  srcDirty: boolean;
  /** 1-minute load average when the benchmark started: other work on the machine skews every figure. */
  loadAverage1m: number;
  date: string;
}

export async function machineInfo(
  pool: pg.Pool,
  postgresServer: MachineInfo["postgresServer"],
): Promise<MachineInfo> {
  const { rows } = await pool.query<{ server_version: string }>("show server_version");
  const list = cpus();
  return {
    cpuModel: list[0]?.model.trim() ?? "unknown",
    cores: list.length,
    availableParallelism: availableParallelism(),
    totalMemoryGiB: round(totalmem() / 2 ** 30, 1),
    platform: platform(),
    osRelease: release(),
    node: process.version,
    postgres: rows[0]!.server_version,
    postgresServer,
    graphileWorker: graphileWorkerVersion(),
    library: libraryBuild,
    ...gitState(),
    loadAverage1m: round(loadavg()[0] ?? 0, 2),
    date: new Date().toISOString(),
  };
}

/** The checked-out commit and whether src/ has uncommitted changes ("unknown" outside a git checkout). */
function gitState(): { commit: string; srcDirty: boolean } {
  const root = fileURLToPath(new URL("..", import.meta.url));
  const git = (...args: string[]) =>
    execFileSync("git", args, {
      cwd: root,
      encoding: "utf8",
      stdio: ["ignore", "pipe", "ignore"],
    }).trim();
  try {
    return {
      commit: git("rev-parse", "HEAD"),
      srcDirty: git("status", "--porcelain", "--", "src").length > 0,
    };
  } catch {
    return { commit: "unknown", srcDirty: false };
  }
}

/** graphile-worker exports only its entry point, not its package.json: read it next to that. */
function graphileWorkerVersion(): string {
  try {
    const entry = createRequire(import.meta.url).resolve("graphile-worker");
    const pkg = JSON.parse(readFileSync(join(dirname(entry), "..", "package.json"), "utf8")) as {
      version: string;
    };
    return pkg.version;
  } catch {
    return "unknown";
  }
}

export function describeMachine(m: MachineInfo): string {
  return (
    `${m.cpuModel}, ${m.cores} cores; Node ${m.node}; PostgreSQL ${m.postgres} (${m.postgresServer}); ` +
    `graphile-worker ${m.graphileWorker}; library from ${m.library === "src" ? "src/ via tsx" : `${m.library}/`}` +
    `${m.srcDirty ? " (uncommitted changes in src/)" : ""}; load average ${m.loadAverage1m} at start`
  );
}

// ---------------------------------------------------------------------------------------------------------
// Set-up

export interface OpenBench {
  ctx: BenchContext;
  machine: MachineInfo;
  /** Drops the benchmark database and stops the server (if embedded). */
  close(): Promise<void>;
}

/**
 * Starts PostgreSQL (DATABASE_URL if set, else embedded), creates the benchmark's own database on it and
 * installs graphile-worker's and this library's schemas there.
 */
export async function openBench(
  log: (message: string) => void,
  quick: boolean,
): Promise<OpenBench> {
  const server = process.env.DATABASE_URL ? "DATABASE_URL" : "embedded";
  log(
    `starting PostgreSQL (${server})${quick ? "; BENCH_QUICK: small job counts, figures not meaningful" : ""}`,
  );
  const postgres = await startPostgres({ envVar: "DATABASE_URL" });
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
        `warning: load average ${machine.loadAverage1m} on ${machine.cores} cores before starting: ` +
          "other work on this machine will skew the figures",
      );
    }
    return {
      ctx: { url: database.url, pool, quick, log, postgresServer: server },
      machine,
      close,
    };
  } catch (error) {
    await close();
    throw error;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Output

/**
 * Writes JSON (bigints as strings) through a temporary file, so a crash never leaves half a file, formatted
 * by the repository's Prettier settings so that `npm run lint` accepts the file as written.
 */
export async function writeJsonAtomic(file: URL, data: unknown): Promise<void> {
  const tmp = new URL(`${file.href}.tmp`);
  let text = JSON.stringify(
    data,
    (_key, value: unknown) => (typeof value === "bigint" ? value.toString() : value),
    2,
  );
  try {
    const prettier = await import("prettier");
    const options = await prettier.resolveConfig(fileURLToPath(file));
    text = await prettier.format(text, { ...options, parser: "json" });
  } catch {
    text = `${text}\n`;
  }
  await writeFile(tmp, text);
  await rename(tmp, file);
}

// ---------------------------------------------------------------------------------------------------------
// Worker processes: requests and answers over IPC

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
  /** Asks the process to leave (its `leave`), and kills it if it has not within 15 s. */
  stop(): Promise<void>;
}

/**
 * Forks `count` processes of `script` (run through tsx, WORKER_NAME w1, w2, ... and `env` in their
 * environment) and waits until each has sent `ready`; if one fails to start, stops the others and throws.
 */
export async function forkWorkers(
  script: URL,
  count: number,
  env: Record<string, string>,
  execArgv: string[] = [],
): Promise<WorkerProcess[]> {
  const started = await Promise.allSettled(
    Array.from({ length: count }, (_, i) => forkWorker(script, `w${i + 1}`, env, execArgv)),
  );
  const workers = started.flatMap((s) => (s.status === "fulfilled" ? [s.value] : []));
  const failure = started.find((s): s is PromiseRejectedResult => s.status === "rejected");
  if (failure) {
    await Promise.all(workers.map((w) => w.stop()));
    throw failure.reason;
  }
  return workers;
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
 * A worker process's side: answers each request with its handler's result (or its error). On `leave`, or
 * when the parent goes away, runs `leave` and exits. Returns the function that sends events: `ready` once
 * set up, `failed` when a run cannot finish, any other for `onEvent`.
 */
export function serveParent<R extends Request>(
  handlers: { [K in R["type"]]: (request: Extract<R, { type: K }>) => unknown },
  leave: () => Promise<void>,
): (event: string, data?: unknown) => void {
  const send = (reply: Reply, then?: () => void) =>
    process.send!(reply, undefined, {}, () => then?.());
  const exit = (then: (code: number) => void) => {
    // Leave anyway if stopping hangs.
    setTimeout(() => process.exit(1), 10_000).unref();
    leave().then(
      () => then(0),
      () => then(1),
    );
  };
  process.on("message", ({ id, request }: { id: number; request: R }) => {
    if (request.type === "leave") {
      exit((code) => send({ id }, () => process.exit(code)));
      return;
    }
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
  return (event, data) => send({ event, data });
}

/** Whether this module is the script node was started with (not imported by another). */
export const isMain = (url: string): boolean =>
  process.argv[1] !== undefined && url === pathToFileURL(process.argv[1]).href;
