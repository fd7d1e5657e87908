/**
 * Section "rates": the throttle per key (method and figures: bench/README.md, section "Rates").
 * 1. The admission statement's cost, the sliding log (rate_admit) against a GCRA of one timestamp per key
 *    (a function of this section only), at limits 10, 100 and 1000, on one key, every start admitted (a
 *    period of 1 µs keeps the log full), alternating A and B slice by slice.
 * 2. A throttled key with a backlog: one runner (concurrency 8, attached), every job of one key; starts
 *    per period over the limit, each start's lateness after its slot freed (the limit-th previous start plus
 *    the period), and fetches per executed job (starts plus give-backs plus parks, over starts). Twice: a
 *    task with a rate only, and one that also takes its key's execution lock (`reschedule`).
 * 3. An unthrottled job of a throttled task (a lock and a rate it never meets) against a plain exclusive job
 *    and a plain graphile-worker job, alternating (noop-run.ts): what the rate adds per job, in time and in
 *    PostgreSQL's CPU, against what one lock statement adds; and the same for a `reschedule` task.
 */
import pg from "pg";
import { library } from "./library.js";
import { fmtFixed, fmtInt, goal, insertJobs, median, now, percentile, quietLogger } from "./lib.js";
import { sizedSection, startRunner, table, waitUntilNoJobs, type BenchContext } from "./lib.js";
import { NOOP_CONCURRENCY, noopRun, type NoopPayload, type NoopRun } from "./noop-run.js";
import type { Task } from "graphile-worker";
import type { ExclusiveOptions } from "../src/index.js";

/**
 * A backlog run: `jobs` on one key at `limit` per `periodMs`, each job taking `taskMs`; `lock`: the task also
 * takes its key's execution lock (`reschedule`).
 */
interface BacklogRun {
  jobs: number;
  limit: number;
  periodMs: number;
  taskMs: number;
  lock: boolean;
}
const SIZES: Record<
  "full" | "quick",
  {
    statements: number;
    slices: number;
    backlog: BacklogRun;
    lockBacklog: BacklogRun;
    jobs: number;
  }
> = {
  full: {
    statements: 2000,
    slices: 6,
    backlog: { jobs: 600, limit: 50, periodMs: 1000, taskMs: 0, lock: false },
    lockBacklog: { jobs: 160, limit: 20, periodMs: 1600, taskMs: 25, lock: true },
    jobs: 3000,
  },
  quick: {
    statements: 200,
    slices: 2,
    backlog: { jobs: 60, limit: 10, periodMs: 500, taskMs: 0, lock: false },
    lockBacklog: { jobs: 30, limit: 5, periodMs: 500, taskMs: 25, lock: true },
    jobs: 200,
  },
};
type Size = (typeof SIZES)["full"];

const GCRA = `
  create table if not exists bench_gcra (k bigint primary key, tat timestamptz not null);
  create or replace function bench_gcra_start(p_key bigint, p_limit int, p_period interval, p_burst int)
  returns boolean language plpgsql as $$
  declare v_tat timestamptz; v_now timestamptz; v_t interval := p_period / p_limit;
  begin
    insert into bench_gcra values (p_key, '-infinity') on conflict do nothing;
    select tat into v_tat from bench_gcra where k = p_key for update;
    v_now := clock_timestamp();
    if greatest(v_tat, v_now) - v_now > v_t * (p_burst - 1) then return false; end if;
    update bench_gcra set tat = greatest(v_tat, v_now) + v_t where k = p_key;
    return true;
  end $$;`;

/** µs per admission statement of each variant, alternating slice by slice. */
async function statementCost(ctx: BenchContext, size: Size, limit: number) {
  const client = new pg.Client({ connectionString: ctx.url });
  await client.connect();
  try {
    await client.query(GCRA);
    // (the admission statement of the build under test: rate_admit, or rate_start before it)
    const { rows } = await client.query<{ admit: boolean }>(
      "select to_regproc('graphile_worker_locks.rate_admit') is not null as admit",
    );
    const log = `select admitted from graphile_worker_locks.${rows[0]!.admit ? "rate_admit" : "rate_start"}(0, $1, 'bench', $2, interval '1 microsecond', $2, '{}', null, interval '0', interval '0', interval '0', interval '0', false, false)`;
    const gcra = `select bench_gcra_start($1, $2, interval '1 microsecond', $2)`;
    const per = { log: [] as number[], gcra: [] as number[] };
    const n = Math.ceil(size.statements / size.slices);
    for (let slice = 0; slice < size.slices; slice++) {
      const order = slice % 2 === 0 ? (["log", "gcra"] as const) : (["gcra", "log"] as const);
      for (const variant of order) {
        const text = variant === "log" ? log : gcra;
        const t0 = now();
        for (let i = 0; i < n; i++) await client.query(text, [String(limit), limit]);
        per[variant].push(((now() - t0) * 1000) / n);
      }
    }
    return { log: median(per.log), gcra: median(per.gcra) };
  } finally {
    await client.end();
  }
}

