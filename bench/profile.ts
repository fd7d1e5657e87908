/**
 * `node --import tsx bench/profile.ts [A|B ...]`: where the wrapper's time goes. Not part of `npm run bench`.
 *
 * Runs the throughput section's configurations with more variants and more instruments:
 * - async: the no-op inside one more async function, and keyonly: that plus the job's lock key derived (stable
 *   JSON, then SHA-256), with no lock and no state: what any wrapper that awaits the task, and any that
 *   derives this design's key, costs before it locks anything.
 * - nolock: the real wrapper (`makeExclusiveTask`) on a fake lock session that grants every key at once,
 *   without PostgreSQL: the wrapper's JavaScript cost alone (key derivation, abort plumbing, promises).
 * - every lock statement (`gwl_lock_batch_*`, `gwl_lock_plain_*`) is observed by patching `pg.Client.prototype.query`:
 *   how many unlock and lock requests each carried, how long it took, and how long the session sat idle
 *   between statements while jobs were waiting.
 * - per job (wrapped): time from the wrapper's call to the task's start (acquire) and from the task's end
 *   to the wrapper's return (release).
 * - CPU time per job of this process and of the PostgreSQL server (all its processes, from /proc; only
 *   meaningful for a local server), and of that, the lock session's own backend (wrapped).
 *
 * PROFILE_TIMED=0 leaves out the per-job timing of the wrapped and nolock variants (acquire ms, release ms).
 * PROFILE_JOBS overrides the job count (default: the throughput section's), PROFILE_ROUNDS the rounds
 * (default 2), PROFILE_VARIANTS (comma-separated, default plain,nolock,wrapped,naive; async, keyonly and naiveConn
 * too) the variants. Run under
 * `node --cpu-prof --cpu-prof-dir=<dir> --import tsx bench/profile.ts B` for a CPU profile.
 */
import { readdirSync, readFileSync } from "node:fs";
import pg from "pg";
import type { Task } from "graphile-worker";
import { internals, library } from "./library.js";
import {
  fmtFixed,
  fmtInt,
  formatTable,
  median,
  now,
  openBench,
  quietLogger,
  type Table,
} from "./lib.js";
import { CONFIGS, measure, openVariants, TASK, type Variant } from "./throughput.js";

const log = (message: string): void => {
  process.stderr.write(`[profile] ${message}\n`);
};

// --- Lock statements -----------------------------------------------------------------------------------

interface StatementStats {
  count: number;
  unlocks: number[];
  locks: number[];
  rttMs: number[];
  /** Time from the end of one lock statement to the start of the next. */
  gapMs: number[];
}

const statementStats = (): StatementStats => ({
  count: 0,
  unlocks: [],
  locks: [],
  rttMs: [],
  gapMs: [],
});
let stats = statementStats();
let lastEnd = Number.NaN;

/** Elements of a statement's array parameter: a JavaScript array, or an integer array literal (`{1,2,3}`). */
function elements(value: unknown[] | string | undefined): number {
  if (value === undefined) return 0;
  if (typeof value !== "string") return value.length;
  return value === "{}" ? 0 : value.split(",").length;
}

const originalQuery = pg.Client.prototype.query;
pg.Client.prototype.query = function patchedQuery(this: pg.Client, ...args: unknown[]) {
  const config = args[0] as { name?: string; values?: Array<unknown[] | string> } | undefined;
  if (
    config &&
    typeof config === "object" &&
    (config.name?.startsWith("gwl_lock_batch") || config.name?.startsWith("gwl_lock_plain"))
  ) {
    const start = now();
    if (Number.isFinite(lastEnd)) stats.gapMs.push(start - lastEnd);
    stats.count++;
    stats.unlocks.push(elements(config.values?.[0]));
    stats.locks.push(elements(config.values?.[1]) + elements(config.values?.[2]));
    const result = (originalQuery as (...a: unknown[]) => Promise<unknown>).apply(this, args);
    const done = () => {
      lastEnd = now();
      stats.rttMs.push(lastEnd - start);
    };
    result.then(done, done);
    return result;
  }
  return (originalQuery as (...a: unknown[]) => unknown).apply(this, args);
} as typeof pg.Client.prototype.query;

// --- PostgreSQL CPU time -------------------------------------------------------------------------------

const CLOCK_TICKS = 100; // USER_HZ on Linux

function procStat(pid: number): { ppid: number; cpuTicks: number } | undefined {
  try {
    const text = readFileSync(`/proc/${pid}/stat`, "utf8");
    const fields = text.slice(text.lastIndexOf(")") + 2).split(" ");
    // fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, cutime 16, cstime 17.
    const at = (n: number) => Number(fields[n - 3]);
    return { ppid: at(4), cpuTicks: at(14) + at(15) + at(16) + at(17) };
  } catch {
    return undefined;
  }
}

