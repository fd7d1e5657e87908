/**
 * Section "peers": pg-boss 12 against this library on the same server in the same run (pg-boss in a
 * database of its own): sequential unique sends per policy, fresh and one key (OUR_MATCH in peers-common.ts
 * pairs the rules); contended processing (500 jobs over 5 keys of 20 ms, seeded order, at one and two
 * workers per key; peers-pgboss.ts lists pg-boss's settings); idle pickup latency. Runs alternate the sides
 * after a warm-up of each; medians of BENCH_ROUNDS rounds, hand-off percentiles over every measured gap.
 * pg-boss needs Node.js ≥ 22.12: on an older one the section reports itself skipped.
 */
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import {
  fmtFixed,
  fmtInt,
  fmtPercent,
  median,
  round,
  sleep,
  spread,
  type BenchContext,
  type Goal,
  type Section,
  type SectionResult,
  type Table,
  benchRounds,
} from "./lib.js";
import {
  OUR_MATCH,
  POLICIES,
  analyse,
  contendedKeys,
  percentile,
  type KeyMode,
  type Peer,
  type PeerId,
  type Policy,
} from "./peers-common.js";
import { openOurs } from "./peers-ours.js";

const ROUNDS = benchRounds(3);
const SECTION = "peers";

const SIZES = {
  full: { sends: 1000, warmSends: 100, keys: 5, perKey: 100, warmPerKey: 20, pickups: 20 },
  quick: { sends: 100, warmSends: 20, keys: 5, perKey: 10, warmPerKey: 4, pickups: 5 },
};
const JOB_MS = 20;
/** Concurrency of both sides in row 3: one worker per key, and two. */
const CONCURRENCIES = [5, 10];
const SEED = 20_240_611;

// ---------------------------------------------------------------------------------------------------------
// Node.js version gate

interface Requirement {
  version: string | null;
  /** Why the section cannot run here (and how to run it), or null. */
  skip: { why: string; how: string } | null;
}

const NODE24 =
  "run this section on Node 24: .ci/node24/node_modules/node/bin/node --import tsx bench/run.ts peers " +
  "(Node 24 from npm: npm install --no-save --no-package-lock --prefix .ci/node24 node@24)";

/** pg-boss's own `engines.node` (">=22.12.0") against this Node.js. */
function requirement(): Requirement {
  let pkg: { version?: string; engines?: { node?: string } };
  try {
    const file = createRequire(import.meta.url).resolve("pg-boss/package.json");
    pkg = JSON.parse(readFileSync(file, "utf8")) as typeof pkg;
  } catch {
    return {
      version: null,
      skip: { why: "pg-boss is not installed", how: "it is a devDependency: npm ci" },
    };
  }
  const version = pkg.version ?? null;
  const wanted = /(\d+)\.(\d+)(?:\.(\d+))?/.exec(pkg.engines?.node ?? "") ?? ["", "22", "12", "0"];
  const need = [Number(wanted[1]), Number(wanted[2]), Number(wanted[3] ?? 0)];
  const have = process.versions.node.split(".").map(Number);
  for (let i = 0; i < 3; i++) {
    if ((have[i] ?? 0) > need[i]!) break;
    if ((have[i] ?? 0) < need[i]!) {
      const why = `pg-boss ${version} requires Node.js ${pkg.engines?.node}; this is ${process.version}`;
      return { version, skip: { why, how: NODE24 } };
    }
  }
  return { version, skip: null };
}

// ---------------------------------------------------------------------------------------------------------
// Figures

interface SendRun {
  policy: Policy;
  mode: KeyMode;
  side: PeerId;
  round: number;
  sends: number;
  seconds: number;
  opsPerSecond: number;
  added: number;
  duplicates: number;
}

interface ContendedRunFigures {
  concurrency: number;
  side: PeerId;
  round: number;
  jobs: number;
  makespanMs: number;
  idealMs: number;
  handoffP50Ms: number;
  handoffP99Ms: number;
  handoffMaxMs: number;
  overlaps: number;
  /** Jobs parked by `reschedule` (a job may be parked more than once). */
  parks: number;
}

/** Hand-off gaps of the measured rounds, by `${concurrency}/${side}` (kept out of results.json: thousands). */
type Gaps = Map<string, number[]>;

interface PickupSample {
  side: PeerId;
  sample: number;
  ms: number;
}

/** A row of the summary: a pair and its ratio, oriented so that > 1 means ours is ahead. */
interface Row {
  row: string;
  what: string;
  unit: string;
  pgBoss: number;
  ours: number;
  /** ours/pg-boss for rates, pg-boss/ours for times. */
  ratio: number;
  pgBossNote?: string;
  oursNote?: string;
}

// ---------------------------------------------------------------------------------------------------------
// The section

