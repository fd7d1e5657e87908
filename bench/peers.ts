/**
 * Section "peers": pg-boss 12 against this library on the same server in the same run (method and rows:
 * bench/README.md): sequential unique sends per policy, fresh and one key; contended processing (500 jobs
 * over 5 keys of 20 ms, in one seeded order for both sides, at one and two workers per key); idle pickup
 * latency. The sides alternate after a warm-up of each; medians of BENCH_ROUNDS rounds, hand-off
 * percentiles over every measured gap. This module holds the section, what both sides share, and our side
 * (peers-pgboss.ts is pg-boss's, imported only on a Node.js that pg-boss supports, ≥ 22.12: on an older one
 * the section reports itself skipped).
 */
import { EventEmitter } from "node:events";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import type { WorkerEvents } from "graphile-worker";
import type { AddJobSpec, Locks } from "../src/index.js";
import { library } from "./library.js";
import { benchRounds, fmtFixed, fmtInt, fmtPercent, goal, median, now, percentile } from "./lib.js";
import { quietLogger, resetJobs, round, sleep, spread, startRunner, table } from "./lib.js";
import type { BenchContext, Section } from "./lib.js";

const ROUNDS = benchRounds(3);
const SIZES = {
  full: { sends: 1000, warmSends: 100, keys: 5, perKey: 100, warmPerKey: 20, pickups: 20 },
  quick: { sends: 100, warmSends: 20, keys: 5, perKey: 10, warmPerKey: 4, pickups: 5 },
};
export const JOB_MS = 20;
/** Concurrency of both sides in row 3: one worker per key, and two. */
const CONCURRENCIES = [5, 10];
const SEED = 20_240_611;

// ---------------------------------------------------------------------------------------------------------
// What both sides share

/** pg-boss 12's queue policies that take a `singletonKey` (its `standard` has no uniqueness). */
export const POLICIES = ["short", "singleton", "stately", "exclusive"] as const;
export type Policy = (typeof POLICIES)[number];

/**
 * Our rule for each pg-boss policy: `short` (one queued job per key) is `unique: "queued"`; `singleton`
 * (one running per key, every send stored) the exclusive task without uniqueness (plain add_job);
 * `stately` (one queued and one running per key) `unique: "queued"` on that task; `exclusive` (one queued
 * or running per key) `unique: "active"`.
 */
const OUR_MATCH: Record<Policy, { label: string; exclusive: boolean; spec: AddJobSpec }> = {
  short: { label: 'unique: "queued"', exclusive: false, spec: { unique: "queued" } },
  singleton: { label: "exclusive task, no unique", exclusive: true, spec: {} },
  stately: {
    ...{ label: 'exclusive task + unique: "queued"', exclusive: true },
    spec: { unique: "queued" },
  },
  exclusive: { label: 'unique: "active"', exclusive: false, spec: { unique: "active" } },
};

/** Every job's payload, on both sides: its key (pg-boss's `singletonKey`), a number, and how long it sleeps. */
export type PeerPayload = { key: string; i: number; ms: number };
type Span = { key: string; i: number; start: number; end: number };
type PeerId = "pg-boss" | "ours";

export interface Peer {
  id: PeerId;
  /** Runs this side's jobs. */
  recorder: Recorder;
  /** What this side runs with, for the table's notes. */
  settings: string[];
  /** Empties the send queue of `policy`. */
  resetSends(policy: Policy): Promise<void>;
  /** Sends one job; resolves false when it was refused as a duplicate. */
  send(policy: Policy, payload: PeerPayload): Promise<boolean>;
  /**
   * Inserts one job per key of `keys`, in that order (untimed, in bulk), starts `concurrency` workers,
   * resolves once `recorder` saw every job run, then stops them; `parked`: jobs parked on the way (ours).
   */
  contended(keys: readonly string[], concurrency: number): Promise<{ parked: number }>;
  startIdle(concurrency: number): Promise<void>;
  /** Sends the job of a pickup (its own key) to the idle workers. */
  sendPickup(payload: PeerPayload): Promise<void>;
  stopIdle(): Promise<void>;
  close(): Promise<void>;
}