/**
 * A backlog on one key. With a lock, the jobs take `taskMs` each (an API call, say), so the starts of a
 * period come one after another, each once the one before it ended, spread over part of the period; fetches
 * then count parks too. The rate, not the hand-offs, still sets the pace: a period's jobs one after another
 * take well under the period.
 */
async function backlog(ctx: BenchContext, run: BacklogRun) {
  const { limit, periodMs, lock } = run;
  const locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  const starts: number[] = [];
  let throttled = 0;
  let parked = 0;
  locks.events.on("rate:admitted", (e) => starts.push(e.at.getTime()));
  locks.events.on("job:throttled", () => throttled++);
  locks.events.on("job:rescheduled", () => parked++);
  const work =
    run.taskMs > 0
      ? () => new Promise<void>((resolve) => setTimeout(resolve, run.taskMs))
      : async () => undefined;
  const task = locks.exclusive("bench_rated", work, {
    lock,
    ...(lock ? { onConflict: "reschedule" as const } : {}),
    key: () => "one",
    rate: { limit, period: periodMs },
  });
  await insertJobs(ctx.pool, "bench_rated", run.jobs);
  const runner = await startRunner({
    connectionString: ctx.url,
    concurrency: 8,
    pollInterval: 2000,
    taskList: { bench_rated: task },
  });
  locks.attach(runner);
  try {
    await waitUntilNoJobs(ctx.pool, 10 * 60_000);
  } finally {
    await runner.stop();
    await locks.release();
  }
  starts.sort((a, b) => a - b);
  const late = starts.slice(limit).map((s, i) => s - (starts[i]! + periodMs));
  const span = starts[starts.length - 1]! - starts[0]!;
  return {
    perPeriod: ((starts.length - 1) * periodMs) / span / limit,
    p50: percentile(late, 50),
    p99: percentile(late, 99),
    fetches: (starts.length + throttled + parked) / starts.length,
    giveBacks: throttled / starts.length,
    parks: parked / starts.length,
  };
}

/**
 * An unthrottled job of a throttled task, against a plain exclusive job and a plain graphile-worker job (what
 * one lock statement costs is the plain exclusive run less that one), and a job with a rate and no lock:
 * no-op jobs of distinct keys, each key far below its rate, the variants alternating slice by slice.
 */
const UNTHROTTLED: Array<{
  label: string;
  options: ExclusiveOptions<NoopPayload> | null;
  body?: Task;
}> = [
  { label: "no lock, no rate (graphile-worker alone)", options: null },
  { label: "plain exclusive (a lock)", options: {} },
  { label: "lock + rate", options: { rate: { limit: 1_000_000, period: 1000 } } },
  {
    label: "rate only (no lock)",
    options: { lock: false, rate: { limit: 1_000_000, period: 1000 } },
  },
  // The floor of a start counted in the database: a plain task whose job upserts one row of its own key,
  // in one prepared statement on graphile-worker's connection, as a rate's start does.
  {
    label: "no lock, the job upserts a row (a write's floor)",
    options: null,
    body: async (payload, helpers) => {
      await helpers.withPgClient((client) =>
        client.query({
          name: "bench_floor_upsert",
          text: `insert into bench_floor as f (k, n) values ($1, 1)
            on conflict (k) do update set n = f.n + 1`,
          values: [(payload as NoopPayload).i],
        }),
      );
    },
  },
  // The same pair for a task that waits its turn: its lock statement also reads its key's line.
  { label: "plain exclusive, reschedule", options: { onConflict: "reschedule" } },
  {
    label: "lock (reschedule) + rate",
    options: { onConflict: "reschedule", rate: { limit: 1_000_000, period: 1000 } },
  },
];

async function unthrottled(ctx: BenchContext, size: Size): Promise<NoopRun[]> {
  const runs = UNTHROTTLED.map(() => [] as NoopRun[]);
  const jobs = Math.ceil(size.jobs / size.slices);
  await ctx.pool.query(
    "create table if not exists bench_floor (k bigint primary key, n int not null)",
  );
  for (const v of UNTHROTTLED)
    await noopRun(ctx, "bench_unthrottled", v.options, Math.min(200, jobs), v.body);
  for (let slice = 0; slice < size.slices; slice++) {
    // (the order turns each slice, so that no variant always runs first or last)
    for (let j = 0; j < UNTHROTTLED.length; j++) {
      const i = (j + slice) % UNTHROTTLED.length;
      ctx.log(`rates: unthrottled, ${UNTHROTTLED[i]!.label}, slice ${slice + 1}/${size.slices}`);
      const v = UNTHROTTLED[i]!;
      runs[i]!.push(await noopRun(ctx, "bench_unthrottled", v.options, jobs, v.body));
    }
  }
  return runs.map((rs) => ({
    jobsPerSecond: median(rs.map((r) => r.jobsPerSecond)),
    statementsPerJob: median(rs.map((r) => r.statementsPerJob)),
    serverCpuUsPerJob: median(rs.map((r) => r.serverCpuUsPerJob)),
  }));
}

