/**
 * Section "enqueue": jobs added per second, one at a time and in bulk, by graphile-worker alone and through
 * this library (preemptive check, unique jobs), with fresh keys and with keys that all meet an existing job
 * (method: bench/README.md). Each variant has its own task identifier and keys, so that all share the job
 * table and take turns slice by slice (the starting variant rotating), and noise hits them alike; a
 * variant's time is the sum of its slices. Single enqueues are awaited one after another; bulk ones are
 * `addJobs` calls of `bulkBatch` items. Afterwards every variant's rows are counted: a fresh variant must
 * have added all its jobs, a duplicate one none. No runner runs.
 */
import pg from "pg";
import { makeWorkerUtils, type WorkerUtils } from "graphile-worker";
import type { Locks } from "../src/index.js";
import { library } from "./library.js";
import {
  benchRounds,
  fmtFixed,
  fmtInt,
  fmtPercent,
  goal,
  median,
  now,
  quietLogger,
} from "./lib.js";
import { resetJobs, round, spread, table, type BenchContext, type Section } from "./lib.js";

const ROUNDS = benchRounds(5);
const POOL_SIZE = 4;
/** Slices per variant and round in the single phase (bulk: one call per slice). */
const SLICES = 5;
const SIZES = {
  full: { single: 2500, warmSingle: 500, bulkBatch: 1000, bulkBatches: 5 },
  quick: { single: 200, warmSingle: 50, bulkBatch: 200, bulkBatches: 1 },
};
/** The exclusive `drop` tasks of the preemptive variant and of its reference without the check. */
const EXCLUSIVE_TASKS = { preemptive: "enq_exclusive", unchecked: "enq_exclusive_unchecked" };
/** A `uniqueFor` window long enough to outlast the section. */
const WINDOW_SECONDS = 3600;

type Keys = "fresh" | "duplicate";
type UniqueSpec = { unique?: "queued" | "active" | "exists"; uniqueFor?: number };

interface Tools {
  pool: pg.Pool;
  utils: WorkerUtils;
  locks: Locks;
  close(): Promise<void>;
}

/**
 * A pool (max POOL_SIZE) with graphile-worker's utils and a Locks instance on it. The single and bulk
 * phases each measure on their own, and the duplicates are seeded through a third: PostgreSQL caches the
 * plans of PL/pgSQL functions per session, and graphile-worker's `add_jobs()` (behind a plain `addJob`)
 * switches to a generic plan, about twice as fast, in a session that ran it with large arrays, which a
 * process that enqueues one job at a time never does. Seeding through the measured sessions would flatter it.
 */
async function openTools(ctx: BenchContext, name: string): Promise<Tools> {
  const pool = new pg.Pool({
    connectionString: ctx.url,
    max: POOL_SIZE,
    application_name: `gwl-bench-enqueue-${name}`,
  });
  // graphile-worker checks that a pool given to it handles errors of the pool and of its clients.
  pool.on("error", (error) => ctx.log(`enqueue ${name} pool error: ${error.message}`));
  pool.on("connect", (client) =>
    client.on("error", (error) => ctx.log(`enqueue ${name} client error: ${error.message}`)),
  );
  const utils = await makeWorkerUtils({ pgPool: pool, logger: quietLogger });
  const locks = library.makeLocks({ pgPool: pool, logger: quietLogger });
  for (const task of Object.values(EXCLUSIVE_TASKS)) {
    locks.exclusive(task, async () => undefined, {
      onConflict: "drop",
      key: (p: { k: string }) => p.k,
    });
  }
  await locks.migrate();
  return {
    pool,
    utils,
    locks,
    async close() {
      await locks.release();
      await utils.release();
      await pool.end();
    },
  };
}

interface Variant {
  id: string;
  label: string;
  kind: "single" | "bulk";
  keys: Keys;
  /** Its own task identifier (its rows are counted by it). */
  task: string;
  /** Adds the keys up front (duplicate variants), untimed. */
  seed?(tools: Tools, task: string, keys: string[]): Promise<void>;
  /** Single: one enqueue. Resolves its outcome ("added", "duplicate", ...). */
  one?(tools: Tools, task: string, key: string): Promise<string>;
  /** Bulk: one call. Resolves the outcomes (none when the API reports none). */
  many?(tools: Tools, task: string, keys: string[]): Promise<string[]>;
}