/** CPU seconds used so far by the postmaster `postmaster` and its children (including exited ones). */
function serverCpuSeconds(postmaster: number | undefined): number {
  if (postmaster === undefined) return Number.NaN;
  let ticks = procStat(postmaster)?.cpuTicks ?? 0;
  for (const entry of readdirSync("/proc")) {
    const pid = Number(entry);
    if (!Number.isInteger(pid) || pid === postmaster) continue;
    const stat = procStat(pid);
    if (stat?.ppid === postmaster) ticks += stat.cpuTicks;
  }
  return ticks / CLOCK_TICKS;
}

// --- Variants ------------------------------------------------------------------------------------------

interface Timed {
  acquireMs: number[];
  releaseMs: number[];
}

/** Wraps an exclusive task so that it records when the inner task starts and ends. */
function timedExclusive(makeTask: (inner: Task) => Task): { task: Task; timed?: Timed } {
  // PROFILE_TIMED=0: the wrapper around the plain no-op, without this timing (its own async layer, a map and
  // four clock reads per job), to compare the wrapper's cost with the async and keyonly floors.
  if (process.env.PROFILE_TIMED === "0") return { task: makeTask(async () => undefined) };
  const timed: Timed = { acquireMs: [], releaseMs: [] };
  const marks = new Map<string, { called: number; innerStart?: number; innerEnd?: number }>();
  const inner: Task = async (_payload, helpers) => {
    const m = marks.get(helpers.job.id);
    if (m) m.innerStart = now();
    if (m) m.innerEnd = now();
  };
  const wrapped = makeTask(inner);
  const task: Task = async (payload, helpers) => {
    const m: { called: number; innerStart?: number; innerEnd?: number } = { called: now() };
    marks.set(helpers.job.id, m);
    try {
      return await wrapped(payload, helpers);
    } finally {
      const end = now();
      marks.delete(helpers.job.id);
      if (m.innerStart !== undefined && m.innerEnd !== undefined) {
        timed.acquireMs.push(m.innerStart - m.called);
        timed.releaseMs.push(end - m.innerEnd);
      }
    }
  };
  return { task, timed };
}

// Internals, for the `nolock` variant only; kept to two functions and loose types so that refactors of
// src/ rarely break this file.
const {
  exclusive: { makeExclusiveTask },
  options: { resolveExclusiveOptions },
} = await internals();
type WrapperContext = Parameters<typeof makeExclusiveTask>[0];

/**
 * A context whose lock session grants every key at once, with a hold like the real one (its abort signal
 * made on first use), without PostgreSQL: the wrapper's own cost. Only the success path is exercised.
 */
function fakeContext(): WrapperContext {
  const sessionSignal = new AbortController().signal;
  const session = {
    async acquire(slots: readonly bigint[], info: unknown) {
      let controller: AbortController | undefined;
      const hold = {
        key: slots[0]!,
        info,
        since: new Date(),
        get signal() {
          controller ??= new AbortController();
          return controller.signal;
        },
        sessionSignal,
        release: async () => ({ released: true, outcome: "ok" as const }),
        releaseQuietly: () => undefined,
      };
      return { acquired: true, hold };
    },
  };
  return {
    session,
    sql: {},
    emit: () => undefined,
    listening: () => false,
    prefetched: () => undefined,
  } as unknown as WrapperContext;
}

// --- Main ----------------------------------------------------------------------------------------------

const wantedConfigs = process.argv.slice(2).length > 0 ? process.argv.slice(2) : ["A", "B"];
const wantedVariants = (process.env.PROFILE_VARIANTS ?? "plain,nolock,wrapped,naive").split(",");
const rounds = Number(process.env.PROFILE_ROUNDS ?? 2);

const bench = await openBench(log, false);
const { ctx } = bench;
const opened = await openVariants(ctx);
const cleanups: Array<() => Promise<void>> = [];
// Server CPU from /proc: only for the embedded server, which runs on this machine.
let postmaster: number | undefined;
if (bench.machine.postgresServer === "embedded") {
  const { rows } = await ctx.pool.query<{ pid: number }>("select pg_backend_pid() as pid");
  postmaster = procStat(rows[0]!.pid)?.ppid;
}

