/**
 * Behind a real PgBouncer, on each binary at hand: the system's package (Debian 12's 1.18) and the 1.21+
 * build of scripts/build-pgbouncer.sh. The README's setup keeps mutual exclusion; a lock session through a
 * transaction pool is refused, through a session pool carried; prepared statements behave as the README
 * says for the version: before 1.21 named ones fail through transaction mode, from 1.21 on they work with
 * `max_prepared_statements`. Each binary's tests skip, with a message, where it is missing.
 */
import { makeWorkerUtils, type Runner, type Task, type WorkerUtils } from "graphile-worker";
import pg from "pg";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { makeLocks, type Locks, type LocksError } from "../../src/index.js";
import { useTestDatabase, waitFor } from "../support/db.js";
import { maxConcurrencyPerKey, readExecutions } from "../support/executions.js";
import {
  carriesPreparedStatements,
  compareVersions,
  pgbouncers,
  startPgBouncer,
  type PgBouncer,
  type PgBouncerBinary,
  type PgBouncerOptions,
} from "../support/pgbouncer.js";
import { nextEvent, quietLogger, startRunner, warningsLogger } from "../support/runner.js";

const candidates = pgbouncers();
for (const { missing } of candidates) if (missing) console.warn(missing);

const db = useTestDatabase();
const cleanup: Array<() => Promise<unknown>> = [];

afterEach(async () => {
  for (const step of cleanup.splice(0).reverse()) await step();
  await db
    .pool()
    .query("truncate test_executions, test_events; delete from graphile_worker._private_jobs");
});

function track<T extends { release(): Promise<unknown> } | Runner>(thing: T): T {
  cleanup.push(() => ("stop" in thing ? thing.stop() : thing.release()));
  return thing;
}

interface Payload {
  k: string;
  ms?: number;
  hold?: boolean;
}

/**
 * An exclusive `exec` task that records the start and end of every execution (database clock); `rate`: a
 * rate for it, whose statements then run on graphile-worker's pooled connections.
 */
function execTask(locks: Locks, worker: string, rate?: { limit: number; period: number }) {
  const pool = db.pool();
  const task = locks.exclusive<Payload>(
    "exec",
    async (payload, helpers) => {
      const { rows } = await pool.query<{ id: string }>(
        "insert into test_executions (job_id, task, lock_key, worker, attempts) values ($1, 'exec', $2, $3, $4) returning id",
        [helpers.job.id, task.lockKey(payload).toString(), worker, helpers.job.attempts],
      );
      if (payload.hold) {
        await new Promise<void>((resolve) =>
          helpers.abortSignal?.addEventListener("abort", () => resolve()),
        );
      } else {
        await new Promise((resolve) => setTimeout(resolve, payload.ms ?? 10));
      }
      await pool.query("update test_executions set ended_at = clock_timestamp() where id = $1", [
        rows[0]!.id,
      ]);
    },
    { onConflict: "drop", key: (p) => ({ k: p.k }), ...(rate ? { rate } : {}) },
  );
  return task;
}

/** A client connected through the pooler at `via`, taking one of its client slots (errors ignored). */
async function occupy(via: string): Promise<pg.Client> {
  const client = new pg.Client({ connectionString: via });
  client.on("error", () => undefined);
  await client.connect();
  return client;
}

/** The backend pid of each advisory lock held in the test database. */
async function advisoryLockHolders(): Promise<number[]> {
  const { rows } = await db.pool().query<{ pid: number }>(
    `select pid from pg_catalog.pg_locks where locktype = 'advisory'
       and database = (select oid from pg_catalog.pg_database where datname = current_database())`,
  );
  return rows.map((r) => r.pid);
}

async function jobCount(where = "true"): Promise<number> {
  const { rows } = await db.pool().query<{
    n: number;
  }>(`select count(*)::int as n from graphile_worker._private_jobs where ${where}`);
  return rows[0]!.n;
}

