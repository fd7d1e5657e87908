/**
 * Bulk unique enqueue (`locks.addJobs`) against real PostgreSQL: in-batch and existing duplicates, order,
 * what it reads and carries, holders' scopes, and raise.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import { UniqueConflictError } from "../../../src/index.js";
import { useUniqueHarness } from "../../support/unique.js";

const h = useUniqueHarness();
const { db, client, jobCount } = h;

describe("bulk", () => {
  it("dedupes within the batch and against existing jobs in one statement, an outcome per item", async () => {
    const existing = await h.locks.addJob("b", { k: "old" }, { unique: "queued" });
    const counting = await client();
    let statements = 0;
    const counted = {
      query: (...args: Parameters<pg.Client["query"]>) => {
        statements++;
        return (counting.query as (...a: unknown[]) => unknown)(...args);
      },
    } as unknown as pg.Client;
    const results = await h.locks.addJobs(
      [
        { identifier: "b", payload: { k: "new" }, unique: "queued" },
        { identifier: "b", payload: { k: "old" }, unique: "queued" },
        { identifier: "b", payload: { k: "new" }, unique: "queued" },
        { identifier: "b", payload: { k: "plain" } },
        { identifier: "b", payload: { k: "plain" } },
        { identifier: "b", payload: { k: "win" }, uniqueFor: 60 },
        { identifier: "b", payload: { k: "win" }, uniqueFor: 60 },
      ],
      { pgClient: counted },
    );
    expect(statements).toBe(1);
    expect(results.map((r) => r.outcome)).toEqual([
      "added",
      "duplicate",
      "duplicate",
      "added",
      "added",
      "added",
      "duplicate",
    ]);
    expect(results[1]!.job!.id).toBe(existing.job!.id);
    expect(results[2]!.job!.id).toBe(results[0]!.job!.id);
    expect(results[6]!.job!.id).toBe(results[5]!.job!.id);
    expect(await jobCount()).toBe(5);
  });

  it("adds a small batch in the order given: ids ascend with the items, each result its own job", async () => {
    // (graphile-worker 0.18's add_jobs, planned as a hash join with no order, inserts a batch this small
    // last item first, and its addJobs then labels the jobs of a mixed batch with each other's tasks)
    const items = Array.from({ length: 6 }, (_, i) => ({
      identifier: i % 2 ? "ord_x" : "ord_y",
      payload: { i },
      ...(i === 4 ? { unique: "queued" as const } : {}),
    }));
    const results = await h.locks.addJobs(items);
    expect(results.map((r) => r.outcome)).toEqual(Array(6).fill("added"));
    const ids = results.map((r) => BigInt(r.job!.id));
    for (let i = 1; i < ids.length; i++) expect(ids[i]! > ids[i - 1]!).toBe(true);
    expect(results.map((r) => (r.job!.payload as { i: number }).i)).toEqual([0, 1, 2, 3, 4, 5]);
    expect(results.map((r) => r.job!.task_identifier)).toEqual(
      items.map((item) => item.identifier),
    );
    const { rows } = await db.pool().query<{ id: string; task_identifier: string; i: number }>(
      `select j.id::text, t.identifier as task_identifier, (j.payload->>'i')::int as i
       from graphile_worker._private_jobs j join graphile_worker._private_tasks t on t.id = j.task_id
       where j.id = any($1::bigint[]) order by j.id`,
      [ids.map(String)],
    );
    expect(rows.map((row) => row.i)).toEqual([0, 1, 2, 3, 4, 5]);
    expect(rows.map((row) => row.task_identifier)).toEqual(items.map((item) => item.identifier));
  });

  it("reads no more of the job table than the batch, however full the table is", async () => {
    // 20,000 jobs, analyzed. With them PostgreSQL once planned the read-back of a batch's rows as a hash join
    // or a merge join over the whole table. The batches run in one transaction, whose own reads of the job
    // table PostgreSQL counts (pg_stat_xact_user_tables: rows returned by sequential scans, and rows fetched
    // through indexes); they must stay within twice the items of the batches.
    await db.pool().query(
      `select count(*) from graphile_worker.add_jobs(array(
         select row('bulk_full', json_build_object('n', g), null, null, null, null, null, null)::graphile_worker.job_spec
         from generate_series(1, 20000) g))`,
    );
    await db.pool().query("analyze graphile_worker._private_jobs");
    const session = await client();
    const size = 1000;
    const plain = Array.from({ length: size }, (_, i) => ({
      identifier: "bulk_full",
      payload: { i },
    }));
    const unique = plain.map((item) => ({
      ...item,
      payload: { u: item.payload.i },
      unique: "active" as const,
    }));
    const batches = [plain, unique, [...plain.slice(0, 500), ...unique.slice(0, 500)]];
    await session.query("begin");
    for (const batch of batches) {
      const results = await h.locks.addJobs(batch, { pgClient: session });
      expect(results).toHaveLength(batch.length);
    }
    const { rows } = await session.query<{ seq: number; idx: number }>(
      `select coalesce(seq_tup_read, 0)::int as seq, coalesce(idx_tup_fetch, 0)::int as idx
       from pg_catalog.pg_stat_xact_user_tables
       where schemaname = 'graphile_worker' and relname = '_private_jobs'`,
    );
    await session.query("commit");
    expect(rows).toHaveLength(1);
    // 3,000 items read back once each, and each duplicate's holder: 3,500 rows. A scan of the table reads
    // more than 20,000.
    const items = batches.reduce((n, batch) => n + batch.length, 0);
    expect(rows[0]!.seq + rows[0]!.idx).toBeLessThanOrEqual(2 * items);
  });

  it("carries every spec field of a bulk item, set or left out, to the job it adds", async () => {
    const runAt = new Date(Date.now() + 3_600_000);
    const results = await h.locks.addJobs([
      {
        identifier: "bf",
        payload: { k: 1 },
        unique: "active",
        queueName: "bf-queue",
        runAt,
        priority: 3,
        maxAttempts: 4,
        flags: ["mine"],
      },
      { identifier: "bf2", payload: { k: 2 }, uniqueFor: 60, queueName: "bf-queue" },
      { identifier: "bf", payload: { k: 3 } },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "added", "added"]);
    expect(results.map((r) => r.job!.task_identifier)).toEqual(["bf", "bf2", "bf"]);
    const { rows: found } = await db.pool().query<{
      id: string;
      task_identifier: string;
      queue_name: string | null;
      run_at: Date;
      priority: number;
      max_attempts: number;
      flags: Record<string, unknown> | null;
      key: string | null;
    }>(
      `select id::text, task_identifier, queue_name, run_at, priority, max_attempts, flags, key
       from graphile_worker.jobs where id = any($1::bigint[])`,
      [results.map((r) => r.job!.id)],
    );
    const rows = results.map((r) => found.find((row) => row.id === r.job!.id)!);
    expect(rows[0]).toMatchObject({
      task_identifier: "bf",
      queue_name: "bf-queue",
      priority: 3,
      max_attempts: 4,
      flags: { mine: true, "gwl:unique:active": true },
    });
    expect(rows[0]!.run_at.getTime()).toBe(runAt.getTime());
    expect(rows[0]!.key).toMatch(/^gwl:u:[0-9a-f]{64}$/);
    // A window alone: no scope flag and no job key; the window is a row of its own, ending a minute from now.
    expect(rows[1]).toMatchObject({ task_identifier: "bf2", queue_name: "bf-queue", priority: 0 });
    expect(Object.keys(rows[1]!.flags ?? {}).filter((f) => f.startsWith("gwl:"))).toEqual([]);
    expect(rows[1]!.key).toBeNull();
    const windows = await db.pool().query<{ seconds: number }>(
      `select extract(epoch from expires_at - now())::float8 as seconds
         from graphile_worker_locks.unique_windows where job_id = $1::bigint`,
      [results[1]!.job!.id],
    );
    expect(windows.rows).toHaveLength(1);
    expect(windows.rows[0]!.seconds).toBeGreaterThan(50);
    expect(windows.rows[0]!.seconds).toBeLessThanOrEqual(60);
    // Nothing set: graphile-worker's defaults, no key, no flags.
    expect(rows[2]).toMatchObject({
      task_identifier: "bf",
      queue_name: null,
      priority: 0,
      max_attempts: 25,
      flags: null,
      key: null,
    });
    expect(Math.abs(rows[2]!.run_at.getTime() - Date.now())).toBeLessThan(60_000);
  });

  it("a holder out of its scope gives up its key to the batch; one in scope answers for every duplicate", async () => {
    const started = await h.locks.addJob("bs", { k: "started" }, { unique: "queued" });
    const waiting = await h.locks.addJob("bs", { k: "waiting" }, { unique: "queued" });
    const byK = (p: unknown) => (p as { k: string }).k;
    const replaceable = await h.locks.addJob(
      "bs",
      { k: "repl" },
      { unique: "queued", uniqueKey: byK },
    );
    // The first one has started: a `queued` job no longer refuses duplicates.
    await db
      .pool()
      .query(
        "update graphile_worker._private_jobs set locked_at = now(), locked_by = 'w', attempts = 1 where id = $1",
        [started.job!.id],
      );
    const results = await h.locks.addJobs([
      { identifier: "bs", payload: { k: "waiting" }, unique: "queued" },
      { identifier: "bs", payload: { k: "started" }, unique: "queued" },
      { identifier: "bs", payload: { k: "waiting" }, unique: "active" },
      { identifier: "bs", payload: { k: "started" }, unique: "queued" },
      {
        identifier: "bs",
        payload: { k: "repl", v: 2 },
        unique: "queued",
        uniqueKey: byK,
        onDuplicate: "replace",
      },
    ]);
    expect(results.map((r) => r.outcome)).toEqual([
      "duplicate",
      "added",
      "duplicate",
      "duplicate",
      "replaced",
    ]);
    expect(results[0]!.job!.id).toBe(waiting.job!.id);
    expect(results[2]!.job!.id).toBe(waiting.job!.id);
    expect(results[1]!.job!.id).not.toBe(started.job!.id);
    expect(results[3]!.job!.id).toBe(results[1]!.job!.id);
    expect(results[4]!.job!.id).toBe(replaceable.job!.id);
    expect(results[4]!.job!.payload).toEqual({ k: "repl", v: 2 });
    // The started job keeps running without its key; the batch's job holds it now.
    const { rows } = await db
      .pool()
      .query<{ id: string; key: string | null }>(
        "select id::text, key from graphile_worker._private_jobs where id = any($1::bigint[]) order by id",
        [[started.job!.id, results[1]!.job!.id]],
      );
    expect(rows.map((r) => r.key === null)).toEqual([true, false]);
    expect(await jobCount()).toBe(4);
  });

  it("a duplicate's job is its holder, of whichever task, or null once a window outlived it", async () => {
    const holder = await h.locks.addJob(
      "bg_push",
      { user: 1 },
      { unique: "queued", uniqueGroup: "bg" },
    );
    const gone = await h.locks.addJob("bg_mail", { user: 2 }, { uniqueFor: 600 });
    await h.utils.completeJobs([gone.job!.id]);
    const items = [{ user: 3 }, { user: 1 }, { user: 2 }, { user: 4 }];
    const results = await h.locks.addJobs([
      { identifier: "bg_mail", payload: items[0], unique: "queued", uniqueGroup: "bg" },
      { identifier: "bg_mail", payload: items[1], unique: "queued", uniqueGroup: "bg" },
      { identifier: "bg_mail", payload: items[2], uniqueFor: 600 },
      { identifier: "bg_mail", payload: items[3] },
    ]);
    expect(results.map((r) => r.outcome)).toEqual(["added", "duplicate", "duplicate", "added"]);
    expect(results[1]!.job!.id).toBe(holder.job!.id);
    expect(results[1]!.job!.task_identifier).toBe("bg_push");
    expect(results[1]!.job!.payload).toEqual({ user: 1 });
    expect(results[2]!.job).toBeNull();
    for (const i of [0, 3]) {
      expect(results[i]!.job!.task_identifier).toBe("bg_mail");
      expect(results[i]!.job!.payload).toEqual(items[i]);
    }
    // (every item added: one row each, in order, with nothing else in it; tasks and queues are named by
    // their place in the batch)
    const fresh = await h.locks.addJobs([
      { identifier: "bg_mail", payload: { user: 5 }, unique: "queued", queueName: "q2" },
      { identifier: "bg_push", payload: { user: 6 }, queueName: "q1" },
      { identifier: "bg_mail", payload: { user: 7 }, queueName: "q1" },
      { identifier: "bg_new", payload: { user: 8 } },
    ]);
    expect(fresh.map((r) => [r.outcome, r.job!.payload, r.job!.task_identifier])).toEqual([
      ["added", { user: 5 }, "bg_mail"],
      ["added", { user: 6 }, "bg_push"],
      ["added", { user: 7 }, "bg_mail"],
      ["added", { user: 8 }, "bg_new"],
    ]);
    const { rows: stored } = await db
      .pool()
      .query<{ task_identifier: string; queue_name: string }>(
        `select task_identifier, queue_name from graphile_worker.jobs where id = any($1::bigint[]) order by id`,
        [fresh.map((r) => r.job!.id)],
      );
    expect(stored.map((r) => [r.task_identifier, r.queue_name])).toEqual([
      ["bg_mail", "q2"],
      ["bg_push", "q1"],
      ["bg_mail", "q1"],
      ["bg_new", null],
    ]);
    expect(Object.keys(fresh[0]!.job!).sort()).toEqual(Object.keys(holder.job!).sort());
  });

  it("the bulk statement answers one row per item in the single enqueue's shape, with no other row", async () => {
    // What each statement answers, as it comes back: its column names and its rows.
    const recording = await client();
    const answers: pg.QueryResult[] = [];
    const recorded = {
      query: async (...args: Parameters<pg.Client["query"]>) => {
        const result = await (recording.query as (...a: unknown[]) => Promise<pg.QueryResult>)(
          ...args,
        );
        answers.push(result);
        return result;
      },
    } as unknown as pg.Client;
    await h.locks.addJob("shape", { k: 1 }, { unique: "queued", pgClient: recorded });
    const [single] = answers.splice(0);
    // every item added, then duplicates of the batch and of an existing job, and a window alone
    await h.locks.addJobs(
      [
        { identifier: "shape", payload: { k: 2 } },
        { identifier: "shape", payload: { k: 3 }, unique: "queued" },
      ],
      { pgClient: recorded },
    );
    await h.locks.addJobs(
      [
        { identifier: "shape", payload: { k: 1 }, unique: "queued" },
        { identifier: "shape", payload: { k: 4 } },
        { identifier: "shape", payload: { k: 4 }, unique: "queued" },
        { identifier: "shape", payload: { k: 4 }, unique: "queued" },
        { identifier: "shape", payload: { k: 5 }, uniqueFor: 60 },
        { identifier: "shape", payload: { k: 5 }, uniqueFor: 60 },
      ],
      { pgClient: recorded },
    );
    const columns = (result: pg.QueryResult) => result.fields.map((f) => f.name);
    expect(columns(single!).slice(0, 2)).toEqual(["outcome", "task_identifier"]);
    expect(answers.map(columns)).toEqual([
      ["ord", ...columns(single!)],
      ["ord", ...columns(single!)],
    ]);
    const rows = answers.map((a) =>
      (a.rows as Array<{ ord: number; outcome: string; id: string | null }>)
        .map((r) => [r.ord, r.outcome, r.id !== null])
        .sort((x, y) => Number(x[0]) - Number(y[0])),
    );
    expect(rows).toEqual([
      [
        [1, "added", true],
        [2, "added", true],
      ],
      [
        [1, "duplicate", true],
        [2, "added", true],
        [3, "added", true],
        [4, "duplicate", true],
        [5, "added", true],
        [6, "duplicate", true],
      ],
    ]);
  });

  it("checks each holder inline: PostgreSQL inlines unique_job_blocks instead of calling it per row", async () => {
    // A SQL function with a subquery in its body is not inlined; called for each of a batch's duplicates,
    // its executor cost more than the check itself.
    const { rows } = await db.pool().query<{ "QUERY PLAN": unknown }>(
      `explain (verbose, format json)
         select graphile_worker_locks.unique_job_blocks(j) from graphile_worker._private_jobs j`,
    );
    const plan = JSON.stringify(rows[0]!["QUERY PLAN"]);
    expect(plan).toContain("jsonb_path_query_first");
    expect(plan).not.toContain("unique_job_blocks");
  });

  it("raise on any duplicate aborts the whole batch", async () => {
    const existing = await h.locks.addJob("br", { k: 1 }, { unique: "active" });
    const error = await h.locks
      .addJobs([
        { identifier: "br", payload: { k: 2 }, unique: "active" },
        { identifier: "br", payload: { k: 1 }, unique: "active", onDuplicate: "raise" },
      ])
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(UniqueConflictError);
    expect((error as UniqueConflictError).existingJobId).toBe(existing.job!.id);
    expect(await jobCount()).toBe(1);
  });
});