export const peers: Section = {
  id: SECTION,
  title: "Peer: pg-boss (same server, same run)",
  async run(ctx): Promise<SectionResult> {
    const req = requirement();
    if (req.skip) {
      ctx.log(`peers: skipped: ${req.skip.why}`);
      return {
        tables: [
          {
            title: `Peer: pg-boss — skipped: ${req.skip.why}`,
            columns: [{ header: "to run it", align: "left" }],
            rows: [[req.skip.how]],
          },
        ],
        goals: [],
        figures: { skipped: req.skip.why, howToRun: req.skip.how },
      };
    }
    // Imported only here: pg-boss is not for an older Node.js.
    const { openPgBoss } = await import("./peers-pgboss.js");
    const size = ctx.quick ? SIZES.quick : SIZES.full;

    const sends: SendRun[] = [];
    const contended: ContendedRunFigures[] = [];
    const gaps: Gaps = new Map();
    const pickups: PickupSample[] = [];

    const pgBoss = await openPgBoss(ctx);
    let ours: Peer | undefined;
    let settings: Record<PeerId, string[]>;
    try {
      ours = await openOurs(ctx);
      settings = { "pg-boss": pgBoss.settings, ours: ours.settings };
      const pair = [pgBoss, ours] as const;
      const ordered = (r: number) => (r % 2 === 1 ? pair : ([pair[1], pair[0]] as const));
      await measureSends(ctx, size, ordered, sends);
      for (const concurrency of CONCURRENCIES) {
        await measureContended(ctx, size, concurrency, ordered, contended, gaps);
      }
      await measurePickups(ctx, size, CONCURRENCIES[0]!, pair, pickups);
    } finally {
      await ours?.close();
      await pgBoss.close();
    }

    const rows = summarise(sends, contended, gaps, pickups);
    return {
      tables: tables(rows, sends, contended, pickups, settings, req.version, size),
      goals: goals(rows, contended),
      figures: {
        rounds: ROUNDS,
        pgBossVersion: req.version,
        jobMs: JOB_MS,
        sizes: size,
        settings,
        ourMatch: OUR_MATCH,
        rows,
        sends,
        contended,
        pickups,
      },
    };
  },
};

type Ordered = (round: number) => readonly [Peer, Peer];

async function measureSends(
  ctx: BenchContext,
  size: typeof SIZES.full,
  ordered: Ordered,
  out: SendRun[],
): Promise<void> {
  const keysOf = (mode: KeyMode, n: number, r: number) =>
    Array.from({ length: n }, (_, i) => (mode === "fresh" ? `r${r}-${i}` : `r${r}-dup`));
  for (let r = 0; r <= ROUNDS; r++) {
    const n = r === 0 ? size.warmSends : size.sends;
    for (const policy of POLICIES) {
      for (const mode of ["fresh", "duplicate"] as const) {
        for (const peer of ordered(r)) {
          const f = await peer.send(policy, keysOf(mode, n, r), r);
          out.push({ policy, mode, side: peer.id, round: r, sends: n, ...f });
          if (r > 0) {
            ctx.log(
              `peers: round ${r} send ${policy}/${mode} ${peer.id.padEnd(7)} ${fmtInt(f.opsPerSecond).padStart(6)}/s` +
                ` (${f.added} added, ${f.duplicates} duplicates)`,
            );
          }
        }
      }
    }
    if (r === 0) ctx.log("peers: sends warmed up");
  }
}

async function measureContended(
  ctx: BenchContext,
  size: typeof SIZES.full,
  concurrency: number,
  ordered: Ordered,
  out: ContendedRunFigures[],
  gaps: Gaps,
): Promise<void> {
  for (let r = 0; r <= ROUNDS; r++) {
    const perKey = r === 0 ? size.warmPerKey : size.perKey;
    const keys = contendedKeys(size.keys, perKey, SEED + r);
    for (const peer of ordered(r)) {
      const { spans, parked } = await peer.contended(keys, JOB_MS, concurrency);
      const a = analyse(spans, JOB_MS);
      if (a.distinct !== keys.length || a.jobs !== keys.length) {
        throw new Error(
          `peers: ${peer.id} ran ${a.jobs} job functions for ${a.distinct} distinct jobs of ${keys.length}`,
        );
      }
      const figures: ContendedRunFigures = {
        concurrency,
        side: peer.id,
        round: r,
        jobs: keys.length,
        makespanMs: round(a.makespanMs, 1),
        idealMs: a.idealMs,
        handoffP50Ms: round(percentile(a.gaps, 50), 2),
        handoffP99Ms: round(percentile(a.gaps, 99), 2),
        handoffMaxMs: round(Math.max(...a.gaps), 2),
        overlaps: a.overlaps,
        parks: parked.length,
      };
      out.push(figures);
      if (r > 0) {
        const id = `${concurrency}/${peer.id}`;
        gaps.set(id, [...(gaps.get(id) ?? []), ...a.gaps]);
      }
      ctx.log(
        `peers: ${r === 0 ? "warm-up" : `round ${r}`} contended c=${concurrency} ${peer.id.padEnd(7)} ` +
          `makespan ${fmtInt(a.makespanMs)} ms (ideal ${a.idealMs}), hand-off p50 ${fmtFixed(figures.handoffP50Ms, 1)}` +
          ` p99 ${fmtFixed(figures.handoffP99Ms, 1)} ms, ${a.overlaps} overlaps` +
          `${peer.id === "ours" ? `, ${parked.length} parks` : ""}`,
      );
    }
  }
}