/** The job function of both sides: records each job's span, and tells who waits for a job's start or for a count. */
export class Recorder {
  spans: Span[] = [];
  private readonly waiters = new Map<number, (at: number) => void>();
  private done: (() => void) | undefined;

  readonly run = async (payload: PeerPayload): Promise<void> => {
    const start = now();
    this.waiters.get(payload.i)?.(start);
    if (payload.ms > 0) await sleep(payload.ms);
    this.spans.push({ key: payload.key, i: payload.i, start, end: now() });
    this.done?.();
  };

  /** Clears the spans; resolves them once `count` jobs have run (rejects after `timeoutMs`). */
  expect(count: number, timeoutMs: number): Promise<Span[]> {
    this.spans = [];
    return this.wait(timeoutMs, `${count} jobs did not run`, (resolve) => {
      this.done = () => this.spans.length >= count && resolve(this.spans);
      return () => (this.done = undefined);
    });
  }

  /** Resolves when job `i` starts, with the time it started. */
  started(i: number, timeoutMs: number): Promise<number> {
    return this.wait(timeoutMs, `job ${i} did not start`, (resolve) => {
      this.waiters.set(i, resolve);
      return () => this.waiters.delete(i);
    });
  }

  private wait<T>(
    ms: number,
    what: string,
    arm: (resolve: (value: T) => void) => () => void,
  ): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const disarm = arm((value) => (disarm(), clearTimeout(timer), resolve(value)));
      const timer = setTimeout(() => (disarm(), reject(new Error(`${what} within ${ms} ms`))), ms);
    });
  }
}