try {
  const base = Object.fromEntries(opened.variants.map((v) => [v.id, v])) as Record<string, Variant>;
  // The real wrapper, instrumented, on a Locks instance of its own.
  const locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  cleanups.push(() => locks.release());
  const wrapped = timedExclusive((inner) => locks.exclusive(TASK, inner, { onConflict: "drop" }));
  const nolock = timedExclusive((inner) =>
    makeExclusiveTask(
      fakeContext(),
      TASK,
      inner,
      resolveExclusiveOptions({ onConflict: "drop" }, undefined),
    ),
  );
  const variants: Array<{ variant: Variant; timed?: Timed }> = [];
  for (const id of wantedVariants) {
    if (id === "async" || id === "keyonly") {
      // Floors for any wrapper: one more async layer around the no-op (async), and that plus the key's
      // derivation (keyonly), with no lock and no state.
      const inner = base.plain!.task;
      const derive = id === "keyonly";
      variants.push({
        variant: {
          id,
          task: async (payload, helpers) => {
            if (derive) library.lockKey(TASK, payload);
            await inner(payload, helpers);
          },
          statements: () => 0,
          conflicts: () => 0,
        },
      });
    } else if (id === "nolock") {
      variants.push({
        variant: {
          id: "nolock",
          task: nolock.task,
          statements: () => 0,
          conflicts: () => 0,
        },
        timed: nolock.timed,
      });
    } else if (id === "wrapped") {
      variants.push({
        variant: {
          id: "wrapped",
          task: wrapped.task,
          statements: () => locks.status().statements,
          conflicts: () => 0,
          attach: (events) => locks.attach({ events }),
        },
        timed: wrapped.timed,
      });
    } else if (base[id]) {
      variants.push({ variant: base[id] });
    } else {
      throw new Error(`unknown variant ${id}`);
    }
  }

  for (const configId of wantedConfigs) {
    const config = CONFIGS.find((c) => c.id === configId);
    if (!config) throw new Error(`unknown config ${configId}`);
    const jobs = Number(process.env.PROFILE_JOBS ?? config.jobs);
    for (const { variant } of variants) {
      await measure(ctx, config, variant, Math.round(jobs / 5), 0);
    }
    const acc = variants.map(({ variant, timed }) => {
      if (timed) {
        timed.acquireMs.length = 0;
        timed.releaseMs.length = 0;
      }
      return {
        variant,
        timed,
        stats: statementStats(),
        rates: [] as number[],
        nodeCpu: [] as number[],
        serverCpu: [] as number[],
        lockCpu: [] as number[],
      };
    });
    // Rounds alternate the variants, as in the throughput section.
    for (let r = 1; r <= rounds; r++) {
      for (const a of acc) {
        stats = a.stats;
        lastEnd = Number.NaN;
        let pgBefore = Number.NaN;
        let pgAfter = Number.NaN;
        // The lock session's own backend (wrapped only), to tell its share of the server's CPU apart.
        const lockPid =
          a.variant.id === "wrapped" && postmaster !== undefined ? locks.status().pid : null;
        const lockTicks = () =>
          lockPid ? (procStat(lockPid)?.cpuTicks ?? Number.NaN) : Number.NaN;
        let lockBefore = Number.NaN;
        let lockAfter = Number.NaN;
        const figures = await measure(ctx, config, a.variant, jobs, r, {
          started: () => {
            pgBefore = serverCpuSeconds(postmaster);
            lockBefore = lockTicks();
          },
          drained: () => {
            pgAfter = serverCpuSeconds(postmaster);
            lockAfter = lockTicks();
          },
        });
        a.rates.push(figures.jobsPerSecond);
        a.nodeCpu.push(figures.nodeCpuUsPerJob);
        a.serverCpu.push(((pgAfter - pgBefore) * 1e6) / jobs);
        a.lockCpu.push((((lockAfter - lockBefore) / CLOCK_TICKS) * 1e6) / jobs);
        log(`${config.id} round ${r} ${a.variant.id}: ${fmtInt(figures.jobsPerSecond)} jobs/s`);
      }
    }
    const sum = (xs: number[]) => xs.reduce((x, y) => x + y, 0);
    const rows = acc.map(({ variant, timed, stats: st, rates, nodeCpu, serverCpu, lockCpu }) => {
      const busyMs = sum(st.rttMs);
      return [
        config.id,
        variant.id,
        fmtInt(median(rates)),
        fmtInt(median(nodeCpu)),
        fmtInt(median(serverCpu)),
        lockCpu.every(Number.isFinite) ? fmtInt(median(lockCpu)) : "",
        st.count ? fmtFixed(st.count / (jobs * rounds), 3) : "",
        st.count ? fmtFixed(sum(st.unlocks) / st.count, 1) : "",
        st.count ? fmtFixed(sum(st.locks) / st.count, 1) : "",
        st.count ? fmtFixed(median(st.rttMs), 2) : "",
        st.count ? fmtFixed(median(st.gapMs), 3) : "",
        st.count ? `${fmtInt((busyMs / (busyMs + sum(st.gapMs))) * 100)}%` : "",
        timed?.acquireMs.length ? fmtFixed(median(timed.acquireMs), 2) : "",
        timed?.releaseMs.length ? fmtFixed(median(timed.releaseMs), 2) : "",
      ];
    });
    const table: Table = {
      title: `Profile ${config.id}: concurrency ${config.concurrency}, ${fmtInt(jobs)} jobs, median of ${rounds} runs`,
      columns: [
        { header: "cfg", align: "left" },
        { header: "variant", align: "left" },
        { header: "jobs/s" },
        { header: "node µs/job" },
        { header: "pg µs/job" },
        { header: "of it lock backend" },
        { header: "stmts/job" },
        { header: "unlocks/stmt" },
        { header: "locks/stmt" },
        { header: "stmt ms" },
        { header: "gap ms" },
        { header: "session busy" },
        { header: "acquire ms" },
        { header: "release ms" },
      ],
      rows,
    };
    process.stdout.write(`\n${formatTable(table)}\n`);
  }
} finally {
  for (const cleanup of cleanups) await cleanup();
  await opened.close();
  await bench.close();
}
process.exit(0);