async function measurePickups(
  ctx: BenchContext,
  size: typeof SIZES.full,
  concurrency: number,
  pair: readonly [Peer, Peer],
  out: PickupSample[],
): Promise<void> {
  for (const peer of pair) await peer.startIdle(concurrency);
  try {
    await sleep(1_000);
    // Two unrecorded samples each first (first use of the statements on both sides).
    for (let s = -2; s < size.pickups; s++) {
      const order = s % 2 === 0 ? pair : ([pair[1], pair[0]] as const);
      for (const peer of order) {
        await sleep(100);
        const ms = await peer.pickup(2_000_000 + (s + 2) * 2 + (peer.id === "ours" ? 1 : 0));
        if (s >= 0) out.push({ side: peer.id, sample: s, ms: round(ms, 2) });
      }
    }
    const med = (side: PeerId) => median(out.filter((p) => p.side === side).map((p) => p.ms));
    ctx.log(
      `peers: idle pickup median pg-boss ${fmtFixed(med("pg-boss"), 1)} ms, ours ${fmtFixed(med("ours"), 1)} ms`,
    );
  } finally {
    for (const peer of pair) await peer.stopIdle();
  }
}

// ---------------------------------------------------------------------------------------------------------
// Summary

function summarise(
  sends: SendRun[],
  contended: ContendedRunFigures[],
  gaps: Gaps,
  pickups: PickupSample[],
): Row[] {
  const rows: Row[] = [];
  for (const mode of ["fresh", "duplicate"] as const) {
    for (const policy of POLICIES) {
      const of = (side: PeerId) =>
        sends.filter(
          (s) => s.round > 0 && s.policy === policy && s.mode === mode && s.side === side,
        );
      const rate = (side: PeerId) => median(of(side).map((s) => s.opsPerSecond));
      const note = (side: PeerId) => {
        const runs = of(side);
        const stored = runs[0]?.added ?? 0;
        return `±${fmtPercent(spread(runs.map((s) => s.opsPerSecond)))}${mode === "duplicate" ? `, ${fmtInt(stored)} stored` : ""}`;
      };
      const pb = rate("pg-boss");
      const ours = rate("ours");
      rows.push({
        row: `${mode === "fresh" ? "1" : "2"} ${policy} / ${OUR_MATCH[policy]}`,
        what: `sequential sends, ${mode === "fresh" ? "fresh keys" : "one key"}`,
        unit: "sends/s",
        pgBoss: Math.round(pb),
        ours: Math.round(ours),
        ratio: round(ours / pb, 3),
        pgBossNote: note("pg-boss"),
        oursNote: note("ours"),
      });
    }
  }
  for (const concurrency of CONCURRENCIES) {
    const of = (side: PeerId) =>
      contended.filter((c) => c.round > 0 && c.concurrency === concurrency && c.side === side);
    const gapsOf = (side: PeerId) => gaps.get(`${concurrency}/${side}`) ?? [];
    const ideal = of("ours")[0]?.idealMs ?? Number.NaN;
    const makespan = (side: PeerId) => median(of(side).map((c) => c.makespanMs));
    const pbM = makespan("pg-boss");
    const ourM = makespan("ours");
    const name = `3 contended, concurrency ${concurrency}`;
    rows.push({
      row: name,
      what: `makespan (ideal ${fmtFixed(ideal / 1000, 2)} s)`,
      unit: "s",
      pgBoss: round(pbM / 1000, 3),
      ours: round(ourM / 1000, 3),
      ratio: round(pbM / ourM, 3),
      pgBossNote: `${fmtFixed(pbM / ideal, 2)}× ideal`,
      oursNote: `${fmtFixed(ourM / ideal, 2)}× ideal`,
    });
    for (const p of [50, 99]) {
      const pb = percentile(gapsOf("pg-boss"), p);
      const ours = percentile(gapsOf("ours"), p);
      rows.push({
        row: name,
        what: `hand-off p${p}`,
        unit: "ms",
        pgBoss: round(pb, 2),
        ours: round(ours, 2),
        ratio: round(pb / ours, 3),
      });
    }
  }
  const pickup = (side: PeerId) => pickups.filter((p) => p.side === side).map((p) => p.ms);
  const pbP = median(pickup("pg-boss"));
  const ourP = median(pickup("ours"));
  rows.push({
    row: "4 idle pickup",
    what: "send → start, median",
    unit: "ms",
    pgBoss: round(pbP, 2),
    ours: round(ourP, 2),
    ratio: round(pbP / ourP, 3),
    pgBossNote: `p90 ${fmtFixed(percentile(pickup("pg-boss"), 90), 1)}`,
    oursNote: `p90 ${fmtFixed(percentile(pickup("ours"), 90), 1)}`,
  });
  return rows;
}

