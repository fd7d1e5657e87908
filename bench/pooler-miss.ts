/**
 * How often a lock session misconfigured through a transaction-mode PgBouncer takes a lock before it is
 * caught: the measurement behind the lock session's refusal (src/connection.ts; figures in bench/README.md,
 * "A lock session through a transaction pooler").
 *
 *   node --import tsx bench/pooler-miss.ts [RUNS] [CLIENTS]      (default 300 runs, 6 traffic clients)
 *
 * PostgreSQL from scripts/postgres.ts, PgBouncer (transaction mode, test/support/pgbouncer.ts's settings)
 * from PGBOUNCER or the system's package. CLIENTS other clients run short statements and short transactions
 * through PgBouncer in a loop, with a few milliseconds between them. Each run makes a `Locks` instance whose lock
 * session goes through PgBouncer (`connectionString` only: the misconfiguration), connects it, and feeds it
 * exclusive jobs until the session is refused or RUN_MS have passed. Each run is counted once:
 *
 * - refused at connect (by the probe, the backend claim, or the pid check at the end of connect);
 * - refused later, nothing held then (the first lock statement that reached another backend took nothing);
 * - refused later with locks held on the session's own backend (held there until the
 *   pooler closes that backend);
 * - not refused within RUN_MS (every statement so far reached the session's own backend).
 */
import { makeWorkerUtils, run, type Task } from "graphile-worker";
import pg from "pg";
import { makeLocks, type Locks, type LocksError } from "../src/index.js";
import { startPgBouncer, pgbouncerBinary, pgbouncerVersion } from "../test/support/pgbouncer.js";
import { startPostgres } from "../scripts/postgres.js";
import { createBenchDatabase, quietLogger, resetJobs, sleep } from "./lib.js";

const RUNS = Number(process.argv[2] ?? 300);
const CLIENTS = Number(process.argv[3] ?? 6);
/** How long a connected session is fed jobs, waiting for a statement to reach another backend. */
const RUN_MS = 5_000;
const JOBS_PER_RUN = 40;
const KEYS = 4;
const JOB_MS = 20;
/** Enqueues $1 `exec` jobs over $2 keys. */
const ADD_JOBS = `select graphile_worker.add_job('exec', json_build_object('k', 'k' || (i % $2)))
  from generate_series(1, $1::int) i`;

type Outcome =
  | "refused at connect: probe"
  | "refused at connect: claim"
  | "refused at connect: pid check"
  | "refused later, nothing held"
  | "refused later, locks held"
  | "not refused";

const log = (message: string) => process.stderr.write(`${message}\n`);

async function main(): Promise<void> {
  const binary = pgbouncerBinary();
  if (!binary) throw new Error("pgbouncer is not installed (or set PGBOUNCER to its binary)");
  const server = await startPostgres();
  const db = await createBenchDatabase(server.url);
  const bouncer = await startPgBouncer(db.url, { binary });
  let counts: Map<Outcome, number>;
  try {
    counts = await measure(db.url, bouncer.via(db.url));
  } finally {
    await bouncer.stop();
    await db.drop().catch(() => undefined);
    await server.stop();
  }

  console.log(
    `PgBouncer ${pgbouncerVersion(binary)}, transaction mode; ${CLIENTS} traffic clients; ${RUNS} runs`,
  );
  const order: Outcome[] = [
    "refused at connect: probe",
    "refused at connect: claim",
    "refused at connect: pid check",
    "refused later, nothing held",
    "refused later, locks held",
    "not refused",
  ];
  for (const outcome of order) console.log(`${outcome}: ${counts.get(outcome) ?? 0}`);
}

/** The runs, under traffic, through PgBouncer at `via` in front of the database at `url`. */
async function measure(url: string, via: string): Promise<Map<Outcome, number>> {
  const direct = new pg.Pool({ connectionString: url, max: 2, application_name: "direct" });
  const utils = await makeWorkerUtils({ pgPool: direct, logger: quietLogger });
  await utils.migrate();
  await utils.release();
  await direct.query("create table traffic (id int primary key, n bigint not null default 0)");
  await direct.query("insert into traffic select g from generate_series(1, 64) g");

  let stopping = false;
  const traffic = Array.from({ length: CLIENTS }, (_, i) =>
    generateTraffic(via, i, () => stopping),
  );

  // The runner dispatches to the current run's exclusive task (one runner for every run). It connects
  // directly: the backends PgBouncer has are ended between runs.
  let current: Task | null = null;
  const runnerPool = new pg.Pool({ connectionString: url, max: 8, application_name: "direct" });
  runnerPool.on("error", () => undefined);
  const runner = await run({
    pgPool: runnerPool,
    concurrency: 4,
    pollInterval: 100,
    logger: quietLogger,
    taskList: { exec: (payload, helpers) => current?.(payload, helpers) },
  });

  const counts = new Map<Outcome, number>();
  for (let i = 0; i < RUNS; i++) {
    await freshBackends(direct);
    const outcome = await oneRun(via, direct, (task) => (current = task));
    counts.set(outcome, (counts.get(outcome) ?? 0) + 1);
    if ((i + 1) % 10 === 0) log(`${i + 1}/${RUNS}: ${JSON.stringify(Object.fromEntries(counts))}`);
  }

  stopping = true;
  await Promise.all(traffic);
  await runner.stop();
  await runnerPool.end();
  await direct.end();

  return counts;
}