const payload = (key: string) => ({ k: key });

/** The library's bulk enqueue with these unique options (also the seed of its duplicates). */
const locksBulk =
  (unique: UniqueSpec) =>
  async ({ locks }: Tools, task: string, keys: string[]): Promise<string[]> =>
    (
      await locks.addJobs(keys.map((k) => ({ identifier: task, payload: payload(k), ...unique })))
    ).map((r) => r.outcome);

/**
 * graphile-worker's bulk enqueue, with a job key per job or none. `"library"`: the very key `locks.addJobs`
 * gives the job as a unique job (SHA-256 hex of its task and payload, 70 characters), computed here per job.
 */
const gwBulk =
  (keyed: boolean | "library") =>
  async ({ utils }: Tools, task: string, keys: string[]): Promise<string[]> => {
    await utils.addJobs(
      keys.map((k) => {
        const jobPayload = payload(k);
        if (!keyed) return { identifier: task, payload: jobPayload };
        const jobKey = keyed === "library" ? library.uniqueJobKey(task, jobPayload, null) : k;
        return { identifier: task, payload: jobPayload, jobKey };
      }),
    );
    return [];
  };

const seedWith =
  (bulk: (tools: Tools, task: string, keys: string[]) => Promise<unknown>) =>
  async (tools: Tools, task: string, keys: string[]): Promise<void> => {
    for (let i = 0; i < keys.length; i += 1000) await bulk(tools, task, keys.slice(i, i + 1000));
  };

const dedupe = async ({ utils }: Tools, task: string, key: string) => {
  const job = await utils.addJob(task, payload(key), { jobKey: key, jobKeyMode: "unsafe_dedupe" });
  // unsafe_dedupe bumps the existing row's revision instead of inserting.
  return job.revision === 0 ? "added" : "duplicate";
};

type One = NonNullable<Variant["one"]>;
type Many = NonNullable<Variant["many"]>;
type Seed = Variant["seed"];
const single = (id: string, label: string, keys: Keys, one: One, seed?: Seed) =>
  ({ id, label, kind: "single", keys, one, ...(seed ? { seed } : {}) }) as const;
const bulk = (id: string, label: string, keys: Keys, many: Many, seed?: Seed) =>
  ({ id, label, kind: "bulk", keys, many, ...(seed ? { seed } : {}) }) as const;

/** `locks.addJob` with these unique options, with fresh keys and over existing ones. */
function uniqueSingle(id: string, label: string, unique: UniqueSpec): Array<Omit<Variant, "task">> {
  const one: One = async ({ locks }, task, key) =>
    (await locks.addJob(task, payload(key), unique)).outcome;
  return [
    single(`${id}/fresh`, label, "fresh", one),
    single(`${id}/duplicate`, label, "duplicate", one, seedWith(locksBulk(unique))),
  ];
}