function value(v: number, unit: string): string {
  if (unit === "sends/s") return fmtInt(v);
  if (unit === "s") return fmtFixed(v, 2);
  return fmtFixed(v, v < 10 ? 2 : 1);
}

function tables(
  rows: Row[],
  sends: SendRun[],
  contended: ContendedRunFigures[],
  pickups: PickupSample[],
  settings: Record<PeerId, string[]>,
  version: string | null,
  size: typeof SIZES.full,
): Table[] {
  const overlapsOf = (side: PeerId) =>
    contended.filter((c) => c.round > 0 && c.side === side).reduce((n, c) => n + c.overlaps, 0);
  const parks = contended.filter((c) => c.round > 0 && c.side === "ours");
  const summary: Table = {
    title:
      `Peer: pg-boss ${version} vs ours, same server (medians of ${ROUNDS} alternating rounds; ` +
      "ratio > 1: ours ahead)",
    columns: [
      { header: "row (pg-boss policy / ours)", align: "left" },
      { header: "measure", align: "left" },
      { header: "unit", align: "left" },
      { header: "pg-boss", align: "right" },
      { header: "ours", align: "right" },
      { header: "ratio", align: "right" },
      { header: "ahead", align: "left" },
      { header: "pg-boss detail", align: "left" },
      { header: "ours detail", align: "left" },
    ],
    rows: rows.map((r) => [
      r.row,
      r.what,
      r.unit,
      value(r.pgBoss, r.unit),
      value(r.ours, r.unit),
      fmtFixed(r.ratio, 2),
      r.ratio > 1 ? "ours" : "PG-BOSS",
      r.pgBossNote ?? "",
      r.oursNote ?? "",
    ]),
    notes: [
      `Rows 1-2: ${fmtInt(size.sends)} sequential sends per run, each awaited; "stored": jobs kept of a run's one-key sends.`,
      '  Ours for each pg-boss policy: short (1 queued per key) = unique "queued"; singleton (1 running per key, every send',
      "  stored) = the exclusive task without uniqueness (plain add_job); stately (1 queued + 1 running per key) = unique",
      '  "queued" on the exclusive task; exclusive (1 queued or running per key) = unique "active".',
      `Row 3: ${size.keys * size.perKey} jobs over ${size.keys} keys, ${JOB_MS} ms each, one seeded random order for both sides, both at the`,
      "  concurrency shown. Makespan: first start to last end of the job function (start-up excluded). Hand-off: from the end",
      "  of one job of a key to the start of the next (percentiles over the gaps of every measured round).",
      `  Overlaps (must be 0): pg-boss ${overlapsOf("pg-boss")}, ours ${overlapsOf("ours")}. Ours parked ` +
        `${fmtInt(median(parks.map((c) => c.parks)))} jobs per run (median; a job may be parked more than once).`,
      `Row 4: ${size.pickups} samples per side on idle workers (both sides idle at once), alternating, 100 ms apart.`,
      ...settings["pg-boss"].map((s) => `pg-boss: ${s}`),
      ...settings.ours.map((s) => `ours: ${s}`),
    ],
  };
  return [summary];
}

function goals(rows: Row[], contended: ContendedRunFigures[]): Goal[] {
  const list: Goal[] = rows.map((r) => ({
    section: SECTION,
    name: `${r.row}: ${r.what}`,
    target: `ahead of pg-boss (${r.unit === "sends/s" ? "ours/pg-boss" : "pg-boss/ours"} > 1)`,
    value: r.ratio,
    threshold: 1,
    met: r.ratio > 1,
  }));
  const overlaps = contended
    .filter((c) => c.round > 0 && c.side === "ours")
    .reduce((n, c) => n + c.overlaps, 0);
  list.push({
    section: SECTION,
    name: "3 contended: overlaps of ours",
    target: "= 0",
    value: overlaps,
    threshold: 0,
    met: overlaps === 0,
  });
  return list;
}