/** Enqueues `count` short `exec` jobs over `keys` keys, through PgBouncer, in one batch. */
async function enqueueExec(locks: Locks, count: number, keys: number, ms = 15): Promise<void> {
  const items = Array.from({ length: count }, (_, i) => ({
    identifier: "exec",
    payload: { k: `k${i % keys}`, ms },
  }));
  const results = await locks.addJobs(items);
  expect(results.filter((r) => r.outcome === "added")).toHaveLength(count);
}

/**
 * Enqueues twice through one pooled client (`via`, a transaction pool), a second client holding a
 * transaction between the two: it pins the backend the first enqueue ran on (PgBouncer hands out the
 * backend released last first), so the second enqueue runs on another backend, where the first one's named
 * statement was never prepared unless PgBouncer prepares it there. Resolves with the second enqueue's
 * error, if any.
 */
async function enqueueAcrossBackends(
  via: string,
  preparedStatements: boolean,
): Promise<LocksError | null> {
  const pool = new pg.Pool({ connectionString: via, max: 1 });
  cleanup.push(() => pool.end());
  const locks = track(
    makeLocks({
      pgPool: pool,
      lockConnectionString: db.url,
      preparedStatements,
      logger: quietLogger,
    }),
  );
  const first = await locks.addJob("other", { i: 1 }, { unique: "queued" });
  expect(first.outcome).toBe("added");
  const other = new pg.Client({ connectionString: via });
  await other.connect();
  cleanup.push(() => other.end());
  await other.query("begin");
  try {
    const second = await locks.addJob("other", { i: 2 }, { unique: "queued" });
    expect(second.outcome).toBe("added");
    return null;
  } catch (error) {
    return error as LocksError;
  } finally {
    await other.query("rollback");
    await db.pool().query("delete from graphile_worker._private_jobs");
  }
}

/** Expects `error` to be the library's explanation of a pooler that does not carry prepared statements. */
function expectPreparedStatementsUnsupported(error: LocksError | null): void {
  expect(error?.code).toBe("GWL_PREPARED_STATEMENTS_UNSUPPORTED");
  expect(error?.message).toContain("`preparedStatements: false`");
  expect(error?.message).toContain("`noPreparedStatements: true`");
  expect(error?.message).toContain("`max_prepared_statements`");
  expect((error?.cause as { code?: string }).code).toBe("26000");
}

for (const { kind, binary } of candidates) {
  const version = binary?.version ?? (kind === "system" ? "(not installed)" : "1.21+ (not built)");
  // Whether this version carries named prepared statements through transaction mode, where the README
  // says to keep them on (a missing build is 1.21+, a missing system package is taken as older).
  const prepared = binary ? carriesPreparedStatements(binary.version) : kind === "built";
  describe.skipIf(binary === null)(`PgBouncer ${version}`, () => pgbouncerTests(binary, prepared));
}