/** The keys of a contended run: `perKey` jobs of each of `keys` keys, in a seeded random order. */
function contendedKeys(keys: number, perKey: number, seed: number): string[] {
  const list = Array.from({ length: keys * perKey }, (_, n) => `k${Math.floor(n / perKey)}`);
  // Fisher–Yates with mulberry32, so that every run and both sides see the same order.
  let state = seed >>> 0;
  const random = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = Math.imul(state ^ (state >>> 15), state | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  for (let i = list.length - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [list[i], list[j]] = [list[j]!, list[i]!];
  }
  return list;
}

/** Makespan (first start to last end), ideal (the busiest key's jobs × JOB_MS), per-key gaps and overlaps. */
function analyse(spans: readonly Span[]) {
  const byKey = new Map<string, Span[]>();
  for (const s of spans) byKey.set(s.key, [...(byKey.get(s.key) ?? []), s]);
  const gaps: number[] = [];
  for (const list of byKey.values()) {
    list.sort((a, b) => a.start - b.start);
    for (let j = 1; j < list.length; j++) gaps.push(list[j]!.start - list[j - 1]!.end);
  }
  return {
    jobs: spans.length,
    /** Distinct jobs that ran (must equal `jobs`: none lost, none run twice). */
    distinct: new Set(spans.map((s) => s.i)).size,
    makespanMs: Math.max(...spans.map((s) => s.end)) - Math.min(...spans.map((s) => s.start)),
    idealMs: Math.max(...[...byKey.values()].map((l) => l.length)) * JOB_MS,
    gaps,
    /** Jobs of a key that started before the previous one of the key ended (must be 0). */
    overlaps: gaps.filter((g) => g < 0).length,
  };
}

// ---------------------------------------------------------------------------------------------------------
// Our side: this library on graphile-worker, in the benchmark's own database

const EXCLUSIVE = "peers_exclusive";
const PLAIN = "peers_plain";

async function openOurs(ctx: BenchContext): Promise<Peer> {
  const recorder = new Recorder();
  const locks: Locks = library.makeLocks({ connectionString: ctx.url, logger: quietLogger });
  // A job meeting a held key is parked, and the releasing worker wakes it.
  const task = locks.exclusive<PeerPayload>(EXCLUSIVE, recorder.run, {
    onConflict: "reschedule",
    key: (p) => p.key,
  });
  locks.define<PeerPayload>(PLAIN, { uniqueKey: (p) => p.key });
  // The lock session otherwise opens with the first job, which would count in the first pickup.
  await locks
    .migrate()
    .then(() => locks.connect())
    .catch(async (error: unknown) => {
      await locks.release();
      throw error;
    });
  const reset = async () => {
    await resetJobs(ctx.pool);
    await ctx.pool.query("truncate graphile_worker_locks.waiters");
  };
  const start = (concurrency: number) => {
    const events = new EventEmitter() as WorkerEvents;
    events.once("job:error", ({ error }) =>
      ctx.log(`peers: ours: a job failed (graphile-worker retries it): ${String(error)}`),
    );
    // Early wakes go to this runner's idle workers (detached when it stops).
    locks.attach({ events });
    // Jobs of a key this process holds are not fetched only to be parked (they carry the key's flag).
    return startRunner({
      connectionString: ctx.url,
      concurrency,
      taskList: { [EXCLUSIVE]: task },
      events,
      forbiddenFlags: locks.forbiddenFlags,
    });
  };
  let idle: Awaited<ReturnType<typeof start>> | undefined;
  return {
    id: "ours",
    recorder,
    settings: [
      "graphile-worker run({ concurrency, forbiddenFlags: locks.forbiddenFlags }), defaults otherwise (LISTEN/NOTIFY, pollInterval 2 s, no local queue), its events given to locks.attach",
      'locks.exclusive(..., { onConflict: "reschedule", key: (p) => p.key }); makeLocks() defaults (pool of 10)',
    ],
    resetSends: reset,
    async send(policy, payload) {
      const { outcome } = await locks.addJob(
        OUR_MATCH[policy].exclusive ? EXCLUSIVE : PLAIN,
        payload,
        OUR_MATCH[policy].spec,
      );
      if (outcome !== "added" && outcome !== "duplicate")
        throw new Error(`ours: unexpected outcome ${outcome} of a ${policy} send`);
      return outcome === "added";
    },
    async contended(keys, concurrency) {
      await reset();
      // Each job carries its key's flag, as locks.addJob gives it to a `reschedule` task's jobs.
      const flags = keys.map((k) => library.lockFlag(task.lockKey({ key: k, i: 0, ms: 0 })));
      await ctx.pool.query(
        `select count(*) from graphile_worker.add_jobs(array(
           select row($1::text, json_build_object('key', t.k, 'i', t.i, 'ms', $3::int),
             null, null, null, null, null, array[t.flag])::graphile_worker.job_spec
           from unnest($2::text[], $4::text[]) with ordinality as t(k, flag, i) order by t.i))`,
        [EXCLUSIVE, keys, JOB_MS, flags],
      );
      await ctx.pool.query("vacuum analyze graphile_worker._private_jobs");
      const done = recorder.expect(keys.length, 60_000 + keys.length * JOB_MS * 4);
      let parked = 0;
      const onParked = () => void parked++;
      locks.events.on("job:rescheduled", onParked);
      const runner = await start(concurrency);
      try {
        await done;
        return { parked };
      } finally {
        locks.events.off("job:rescheduled", onParked);
        await runner.stop();
        await reset();
      }
    },
    async startIdle(concurrency) {
      await reset();
      idle = await start(concurrency);
    },
    sendPickup: async (payload) => void (await locks.addJob(EXCLUSIVE, payload)),
    async stopIdle() {
      await idle?.stop();
      idle = undefined;
      await reset();
    },
    async close() {
      await idle?.stop().catch(() => undefined);
      await locks.release();
    },
  };
}

// ---------------------------------------------------------------------------------------------------------
// The section

/** pg-boss's version, and why the section cannot run on this Node.js (pg-boss's own `engines.node`), if so. */
function requirement(): { version: string | null; skip: { why: string; how: string } | null } {
  let pkg: { version?: string; engines?: { node?: string } };
  try {
    pkg = JSON.parse(
      readFileSync(createRequire(import.meta.url).resolve("pg-boss/package.json"), "utf8"),
    ) as typeof pkg;
  } catch {
    return {
      version: null,
      skip: { why: "pg-boss is not installed", how: "it is a devDependency: npm ci" },
    };
  }
  const [need, have] = [pkg.engines?.node ?? ">=22.12.0", process.versions.node].map((v) =>
    (/(\d+)\.(\d+)(?:\.(\d+))?/.exec(v) ?? [])
      .slice(1, 4)
      .reduce((n, part) => n * 1000 + Number(part ?? 0), 0),
  );
  const why = `pg-boss ${pkg.version} requires Node.js ${pkg.engines?.node}; this is ${process.version}`;
  const how =
    "run this section on Node 24: .ci/node24/node_modules/node/bin/node --import tsx bench/run.ts peers " +
    "(Node 24 from npm: npm install --no-save --no-package-lock --prefix .ci/node24 node@24)";
  return { version: pkg.version ?? null, skip: have! >= need! ? null : { why, how } };
}

type Sides = readonly [Peer, Peer];

export const peers: Section = {
  id: "peers",
  title: "Peer: pg-boss (same server, same run)",
  async run(ctx) {
    const { version, skip } = requirement();
    if (skip) {
      ctx.log(`peers: skipped: ${skip.why}`);
      return {
        tables: [table(`Peer: pg-boss — skipped: ${skip.why}`, "to run it", [[skip.how]])],
        goals: [],
        figures: { skipped: skip.why, howToRun: skip.how },
      };
    }
    // Imported only here: pg-boss is not for an older Node.js.
    const { openPgBoss } = await import("./peers-pgboss.js");
    const size = ctx.quick ? SIZES.quick : SIZES.full;
    const pgBoss = await openPgBoss(ctx);
    let ours: Peer | undefined;
    let runs: Runs;
    try {
      ours = await openOurs(ctx);
      runs = await measure(ctx, size, [pgBoss, ours]);
    } finally {
      await ours?.close();
      await pgBoss.close();
    }
    const settings = { "pg-boss": pgBoss.settings, ours: ours.settings };

    const rows = summarise(runs);
    const measured = (side: PeerId) => runs.contended.filter((c) => c.round > 0 && c.side === side);
    const overlaps = (side: PeerId) => measured(side).reduce((n, c) => n + c.overlaps, 0);
    const summary = table(
      `Peer: pg-boss ${version} vs ours, same server (medians of ${ROUNDS} alternating rounds; ratio > 1: ours ahead)`,
      "<row (pg-boss policy / ours) | <measure | <unit | pg-boss | ours | ratio | <ahead | <pg-boss detail | <ours detail",
      rows.map((r) => {
        const value = (v: number) =>
          r.unit === "sends/s" ? fmtInt(v) : fmtFixed(v, r.unit === "s" || v < 10 ? 2 : 1);
        const ahead = r.ratio > 1 ? "ours" : "PG-BOSS";
        return [
          r.row,
          r.what,
          r.unit,
          value(r.pgBoss),
          value(r.ours),
          fmtFixed(r.ratio, 2),
          ahead,
        ].concat(r.notes ?? ["", ""]);
      }),
      [
        `Rows 1-2: ${fmtInt(size.sends)} sequential sends per run; "stored": jobs kept of a run's one-key sends.`,
        `Row 3: ${size.keys * size.perKey} jobs over ${size.keys} keys, ${JOB_MS} ms each; hand-off: one job's end to the next start of its key.`,
        `  Overlaps (must be 0): pg-boss ${overlaps("pg-boss")}, ours ${overlaps("ours")}. Ours parked ` +
          `${fmtInt(median(measured("ours").map((c) => c.parks)))} jobs per run (median; a job may be parked more than once).`,
        `Row 4: ${size.pickups} samples per side on idle workers, alternating, 100 ms apart.`,
        ...settings["pg-boss"].map((s) => `pg-boss: ${s}`),
        ...settings.ours.map((s) => `ours: ${s}`),
      ],
    );
    const goals = rows.map((r) =>
      goal(
        `${r.row}: ${r.what}`,
        `ahead of pg-boss (${r.unit === "sends/s" ? "ours/pg-boss" : "pg-boss/ours"} > 1)`,
        r.ratio,
        r.ratio > 1,
      ),
    );
    goals.push(goal("3 contended: overlaps of ours", "= 0", overlaps("ours"), !overlaps("ours")));
    const { sends, contended, pickups } = runs;
    return {
      tables: [summary],
      goals,
      figures: {
        ...{ rounds: ROUNDS, pgBossVersion: version, jobMs: JOB_MS, sizes: size, settings },
        ...{ rows, sends, contended, pickups },
      },
    };
  },
};

/**
 * Every figure of both sides, alternating (odd rounds pg-boss first, even rounds and the warm-up ours
 * first): sequential sends (rows 1-2), contended runs and their hand-off gaps (row 3), idle pickups (row 4).
 */
async function measure(ctx: BenchContext, size: typeof SIZES.full, pair: Sides) {
  type Run = { side: PeerId; round: number };
  const runs = {
    sends: [] as Array<Run & { policy: Policy; mode: string; opsPerSecond: number; added: number }>,
    contended: [] as Array<
      Run & { concurrency: number; makespanMs: number; idealMs: number } & {
        overlaps: number;
        parks: number;
      }
    >,
    /** The hand-off gaps of every measured round, by `<concurrency>/<side>`. */
    gaps: new Map<string, number[]>(),
    pickups: [] as Array<{ side: PeerId; ms: number }>,
  };
  const ordered = (r: number): Sides => (r % 2 === 1 ? pair : [pair[1], pair[0]]);
  for (let r = 0; r <= ROUNDS; r++) {
    const n = r === 0 ? size.warmSends : size.sends;
    for (const policy of POLICIES) {
      for (const mode of ["fresh", "duplicate"]) {
        for (const peer of ordered(r)) {
          await peer.resetSends(policy);
          let added = 0;
          const t0 = now();
          for (let i = 0; i < n; i++) {
            const key = mode === "fresh" ? `r${r}-${i}` : `r${r}-dup`;
            if (await peer.send(policy, { key, i: r * 1_000_000 + i, ms: 0 })) added++;
          }
          const opsPerSecond = n / ((now() - t0) / 1000);
          runs.sends.push({ policy, mode, side: peer.id, round: r, opsPerSecond, added });
          if (r > 0) {
            ctx.log(
              `peers: round ${r} send ${policy}/${mode} ${peer.id.padEnd(7)} ${fmtInt(opsPerSecond).padStart(6)}/s` +
                ` (${added} added, ${n - added} duplicates)`,
            );
          }
        }
      }
    }
    if (r === 0) ctx.log("peers: sends warmed up");
  }

  for (const concurrency of CONCURRENCIES) {
    for (let r = 0; r <= ROUNDS; r++) {
      const keys = contendedKeys(size.keys, r === 0 ? size.warmPerKey : size.perKey, SEED + r);
      for (const peer of ordered(r)) {
        const { parked: parks } = await peer.contended(keys, concurrency);
        const a = analyse(peer.recorder.spans);
        if (a.distinct !== keys.length || a.jobs !== keys.length) {
          throw new Error(
            `peers: ${peer.id} ran ${a.jobs} job functions for ${a.distinct} distinct jobs of ${keys.length}`,
          );
        }
        const { idealMs, overlaps } = a;
        const figures = { makespanMs: round(a.makespanMs, 1), idealMs, overlaps, parks };
        runs.contended.push({ concurrency, side: peer.id, round: r, ...figures });
        const gaps = `${concurrency}/${peer.id}`;
        if (r > 0) runs.gaps.set(gaps, [...(runs.gaps.get(gaps) ?? []), ...a.gaps]);
        ctx.log(
          `peers: ${r === 0 ? "warm-up" : `round ${r}`} contended c=${concurrency} ${peer.id.padEnd(7)} ` +
            `makespan ${fmtInt(a.makespanMs)} ms (ideal ${a.idealMs}), hand-off p50 ${fmtFixed(percentile(a.gaps, 50), 1)}` +
            ` p99 ${fmtFixed(percentile(a.gaps, 99), 1)} ms, ${a.overlaps} overlaps${peer.id === "ours" ? `, ${parks} parks` : ""}`,
        );
      }
    }
  }

  for (const peer of pair) await peer.startIdle(CONCURRENCIES[0]!);
  try {
    await sleep(1_000);
    // Two unrecorded samples each first (first use of the statements on both sides).
    for (let s = -2; s < size.pickups; s++) {
      for (const peer of s % 2 === 0 ? pair : [pair[1], pair[0]]) {
        await sleep(100);
        const i = 2_000_000 + (s + 2) * 2 + (peer.id === "ours" ? 1 : 0);
        const started = peer.recorder.started(i, 10_000);
        const t0 = now();
        await peer.sendPickup({ key: `pickup-${i}`, i, ms: 0 });
        const ms = (await started) - t0;
        if (s >= 0) runs.pickups.push({ side: peer.id, ms: round(ms, 2) });
      }
    }
    const med = (side: PeerId) =>
      fmtFixed(median(runs.pickups.filter((p) => p.side === side).map((p) => p.ms)), 1);
    ctx.log(`peers: idle pickup median pg-boss ${med("pg-boss")} ms, ours ${med("ours")} ms`);
  } finally {
    for (const peer of pair) await peer.stopIdle();
  }
  return runs;
}
type Runs = Awaited<ReturnType<typeof measure>>;

/** A row of the table: a pair and its ratio, oriented so that > 1 means ours is ahead; `notes`: the details. */
type Row = {
  row: string;
  what: string;
  unit: string;
  pgBoss: number;
  ours: number;
  ratio: number;
} & {
  notes?: [string, string];
};

/** The table's rows. */
function summarise({ sends, contended, gaps, pickups }: Runs) {
  const rows: Row[] = [];
  const pairRow = (
    [row, what, unit]: [string, string, string],
    of: (side: PeerId) => number,
    digits: number,
    note?: (side: PeerId) => string,
  ) => {
    const [pgBoss, ours] = [of("pg-boss"), of("ours")];
    const ratio = round(unit === "sends/s" ? ours / pgBoss : pgBoss / ours, 3);
    const notes = note ? { notes: [note("pg-boss"), note("ours")] as [string, string] } : {};
    rows.push({
      row,
      what,
      unit,
      pgBoss: round(pgBoss, digits),
      ours: round(ours, digits),
      ratio,
      ...notes,
    });
  };
  for (const mode of ["fresh", "duplicate"]) {
    for (const policy of POLICIES) {
      const of = (side: PeerId) =>
        sends.filter(
          (s) => s.round > 0 && s.policy === policy && s.mode === mode && s.side === side,
        );
      const rate = (side: PeerId) => of(side).map((s) => s.opsPerSecond);
      const stored = (side: PeerId) =>
        mode === "duplicate" ? `, ${fmtInt(of(side)[0]?.added ?? 0)} stored` : "";
      pairRow(
        [
          `${mode === "fresh" ? "1" : "2"} ${policy} / ${OUR_MATCH[policy].label}`,
          `sequential sends, ${mode === "fresh" ? "fresh keys" : "one key"}`,
          "sends/s",
        ],
        (side) => median(rate(side)),
        0,
        (side) => `±${fmtPercent(spread(rate(side)))}${stored(side)}`,
      );
    }
  }
  for (const concurrency of CONCURRENCIES) {
    const of = (side: PeerId) =>
      contended.filter((c) => c.round > 0 && c.concurrency === concurrency && c.side === side);
    const ideal = of("ours")[0]?.idealMs ?? Number.NaN;
    const makespan = (side: PeerId) => median(of(side).map((c) => c.makespanMs));
    const name = `3 contended, concurrency ${concurrency}`;
    pairRow(
      [name, `makespan (ideal ${fmtFixed(ideal / 1000, 2)} s)`, "s"],
      (side) => makespan(side) / 1000,
      3,
      (side) => `${fmtFixed(makespan(side) / ideal, 2)}× ideal`,
    );
    for (const p of [50, 99]) {
      const gapsOf = (side: PeerId) => gaps.get(`${concurrency}/${side}`) ?? [];
      pairRow([name, `hand-off p${p}`, "ms"], (side) => percentile(gapsOf(side), p), 2);
    }
  }
  const pickup = (side: PeerId) => pickups.filter((p) => p.side === side).map((p) => p.ms);
  pairRow(
    ["4 idle pickup", "send → start, median", "ms"],
    (side) => median(pickup(side)),
    2,
    (side) => `p90 ${fmtFixed(percentile(pickup(side), 90), 1)}`,
  );
  return rows;
}