const gwLabel = "graphile-worker addJob jobKey unsafe_dedupe";
const uniqueActive = locksBulk({ unique: "active" });
const VARIANTS: Variant[] = (
  [
    single("addJob", "graphile-worker addJob", "fresh", async ({ utils }, task, key) => {
      await utils.addJob(task, payload(key));
      return "added";
    }),
    single("dedupe/fresh", gwLabel, "fresh", dedupe),
    single("dedupe/duplicate", gwLabel, "duplicate", dedupe, seedWith(gwBulk(true))),
    single(
      "preemptive",
      "locks.addJob, preemptive check (exclusive drop task)",
      "fresh",
      async ({ locks }, task, key) => (await locks.addJob(task, payload(key))).outcome,
    ),
    single(
      "unchecked",
      "locks.addJob, same task, preemptive: false (reference)",
      "fresh",
      async ({ locks }, task, key) =>
        (await locks.addJob(task, payload(key), { preemptive: false })).outcome,
    ),
    ...uniqueSingle("queued", "locks.addJob unique: queued", { unique: "queued" }),
    ...uniqueSingle("active", "locks.addJob unique: active", { unique: "active" }),
    ...uniqueSingle("exists", "locks.addJob unique: exists", { unique: "exists" }),
    ...uniqueSingle("uniqueFor", `locks.addJob uniqueFor: ${WINDOW_SECONDS} (alone)`, {
      uniqueFor: WINDOW_SECONDS,
    }),
    bulk("bulk-gw-plain", "graphile-worker addJobs, no job keys", "fresh", gwBulk(false)),
    bulk("bulk-gw-keys/fresh", "graphile-worker addJobs, distinct job keys", "fresh", gwBulk(true)),
    bulk(
      "bulk-gw-libkeys/fresh",
      "graphile-worker addJobs, job keys as the library's",
      "fresh",
      gwBulk("library"),
    ),
    bulk(
      "bulk-gw-keys/duplicate",
      "graphile-worker addJobs, distinct job keys (existing: replaced)",
      "duplicate",
      gwBulk(true),
      seedWith(gwBulk(true)),
    ),
    bulk("bulk-locks-plain", "locks.addJobs, no uniqueness (reference)", "fresh", locksBulk({})),
    bulk("bulk-unique/fresh", "locks.addJobs unique: active", "fresh", uniqueActive),
    bulk(
      "bulk-unique/duplicate",
      "locks.addJobs unique: active",
      "duplicate",
      uniqueActive,
      seedWith(uniqueActive),
    ),
  ] as Array<Omit<Variant, "task">>
).map((v, i) => ({
  ...v,
  task:
    v.id in EXCLUSIVE_TASKS ? EXCLUSIVE_TASKS[v.id as keyof typeof EXCLUSIVE_TASKS] : `enq_${i}`,
}));

export interface RunFigures {
  variant: string;
  /** 0 for the warm-up. */
  round: number;
  enqueues: number;
  /** Sum of the variant's slices. */
  seconds: number;
  perSecond: number;
}

/** Rows in the job table per task identifier. */
async function rowsByTask(pool: pg.Pool): Promise<Map<string, number>> {
  const { rows } = await pool.query<{ identifier: string; n: number }>(
    `select t.identifier, count(*)::int as n
     from graphile_worker._private_jobs j join graphile_worker._private_tasks t on t.id = j.task_id
     group by t.identifier`,
  );
  return new Map(rows.map((r) => [r.identifier, r.n]));
}

/** One phase of one round: every variant of `variants`, interleaved slice by slice. */
async function phase(
  ctx: BenchContext,
  tools: Tools,
  seedTools: Tools,
  variants: Variant[],
  count: number,
  slices: number,
  roundNumber: number,
): Promise<RunFigures[]> {
  const keysOf = new Map(
    variants.map((v) => [v.id, Array.from({ length: count }, (_, i) => `${v.id}:${i + 1}`)]),
  );
  await resetJobs(ctx.pool);
  await ctx.pool.query("truncate graphile_worker_locks.unique_windows");
  for (const v of variants) {
    if (v.keys === "duplicate") await v.seed!(seedTools, v.task, keysOf.get(v.id)!);
  }
  await ctx.pool.query("vacuum analyze graphile_worker._private_jobs");
  await ctx.pool.query("vacuum analyze graphile_worker_locks.unique_windows");
  const before = await rowsByTask(ctx.pool);

  const seconds = new Map<string, number>(variants.map((v) => [v.id, 0]));
  const outcomes = new Map<string, Map<string, number>>(variants.map((v) => [v.id, new Map()]));
  const sliceSize = Math.ceil(count / slices);
  for (let slice = 0; slice < slices; slice++) {
    for (let j = 0; j < variants.length; j++) {
      const v = variants[(slice + j) % variants.length]!;
      const keys = keysOf.get(v.id)!.slice(slice * sliceSize, (slice + 1) * sliceSize);
      const tally = outcomes.get(v.id)!;
      const add = (outcome: string) => tally.set(outcome, (tally.get(outcome) ?? 0) + 1);
      const t0 = now();
      if (v.kind === "single") {
        for (const key of keys) add(await v.one!(tools, v.task, key));
      } else {
        for (const outcome of await v.many!(tools, v.task, keys)) add(outcome);
      }
      seconds.set(v.id, seconds.get(v.id)! + (now() - t0) / 1000);
    }
  }

  // Check that every variant did what it claims.
  const after = await rowsByTask(ctx.pool);
  return variants.map((v) => {
    const added = (after.get(v.task) ?? 0) - (before.get(v.task) ?? 0);
    const expected = v.keys === "fresh" ? count : 0;
    const tally = outcomes.get(v.id)!;
    const wrong = [...tally.keys()].some((o) => o !== (v.keys === "fresh" ? "added" : "duplicate"));
    if (added !== expected || wrong) {
      throw new Error(
        `enqueue ${v.id}: expected ${expected} job(s) added, got ${added}; outcomes ` +
          JSON.stringify(Object.fromEntries(tally)),
      );
    }
    const s = seconds.get(v.id)!;
    return {
      variant: v.id,
      round: roundNumber,
      enqueues: count,
      seconds: round(s, 3),
      perSecond: Math.round(count / s),
    };
  });
}