/**
 * Ends every backend PgBouncer has (each once idle in the pool) and waits until they are gone: each run
 * starts on backends no lock session marked, and without an earlier run's locks.
 */
async function freshBackends(direct: pg.Pool): Promise<void> {
  // (a backend is its pid and start: pids are reused)
  const { rows } = await direct.query<{ pid: number; start: string }>(
    `select pid, backend_start::text as start from pg_catalog.pg_stat_activity
     where datname = current_database() and pid <> pg_backend_pid() and backend_type = 'client backend'
       and application_name is distinct from 'direct'`,
  );
  const deadline = performance.now() + 30_000;
  for (;;) {
    const { rows: left } = await direct.query<{ n: number }>(
      `select count(*)::int as n from pg_catalog.pg_stat_activity a
       join unnest($1::int[], $2::timestamptz[]) as b(pid, start)
         on a.pid = b.pid and a.backend_start = b.start
       where a.state <> 'idle' or not pg_catalog.pg_terminate_backend(a.pid)`,
      [rows.map((r) => r.pid), rows.map((r) => r.start)],
    );
    if (left[0]!.n === 0) return;
    if (performance.now() > deadline) throw new Error("could not end PgBouncer's backends");
    await sleep(10);
  }
}

/** One client's traffic through PgBouncer: short statements and short transactions, until `stopped()`. */
async function generateTraffic(via: string, i: number, stopped: () => boolean): Promise<void> {
  let client = new pg.Client({ connectionString: via, application_name: `traffic-${i}` });
  client.on("error", () => undefined);
  await client.connect();
  try {
    while (!stopped()) {
      if (!(await step(client))) {
        // (a backend ended under it, between runs: a new client, as a pool would)
        await client.end().catch(() => undefined);
        client = new pg.Client({ connectionString: via, application_name: `traffic-${i}` });
        client.on("error", () => undefined);
        await client.connect().catch(() => undefined);
      }
      await sleep(Math.random() * 5);
    }
  } finally {
    await client.end().catch(() => undefined);
  }
}

/** One statement, or one short transaction; false when it failed. */
async function step(client: pg.Client): Promise<boolean> {
  const id = 1 + Math.floor(Math.random() * 64);
  try {
    if (Math.random() < 0.5) {
      await client.query("select pg_catalog.pg_sleep($1::float8 / 1000)", [Math.random() * 3]);
    } else {
      await client.query("begin");
      await client.query("update traffic set n = n + 1 where id = $1", [id]);
      await client.query("select n from traffic where id = $1", [id]);
      await client.query("commit");
    }
    return true;
  } catch {
    return false;
  }
}

async function oneRun(
  via: string,
  direct: pg.Pool,
  setTask: (task: Task) => void,
): Promise<Outcome> {
  const locks: Locks = makeLocks({
    connectionString: via,
    preparedStatements: false,
    logger: quietLogger,
    // (a job that meets the session reconnecting waits for it rather than being deferred: a deferred copy's
    // wait for the session spins once the session is refused, exclusive.ts's DeferredCopies)
    lockSessionWait: 60_000,
  });
  let heldAtLoss = 0;
  locks.events.on("lock:lost", ({ holds, error }) => {
    if ((error as LocksError).code === "GWL_LOCK_SESSION_POOLED") heldAtLoss += holds.length;
  });
  setTask(
    locks.exclusive<{ k: string }>("exec", () => sleep(JOB_MS), {
      onConflict: "drop",
      key: (p) => ({ k: p.k }),
    }),
  );
  try {
    const refusal = await locks.connect().then(
      () => null,
      (error: unknown) => error as LocksError,
    );
    if (refusal) {
      if (refusal.code !== "GWL_LOCK_SESSION_POOLED") throw refusal;
      if (refusal.message.includes("already marked")) return "refused at connect: claim";
      if (refusal.message.includes("at connect reached")) return "refused at connect: pid check";
      return "refused at connect: probe";
    }
    await direct.query(ADD_JOBS, [JOBS_PER_RUN, KEYS]);
    const deadline = performance.now() + RUN_MS;
    while (locks.status().state !== "refused" && performance.now() < deadline) {
      const { rows } = await direct.query<{ n: number }>(
        "select count(*)::int as n from graphile_worker._private_jobs",
      );
      if (rows[0]!.n === 0) await direct.query(ADD_JOBS, [JOBS_PER_RUN, KEYS]);
      await sleep(50);
    }
    if (locks.status().state !== "refused") return "not refused";
    return heldAtLoss > 0 ? "refused later, locks held" : "refused later, nothing held";
  } finally {
    await locks.release();
    await resetJobs(direct);
  }
}

await main();