/** The tests on one PgBouncer binary (`binary` is null only when they are skipped). */
function pgbouncerTests(binary: PgBouncerBinary | null, prepared: boolean): void {
  /** Transaction pooling, with `max_prepared_statements = 100` (as docker-compose.yml) on 1.21+. */
  let bouncer: PgBouncer | undefined;
  let utils: WorkerUtils | undefined;
  const start = (options: PgBouncerOptions = {}) =>
    startPgBouncer(db.url, { binary: binary!.path, ...options });
  /** A PgBouncer of the test's own, stopped by its cleanups. */
  const startForTest = async (options: PgBouncerOptions = {}) => {
    const started = await start(options);
    cleanup.push(() => started.stop());
    return started;
  };
  /** The library's options for this version, as the README gives them: its default where it can. */
  const preparedOption = prepared ? {} : { preparedStatements: false };
  /** One runner per task through the pooler at `via` (concurrency 4, graphile-worker's side as the README sets it). */
  const startRunnersVia = (via: string, tasks: Task[]) =>
    Promise.all(
      tasks.map((exec) =>
        startRunner({
          connectionString: via,
          noPreparedStatements: !prepared,
          concurrency: 4,
          taskList: { exec },
        }).then(track),
      ),
    );

  beforeAll(async () => {
    bouncer = await start(prepared ? { maxPreparedStatements: 100 } : {});
    // graphile-worker's schema and ours exist already (the template); the utils only enqueue and read.
    utils = await makeWorkerUtils({
      connectionString: bouncer.via(db.url),
      noPreparedStatements: !prepared,
      logger: quietLogger,
    });
  });
  afterAll(async () => {
    await utils?.release();
    // (before the database's leak check: locks a refused session took leave with PgBouncer's backends)
    await bouncer?.stop();
  });

  describe("transaction mode", () => {
    it(`the README's setup: runners and enqueues through PgBouncer${prepared ? " with prepared statements" : ""}, the lock session direct`, async () => {
      const via = bouncer!.via(db.url);
      const instances = [0, 1].map((i) =>
        track(
          makeLocks({
            connectionString: via,
            lockConnectionString: db.url,
            ...preparedOption,
            logger: quietLogger,
            applicationName: `graphile-worker-locks/readme-${i}`,
          }),
        ),
      );
      let dropped = 0;
      let admitted = 0;
      for (const locks of instances) {
        locks.events.on("job:dropped", () => dropped++);
        locks.events.on("rate:admitted", () => admitted++);
      }
      // (a rate the jobs never meet: its statements run on graphile-worker's pooled connections, prepared
      // where the README keeps prepared statements on)
      const tasks = instances.map((locks, i) =>
        execTask(locks, `w${i}`, { limit: 100_000, period: 1000 }),
      );
      await enqueueExec(instances[0]!, 160, 4);
      await startRunnersVia(via, tasks);
      await waitFor(async () => (await jobCount()) === 0, { timeoutMs: 60_000 });

      const executions = await readExecutions(db.pool());
      expect(executions.every((e) => e.end !== null)).toBe(true);
      // Every job ran or was dropped on a conflict; contention was real.
      expect(executions.length + dropped).toBe(160);
      expect(dropped).toBeGreaterThan(0);
      expect(admitted).toBe(executions.length);
      // (a statement the pooler could not carry fails its job, which runs again on a later attempt)
      expect(executions.filter((e) => e.attempts !== 1)).toEqual([]);
      expect(new Set(executions.map((e) => e.worker))).toEqual(new Set(["w0", "w1"]));
      for (const [key, most] of maxConcurrencyPerKey(executions)) {
        expect(most, `executions of key ${key} at once`).toBe(1);
      }

      // Unique enqueues, one by one and in bulk, through PgBouncer.
      const locks = instances[0]!;
      const welcome = locks.unique("send_welcome", async () => undefined, { unique: "queued" });
      const first = await welcome.addJob({ userId: 7 });
      const second = await welcome.addJob({ userId: 7 });
      expect([first.outcome, second.outcome]).toEqual(["added", "duplicate"]);
      expect(second.job?.id).toBe(first.job?.id);
      const bulk = await locks.addJobs([
        { identifier: "send_digest", payload: { listId: 1 }, unique: "queued" },
        { identifier: "send_digest", payload: { listId: 1 }, unique: "queued" },
        { identifier: "send_digest", payload: { listId: 2 }, unique: "queued" },
      ]);
      expect(bulk.map((r) => r.outcome)).toEqual(["added", "duplicate", "added"]);
      expect(bulk[2]!.job?.id).not.toBe(bulk[0]!.job?.id);
    });

    it.skipIf(prepared)(
      "graphile-worker through PgBouncer without prepared statements, the library's own pool direct with them: jobs' statements go unprepared, every job on its first attempt",
      async () => {
        const via = bouncer!.via(db.url);
        const { logger, warnings } = warningsLogger();
        // (prepared statements on, the default: right for this instance's own direct pool)
        const locks = track(makeLocks({ connectionString: db.url, logger }));
        let admitted = 0;
        locks.events.on("rate:admitted", () => admitted++);
        const task = execTask(locks, "w0", { limit: 100_000, period: 1000 });
        await enqueueExec(locks, 60, 60);
        // (graphile-worker as the README sets it for this PgBouncer: `noPreparedStatements: true`)
        await startRunnersVia(via, [task, task]);
        await waitFor(async () => (await jobCount()) === 0, { timeoutMs: 60_000 });

        const executions = await readExecutions(db.pool());
        expect(executions).toHaveLength(60);
        // A job's statement refused by the pooler did not fail its job: it ran again unprepared.
        expect(executions.filter((e) => e.attempts !== 1)).toEqual([]);
        expect(admitted).toBe(60);
        const told = warnings.filter((w) => w.includes("does not carry prepared statements"));
        expect(told.length).toBeLessThanOrEqual(1);
        for (const w of told) expect(w).toContain("`preparedStatements: false`");
      },
    );

    it("refuses a lock session through PgBouncer at connect, and no job runs unlocked", async () => {
      const via = bouncer!.via(db.url);
      const instances = [0, 1].map((i) =>
        track(
          makeLocks({
            connectionString: via,
            ...preparedOption,
            logger: quietLogger,
            applicationName: `graphile-worker-locks/mistaken-${i}`,
          }),
        ),
      );
      // Each connects before any runner does: PgBouncer, otherwise idle, hands the probe's second client the
      // session's backend. (Under other traffic the probe can miss; the backend checks below cover that.)
      for (const locks of instances) {
        const error = (await locks.connect().then(
          () => null,
          (e: unknown) => e,
        )) as LocksError | null;
        expect(error?.code).toBe("GWL_LOCK_SESSION_POOLED");
        expect(error?.message).toContain("`lockConnectionString`");
        expect(error?.message).toContain("transaction mode");
      }

      const tasks = instances.map((locks, i) => execTask(locks, `w${i}`));
      await enqueueExec(instances[0]!, 40, 4, 50);
      await startRunnersVia(via, tasks);
      // Every job is tried, and fails with the refusal instead of running.
      await waitFor(async () => (await jobCount("last_error is not null")) === 40, {
        timeoutMs: 60_000,
      });
      const { rows } = await db
        .pool()
        .query<{ last_error: string }>("select last_error from graphile_worker._private_jobs");
      expect(rows).toHaveLength(40);
      for (const row of rows)
        expect(row.last_error).toContain("connection pooler in transaction mode");
      expect(await readExecutions(db.pool())).toEqual([]);
      expect(instances[1]!.status().state).toBe("refused");
    });

    if (!prepared) {
      it("fails named prepared statements with a message naming the options, and works with them off", async () => {
        const via = bouncer!.via(db.url);
        expectPreparedStatementsUnsupported(await enqueueAcrossBackends(via, true));
        expect(await enqueueAcrossBackends(via, false)).toBeNull();
      });
    } else {
      it("carries named prepared statements across backends with `max_prepared_statements`, and fails them with 0", async () => {
        expect(await enqueueAcrossBackends(bouncer!.via(db.url), true)).toBeNull();
        // The same enqueues through the same binary with the setting at 0 (no prepared-statement support):
        // the second enqueue does reach another backend.
        const off = await startForTest({ maxPreparedStatements: 0 });
        expectPreparedStatementsUnsupported(await enqueueAcrossBackends(off.via(db.url), true));
        expect(await enqueueAcrossBackends(off.via(db.url), false)).toBeNull();
        if (compareVersions(binary!.version, "1.24.0") >= 0) {
          // Since 1.24, PgBouncer's default is 200: on without the setting.
          const byDefault = await startForTest();
          expect(await enqueueAcrossBackends(byDefault.via(db.url), true)).toBeNull();
        }
      });
    }
  });

  describe("session mode", () => {
    it("carries the lock session: contended jobs never overlap", async () => {
      const session = await startForTest({ poolMode: "session" });
      const { logger, warnings } = warningsLogger();
      const instances = [0, 1].map((i) =>
        track(
          makeLocks({
            connectionString: db.url,
            lockConnectionString: session.via(db.url),
            logger,
            applicationName: `graphile-worker-locks/session-${i}`,
          }),
        ),
      );
      for (const locks of instances) await locks.connect();
      // The sessions of an earlier test's pooler may still be ending, and with them the keys they held:
      // jobs that met such a key would all be dropped, and the test would show no execution.
      await waitFor(async () => (await advisoryLockHolders()).length === 0, {
        message: "no advisory lock left by an earlier test",
      });
      const tasks = instances.map((locks, i) => execTask(locks, `w${i}`));
      await enqueueExec(instances[0]!, 80, 4);
      await Promise.all(
        tasks.map((exec) =>
          startRunner({ connectionString: db.url, concurrency: 4, taskList: { exec } }).then(track),
        ),
      );
      await waitFor(async () => (await jobCount()) === 0, { timeoutMs: 60_000 });
      const executions = await readExecutions(db.pool());
      expect(executions.length).toBeGreaterThanOrEqual(4);
      for (const [key, most] of maxConcurrencyPerKey(executions)) {
        expect(most, `executions of key ${key} at once`).toBe(1);
      }
      expect(instances.map((locks) => locks.status().state)).toEqual(["ready", "ready"]);
      // Each reports its backend's pid as PostgreSQL knows it (PgBouncer sends clients a key of its own).
      for (const [i, locks] of instances.entries()) {
        const { rows } = await db
          .pool()
          .query<{ application_name: string }>(
            "select application_name from pg_catalog.pg_stat_activity where pid = $1",
            [locks.status().pid],
          );
        expect(rows.map((r) => r.application_name)).toEqual([`graphile-worker-locks/session-${i}`]);
      }
      // (the probe at connect ran, through the pooler, and found each session on its own backend)
      expect(warnings).toEqual([]);
    });
  });

  describe("the lock session's backend check", () => {
    it("loses every hold and refuses the session when its statements reach another backend", async () => {
      // A PgBouncer that lets no second client in (so the connect-time probe cannot tell) and closes an idle
      // backend after a second: the session's next statement runs on a fresh backend.
      const cycling = await startForTest({
        settings: { max_client_conn: 1, server_lifetime: 1, server_idle_timeout: 1 },
      });
      const { logger, warnings } = warningsLogger();
      const locks = track(
        makeLocks({
          connectionString: db.url,
          lockConnectionString: cycling.via(db.url),
          heartbeatInterval: 100,
          logger,
        }),
      );
      await locks.connect();

      const exec = execTask(locks, "w");
      const lost = nextEvent(locks, "lock:lost");
      await track(
        await startRunner({ connectionString: db.url, concurrency: 2, taskList: { exec } }),
      );
      await utils!.addJob("exec", { k: "held", hold: true } satisfies Payload);
      const event = await lost;
      expect((event.error as LocksError).code).toBe("GWL_LOCK_SESSION_POOLED");
      expect(event.error.message).toContain("`lockConnectionString`");
      expect(event.holds).toHaveLength(1);
      // (the probe at connect could not tell: this check alone caught it)
      expect(warnings.join("\n")).toContain("Could not probe the proxy");
      // The held job saw its abort signal and ended; nothing runs unlocked afterwards.
      await waitFor(async () => (await readExecutions(db.pool()))[0]?.end !== null);
      expect(locks.status().state).toBe("refused");
      const again = await locks.connect().then(
        () => null,
        (e: unknown) => e as LocksError,
      );
      expect(again?.code).toBe("GWL_LOCK_SESSION_POOLED");
      await utils!.addJob("exec", { k: "later" } satisfies Payload);
      await waitFor(
        async () => (await jobCount("payload->>'k' = 'later' and last_error is not null")) === 1,
      );
      const { rows } = await db
        .pool()
        .query<{ last_error: string | null }>(
          "select last_error from graphile_worker._private_jobs where payload->>'k' = 'later'",
        );
      expect(rows[0]?.last_error).toContain("connection pooler in transaction mode");
      expect((await readExecutions(db.pool())).map((e) => e.lockKey)).toEqual([
        exec.lockKey({ k: "held" }).toString(),
      ]);
    });

    it("a lock statement that reaches another backend takes and releases nothing there", async () => {
      // As above (no room for the probe's client; idle backends closed after a second), and no heartbeat
      // in the test's time: the first thing to reach a second backend is a lock statement.
      const cycling = await startForTest({
        settings: { max_client_conn: 1, server_lifetime: 1, server_idle_timeout: 1 },
      });
      const locks = track(
        makeLocks({
          connectionString: db.url,
          lockConnectionString: cycling.via(db.url),
          heartbeatInterval: 600_000,
          logger: quietLogger,
        }),
      );
      await locks.connect();
      const first = locks.status().pid;
      await waitFor(
        async () =>
          (
            await db
              .pool()
              .query("select 1 from pg_catalog.pg_stat_activity where pid = $1", [first])
          ).rowCount === 0,
        { message: "PgBouncer closed the session's first backend" },
      );
      const exec = execTask(locks, "w");
      await track(
        await startRunner({ connectionString: db.url, concurrency: 1, taskList: { exec } }),
      );
      await utils!.addJob("exec", { k: "elsewhere" } satisfies Payload);
      await waitFor(async () => locks.status().state === "refused", {
        message: "the session refused",
      });
      // PgBouncer keeps that backend for a second more: the key would show as held by it.
      expect(await advisoryLockHolders()).toEqual([]);
      await waitFor(async () => (await jobCount("last_error is not null")) === 1);
      expect(await readExecutions(db.pool())).toEqual([]);
    });

    it("a lock session whose backend the pooler resets between transactions is refused before any job runs", async () => {
      // PgBouncer running its reset (DISCARD ALL, which ends every session lock) after every transaction, one
      // backend, no room for the probe's client: the pid never changes, only the session's mark goes.
      const resetting = await startForTest({
        settings: { max_client_conn: 1, default_pool_size: 1, server_reset_query_always: 1 },
      });
      const locks = track(
        makeLocks({
          connectionString: db.url,
          lockConnectionString: resetting.via(db.url),
          logger: quietLogger,
        }),
      );
      await locks.connect();
      const exec = execTask(locks, "w");
      await track(
        await startRunner({ connectionString: db.url, concurrency: 1, taskList: { exec } }),
      );
      await utils!.addJob("exec", { k: "reset" } satisfies Payload);
      await waitFor(async () => (await jobCount("last_error is not null")) === 1, {
        message: "the job failed",
      });
      const { rows } = await db
        .pool()
        .query<{ last_error: string }>("select last_error from graphile_worker._private_jobs");
      expect(rows[0]?.last_error).toContain("graphile_worker_locks.session");
      expect(locks.status().state).toBe("refused");
      expect(await readExecutions(db.pool())).toEqual([]);
    });

    it("a second lock session a pooler puts on a claimed backend is refused, where the probe cannot run", async () => {
      // One backend, two clients: with a third client (the probe's) never let in, only the claim on the
      // backend can tell that both sessions share it.
      const single = await startForTest({ settings: { max_client_conn: 2, default_pool_size: 1 } });
      const { logger, warnings } = warningsLogger();
      const make = (i: number) =>
        track(
          makeLocks({
            connectionString: db.url,
            lockConnectionString: single.via(db.url),
            logger,
            applicationName: `graphile-worker-locks/shared-${i}`,
          }),
        );
      const occupant = await occupy(single.via(db.url));
      const first = make(0);
      await first.connect();
      expect(warnings.join("\n")).toContain("Could not probe the proxy");
      await occupant.end();

      const second = make(1);
      // (PgBouncer may not have seen the occupant go yet: the session then retries, and meets the claim)
      await second.connect().catch(() => undefined);
      await waitFor(async () => second.status().state === "refused", {
        message: "the second session refused",
      });
      const refusal = await second.connect().then(
        () => null,
        (e: unknown) => e as LocksError,
      );
      expect(refusal?.code).toBe("GWL_LOCK_SESSION_POOLED");
      expect(refusal?.message).toContain("already marked by another lock session");
      expect(first.status().state).toBe("ready");
    });

    it("a session refused for reaching another backend names the pooler settings that free what it took on its own", async () => {
      // Two backends, two clients. The occupant keeps the probe's client out at connect, then pins the
      // session's backend in a transaction while a job holds its key there: the session's next heartbeat
      // runs on a second backend, and the session is refused with the key still held on its own.
      const pool = await startForTest({ settings: { max_client_conn: 2, default_pool_size: 2 } });
      const { logger, warnings } = warningsLogger();
      const occupant = await occupy(pool.via(db.url));
      cleanup.push(() => occupant.end().catch(() => undefined));
      const locks = track(
        makeLocks({
          connectionString: db.url,
          lockConnectionString: pool.via(db.url),
          heartbeatInterval: 100,
          logger,
        }),
      );
      await locks.connect();
      expect(warnings.join("\n")).toContain("Could not probe the proxy");
      const own = locks.status().pid!;

      const exec = execTask(locks, "w");
      await track(
        await startRunner({ connectionString: db.url, concurrency: 1, taskList: { exec } }),
      );
      await utils!.addJob("exec", { k: "held", hold: true } satisfies Payload);
      await waitFor(async () => (await advisoryLockHolders()).includes(own), {
        message: "the job's key held on the session's backend",
      });

      const lost = nextEvent(locks, "lock:lost");
      await occupant.query("begin");
      const { rows } = await occupant.query<{ pid: number }>("select pg_backend_pid() as pid");
      expect(rows[0]!.pid).toBe(own);
      const event = await lost;
      const refusal = event.error as LocksError;
      expect(refusal.code).toBe("GWL_LOCK_SESSION_POOLED");
      expect(event.holds).toHaveLength(1);
      // The refusal says where the locks it took stay, and which of the pooler's settings end them.
      expect(refusal.message).toContain(`the session's backend ${own}`);
      expect(refusal.message).toContain(`took on backend ${own} stay held`);
      expect(refusal.message).toContain("`server_idle_timeout`");
      expect(refusal.message).toContain("`server_lifetime`");
      expect(refusal.message).toContain("`lockConnectionString`");
      // Nothing is silently unsafe: the holder saw its abort signal and ended, the session is refused for
      // good, and a later job fails instead of running.
      await waitFor(async () => (await readExecutions(db.pool()))[0]?.end !== null, {
        message: "the held job ended",
      });
      expect(locks.status().state).toBe("refused");
      expect((await locks.connect().catch((e: unknown) => e as LocksError))?.code).toBe(
        "GWL_LOCK_SESSION_POOLED",
      );
      await utils!.addJob("exec", { k: "later" } satisfies Payload);
      await waitFor(
        async () => (await jobCount("payload->>'k' = 'later' and last_error is not null")) === 1,
      );
      expect((await readExecutions(db.pool())).map((e) => e.lockKey)).toEqual([
        exec.lockKey({ k: "held" }).toString(),
      ]);
      // The key stays held, unused, on the session's backend (where no other lock session can be) ...
      expect(await advisoryLockHolders()).toEqual([own]);
      // ... until the pooler closes that backend, as the refusal says: here once it is idle for a second.
      await pool.reload({ server_idle_timeout: 1 });
      await occupant.query("commit");
      await waitFor(
        async () =>
          (await db.pool().query("select 1 from pg_catalog.pg_stat_activity where pid = $1", [own]))
            .rowCount === 0,
        { message: "PgBouncer closed the session's backend" },
      );
      expect(await advisoryLockHolders()).toEqual([]);
    });
  });
}