export interface VariantFigures {
  id: string;
  label: string;
  kind: "single" | "bulk";
  keys: Keys;
  enqueues: number;
  medianPerSecond: number;
  spread: number;
}

export const enqueue: Section = {
  id: "enqueue",
  title: "Enqueue throughput",
  async run(ctx) {
    const size = ctx.quick ? SIZES.quick : SIZES.full;
    const rounds = ctx.quick ? 1 : ROUNDS;
    const opened: Tools[] = [];
    const open = async (name: string) => {
      const tools = await openTools(ctx, name);
      opened.push(tools);
      return tools;
    };
    const single = VARIANTS.filter((v) => v.kind === "single");
    const bulk = VARIANTS.filter((v) => v.kind === "bulk");
    const runs: RunFigures[] = [];
    try {
      const singleTools = await open("single");
      const bulkTools = await open("bulk");
      const seedTools = await open("seed");
      for (let r = 0; r <= rounds; r++) {
        const warm = r === 0;
        const results = [
          ...(await phase(
            ctx,
            singleTools,
            seedTools,
            single,
            warm ? size.warmSingle : size.single,
            SLICES,
            r,
          )),
          ...(await phase(
            ctx,
            bulkTools,
            seedTools,
            bulk,
            size.bulkBatch * (warm ? 1 : size.bulkBatches),
            warm ? 1 : size.bulkBatches,
            r,
          )),
        ];
        ctx.log(
          `enqueue: ${warm ? "warm-up" : `round ${r}`}: ` +
            results.map((f) => `${f.variant} ${fmtInt(f.perSecond)}/s`).join(", "),
        );
        runs.push(...results);
      }
    } finally {
      for (const tools of opened) await tools.close();
    }

    const summaries: VariantFigures[] = VARIANTS.map((v) => {
      const rates = runs.filter((r) => r.variant === v.id && r.round > 0).map((r) => r.perSecond);
      return {
        id: v.id,
        label: v.label,
        kind: v.kind,
        keys: v.keys,
        enqueues: v.kind === "single" ? size.single : size.bulkBatch * size.bulkBatches,
        medianPerSecond: Math.round(median(rates)),
        spread: round(spread(rates), 3),
      };
    });
    const rate = (id: string) => summaries.find((s) => s.id === id)!.medianPerSecond;
    return {
      tables: tables(summaries, size, rounds, rate),
      goals: goals(rate),
      figures: { poolSize: POOL_SIZE, rounds, slices: SLICES, ...size, summaries, runs },
    };
  },
};