export const rates = sizedSection(
  { id: "rates", title: "Throttle per key", sizes: SIZES, rounds: 1 },
  async (ctx, size) => {
    const costs: Array<{ limit: number; log: number; gcra: number }> = [];
    for (const limit of [10, 100, 1000])
      costs.push({ limit, ...(await statementCost(ctx, size, limit)) });
    const b = await backlog(ctx, size.backlog);
    const bl = await backlog(ctx, size.lockBacklog);
    const u = await unthrottled(ctx, size);
    const us = u.map((r) => 1e6 / r.jobsPerSecond);
    const lockUs = us[1]! - us[0]!;
    const rateUs = us[2]! - us[1]!;
    const lockCpu = u[1]!.serverCpuUsPerJob - u[0]!.serverCpuUsPerJob;
    const rateCpu = u[2]!.serverCpuUsPerJob - u[1]!.serverCpuUsPerJob;
    const lineLockUs = us[5]! - us[0]!;
    const lineRateUs = us[6]! - us[5]!;
    return {
      tables: [
        table(
          "Rates: the admission statement, µs (median of slices, A and B alternating)",
          "limit | sliding log | GCRA",
          costs.map((c) => [String(c.limit), fmtFixed(c.log, 0), fmtFixed(c.gcra, 0)]),
        ),
        table(
          `Rates: a backlog on one key, concurrency 8: ${size.backlog.jobs} jobs at ${size.backlog.limit} per ${size.backlog.periodMs} ms; with a lock, ${size.lockBacklog.jobs} jobs of ${size.lockBacklog.taskMs} ms at ${size.lockBacklog.limit} per ${size.lockBacklog.periodMs} ms`,
          "task | starts per period / limit | start after slot p50 (ms) | p99 (ms) | fetches per job | give-backs per job | parks per job",
          (
            [
              ["rate only", b],
              ["rate and lock (reschedule)", bl],
            ] as const
          ).map(([label, x]) => [
            label,
            fmtFixed(x.perPeriod, 3),
            fmtFixed(x.p50, 1),
            fmtFixed(x.p99, 1),
            fmtFixed(x.fetches, 2),
            fmtFixed(x.giveBacks, 2),
            fmtFixed(x.parks, 2),
          ]),
        ),
        table(
          `Rates: an unthrottled job of a throttled task (${Math.ceil(size.jobs / size.slices)} no-op jobs of distinct keys a slice, concurrency ${NOOP_CONCURRENCY}, medians of ${size.slices} slices)`,
          "variant | jobs/s | µs per job | PostgreSQL CPU µs/job",
          UNTHROTTLED.map((v, i) => [
            v.label,
            fmtInt(u[i]!.jobsPerSecond),
            fmtInt(1e6 / u[i]!.jobsPerSecond),
            fmtInt(u[i]!.serverCpuUsPerJob),
          ]),
          [
            "One lock statement's cost: the plain exclusive row less the first row; the rate's: the lock + rate row less the plain exclusive row (with reschedule: the last row less the one before it, against that one less the first).",
          ],
        ),
      ],
      goals: [
        goal("backlog starts per period / limit", "≥ 0.98", b.perPeriod, b.perPeriod >= 0.98),
        goal("start after slot p50", "≤ 20 ms", b.p50, b.p50 <= 20),
        goal("start after slot p99", "≤ 100 ms", b.p99, b.p99 <= 100),
        goal("fetches per executed job", "≤ 2", b.fetches, b.fetches <= 2),
        goal(
          "with a lock: backlog starts per period / limit",
          "≥ 0.98",
          bl.perPeriod,
          bl.perPeriod >= 0.98,
        ),
        // (with a lock, a job whose slot comes while the job before it still runs also parks once)
        goal("with a lock: give-backs per executed job", "≤ 1", bl.giveBacks, bl.giveBacks <= 1),
        goal(
          `unthrottled: the rate's PostgreSQL CPU per job ÷ one lock statement's (${fmtInt(lockCpu)} µs)`,
          "≤ 1",
          rateCpu / lockCpu,
          rateCpu <= lockCpu,
        ),
        goal(
          `unthrottled: the rate's time per job ÷ one lock statement's (${fmtInt(lockUs)} µs)`,
          "≤ 1",
          rateUs / lockUs,
          rateUs <= lockUs,
        ),
        goal(
          `unthrottled, reschedule: the rate's time per job ÷ one lock statement's (${fmtInt(lineLockUs)} µs)`,
          "≤ 1",
          lineRateUs / lineLockUs,
          lineRateUs <= lineLockUs,
        ),
      ],
      figures: {
        costs,
        backlog: b,
        backlogWithLock: bl,
        unthrottled: { variants: UNTHROTTLED.map((v) => v.label), results: u },
      },
    };
  },
);
