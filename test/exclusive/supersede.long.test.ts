/**
 * Supersede across three worker processes (test/fixtures/supersede-worker.ts), with every execution
 * recorded on the database clock: rounds that measure how soon the running job's signal fires after the
 * superseding enqueue and how soon the new job starts after the old one returned (printed; the bench's
 * `supersede` section reports them), and a random mix of superseding and plain enqueues over a few keys in
 * which no key ever runs two jobs at once and every job is accounted for. Long: TEST_LONG=1.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ErrorCodes, makeLocks, type Locks } from "../../src/index.js";
import { useTestDatabase, waitFor } from "../support/db.js";
import { maxConcurrencyPerKey, readEvents, readExecutions } from "../support/executions.js";
import { startWorkerProcess, type WorkerProcess } from "../support/processes.js";
import { quietLogger } from "../support/runner.js";

const db = useTestDatabase();
let locks: Locks;
let workers: WorkerProcess[] = [];

beforeAll(async () => {
  locks = makeLocks({ connectionString: db.url, logger: quietLogger });
  locks.define("sup", {
    exclusive: true,
    onConflict: "reschedule",
    supersede: true,
    key: (p: { k: string }) => ({ k: p.k }),
  });
  for (const name of ["A", "B", "C"])
    workers.push(
      await startWorkerProcess(db.url, { name, concurrency: 4, script: "supersede-worker.ts" }),
    );
});
afterAll(async () => {
  await Promise.all(workers.map((w) => w.stop()));
  workers = [];
  await locks?.release();
});

const q = <R extends object>(text: string, values: unknown[] = []) =>
  db.pool().query<R & Record<string, unknown>>(text, values);

async function reset() {
  await q("truncate test_executions, test_events; delete from graphile_worker._private_jobs");
}

const drained = () =>
  waitFor(
    async () =>
      (await q<{ n: number }>("select count(*)::int as n from graphile_worker._private_jobs"))
        .rows[0]!.n === 0,
    { timeoutMs: 120_000, message: "every job to finish" },
  );

const p50 = (values: number[]) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor((sorted.length - 1) / 2)]!;
};

describe("supersede across three processes", () => {
  it("30 rounds: the running job's signal fires, the new job runs after it returns, once", async () => {
    await reset();
    // (a job that parked runs under its copy's id: executions are told apart by their `n`)
    const rounds: Array<{ old: string; newer: string; n: number; enqueuedMs: number }> = [];
    for (let i = 0; i < 30; i++) {
      const k = `r${i}`;
      const n = 2 * i + 1;
      const old = (await locks.addJob("sup", { k, n }, { supersede: false })).job!;
      await waitFor(
        async () =>
          (await q("select 1 from test_executions where job_id = $1 and task = 'sup'", [old.id]))
            .rows.length > 0,
        { message: `job ${old.id} to start` },
      );
      const newer = (await locks.addJob("sup", { k, n: n + 1, ms: 10 })).job!;
      rounds.push({ old: old.id, newer: newer.id, n, enqueuedMs: newer.created_at.getTime() });
      await waitFor(
        async () =>
          (
            await q("select 1 from test_executions where note = $1 and ended_at is not null", [
              String(n + 1),
            ])
          ).rows.length > 0,
        { message: `job ${newer.id} to run` },
      );
    }
    await drained();
    const executions = await readExecutions(db.pool(), "sup");
    const aborted = await q<{
      job_id: string;
      ms: number;
      detail: { code: string; byJobId: string };
    }>(
      "select job_id::text, extract(epoch from at) * 1000 as ms, detail from test_events where kind = 'aborted'",
    );
    const stopMs: number[] = [];
    const startMs: number[] = [];
    for (const round of rounds) {
      const seen = aborted.rows.filter((r) => r.job_id === round.old);
      expect(seen.map((r) => r.detail)).toEqual([
        { code: ErrorCodes.SUPERSEDED, byJobId: round.newer },
      ]);
      stopMs.push(Number(seen[0]!.ms) - round.enqueuedMs);
      const old = executions.filter((e) => e.note === String(round.n));
      const newer = executions.filter((e) => e.note === String(round.n + 1));
      expect(old).toHaveLength(1);
      expect(newer).toHaveLength(1);
      expect(newer[0]!.start).toBeGreaterThanOrEqual(old[0]!.end!);
      startMs.push(Number(newer[0]!.start - old[0]!.end!) / 1000);
    }
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    console.info(
      `supersede, 30 rounds, database clock: enqueue → signal p50 ${p50(stopMs).toFixed(1)} ms ` +
        `(max ${Math.max(...stopMs).toFixed(1)}), old job's end → new job's start p50 ${p50(startMs).toFixed(1)} ms ` +
        `(max ${Math.max(...startMs).toFixed(1)})`,
    );
  });

  it("a random mix over 6 keys: never two jobs of a key at once, every job ran once or was superseded", async () => {
    await reset();
    const keys = ["a", "b", "c", "d", "e", "f"];
    let seed = 7;
    const random = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    const removed: string[] = [];
    let total = 0;
    for (let n = 1; n <= 150; n++) {
      const k = keys[Math.floor(random() * keys.length)]!;
      const result = await locks.addJob(
        "sup",
        { k, n, ms: 20 + Math.floor(random() * 150), ignore: random() < 0.3 },
        { supersede: random() < 0.4 },
      );
      total++;
      removed.push(...(result.superseded ?? []));
      if (random() < 0.3) await new Promise((resolve) => setTimeout(resolve, 20));
    }
    // The last job of each key supersedes: it must run.
    for (const k of keys) {
      const result = await locks.addJob("sup", { k, n: 1000 + keys.indexOf(k), ms: 10 });
      total++;
      removed.push(...(result.superseded ?? []));
    }
    await drained();
    const executions = await readExecutions(db.pool(), "sup");
    expect(Math.max(...maxConcurrencyPerKey(executions).values())).toBe(1);
    // Every execution ran to its end in its first attempt (a superseded job is completed, never retried),
    // and no job ran twice.
    expect(executions.every((e) => e.end !== null && e.attempts === 1)).toBe(true);
    const notes = executions.map((e) => e.note);
    expect(new Set(notes).size).toBe(notes.length);
    for (const k of keys)
      expect(notes.filter((note) => note === String(1000 + keys.indexOf(k)))).toHaveLength(1);
    // Every job has an outcome: it ran, or was removed waiting, or was ended on its way to the key.
    const superseded = await readEvents(db.pool(), "superseded");
    const starting = superseded.filter((e) => (e.detail as { state: string }).state === "starting");
    expect(executions.length + removed.length + starting.length).toBe(total);
    console.info(
      `random mix: ${total} jobs, ${executions.length} ran (${superseded.length - starting.length} of them superseded while running), ${removed.length} removed waiting, ${starting.length} ended on their way`,
    );
  });
});