/** The reference of each variant's ratio, and its short name in the table. */
const REFERENCES: Array<[RegExp, string]> = [
  [/^(preemptive|unchecked|dedupe\/.*)$/, "addJob"],
  [/^(queued|active|exists|uniqueFor)\/fresh$/, "dedupe/fresh"],
  [/^(queued|active|exists|uniqueFor)\/duplicate$/, "dedupe/duplicate"],
  [/^bulk-unique\/fresh$/, "bulk-gw-libkeys/fresh"],
  [
    /^(bulk-unique\/duplicate|bulk-gw-plain|bulk-gw-libkeys\/fresh|bulk-gw-keys\/duplicate|bulk-locks-plain)$/,
    "bulk-gw-keys/fresh",
  ],
];
const SHORT: Record<string, string> = {
  addJob: "addJob",
  "dedupe/fresh": "unsafe_dedupe fresh",
  "dedupe/duplicate": "unsafe_dedupe dup.",
  "bulk-gw-keys/fresh": "gw addJobs keys",
  "bulk-gw-libkeys/fresh": "gw addJobs same keys",
};

function tables(
  summaries: VariantFigures[],
  size: (typeof SIZES)["full"],
  rounds: number,
  rate: (id: string) => number,
) {
  const rows = (kind: Variant["kind"]) =>
    summaries
      .filter((s) => s.kind === kind)
      .map((s) => {
        const ref = REFERENCES.find(([pattern]) => pattern.test(s.id))?.[1];
        const ratio = ref ? `${fmtFixed(s.medianPerSecond / rate(ref), 2)} × ${SHORT[ref]}` : "";
        return [
          s.label,
          s.keys,
          fmtInt(s.enqueues),
          `${fmtInt(s.medianPerSecond)} ±${fmtPercent(s.spread)}`,
          ratio,
        ];
      });
  const headers = "variant | <keys | enqueues/run | per second | <ratio";
  return [
    table(
      `Enqueue, single (sequential, awaited one by one): enqueues/s, median of ${rounds} rounds (± = spread)`,
      headers,
      rows("single"),
      [
        "fresh: every key new (every enqueue adds a job); duplicate: every key already has a queued job (nothing is added).",
        `Variants interleaved in ${SLICES} slices per round, sharing the job table (each its own task and keys).`,
        `Same pool for everyone (pg.Pool max ${POOL_SIZE}, given to makeWorkerUtils and makeLocks as pgPool); no runner;`,
        "duplicates seeded through another pool (see openTools: a session's plan cache depends on what it ran).",
        "preemptive: nothing is held, so the check passes and every job is added; the reference row is the same enqueue",
        "without the check (preemptive: false), so the difference is the check's own cost (a read of pg_locks).",
      ],
    ),
    table(
      `Enqueue, bulk (${size.bulkBatches} calls of ${fmtInt(size.bulkBatch)} jobs per round, interleaved): jobs/s, ` +
        `median of ${rounds} rounds`,
      headers,
      rows("bulk"),
      [
        "graphile-worker's addJobs with existing keys replaces the waiting jobs (its job key semantics); locks.addJobs",
        "answers duplicate and writes nothing.",
      ],
    ),
  ];
}

function goals(rate: (id: string) => number) {
  const atLeast = (name: string, target: string, value: number, threshold: number) =>
    goal(name, target, round(value, 3), value >= threshold);
  return [
    atLeast(
      "preemptive check",
      "locks.addJob preemptive / graphile-worker addJob ≥ 0.90",
      rate("preemptive") / rate("addJob"),
      0.9,
    ),
    ...(["fresh", "duplicate"] as const).flatMap((keys) =>
      ["queued", "active", "exists", "uniqueFor"].map((scope) =>
        atLeast(
          `unique single, ${scope}, ${keys} keys`,
          `locks.addJob / addJob unsafe_dedupe (${keys}) ≥ 1.00`,
          rate(`${scope}/${keys}`) / rate(`dedupe/${keys}`),
          1,
        ),
      ),
    ),
    atLeast(
      "unique bulk, fresh keys",
      "locks.addJobs unique / graphile-worker addJobs with job keys ≥ 0.80",
      rate("bulk-unique/fresh") / rate("bulk-gw-keys/fresh"),
      0.8,
    ),
    atLeast(
      "unique bulk, fresh keys, same keys",
      "locks.addJobs unique / graphile-worker addJobs with the library's job keys ≥ 1.00",
      rate("bulk-unique/fresh") / rate("bulk-gw-libkeys/fresh"),
      1,
    ),
  ];
}
