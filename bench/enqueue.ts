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
import { benchRounds, fmtFixed, fmtInt, fmtPercent, goal, median, now } from "./lib.js";
import { quietLogger, resetJobs, round, sizedSection, spread, table } from "./lib.js";
import type { BenchContext } from "./lib.js";

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
type UniqueSpec = {
  unique?: "queued" | "active" | "exists";
  uniqueFor?: number;
  enqueueRate?: { limit: number; period: number; key?: (p: { k: string }) => unknown };
  debounce?: { delay: number; maxWait: number };
};
/** Rate-limited enqueues that all pass: a fresh key each, or one key whose log grows to `limit` stamps. */
const RATE_FRESH = { enqueueRate: { limit: 1000, period: WINDOW_SECONDS * 1000 } };
/**
 * One key under a limit of 100 per millisecond: its log fills to 100 stamps, then every enqueue replaces the
 * oldest (100 enqueues take well over a millisecond), so every enqueue is admitted with a full log.
 */
const RATE_ONE_KEY = { enqueueRate: { limit: 100, period: 1, key: () => "one" } };
/**
 * Ten keys under a limit of 100 per millisecond: a batch of 1,000 has 100 items of each, all admitted (a
 * batch takes well over a millisecond), each key's log full from the second batch on.
 */
const RATE_TEN_KEYS = {
  enqueueRate: { limit: 100, period: 1, key: (p: { k: string }) => Number(p.k.split(":")[1]) % 10 },
};

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

/** A variant's enqueues: one call of the API per key (single) or one for all the keys (bulk). */
type Enqueue = (tools: Tools, task: string, keys: string[]) => Promise<string[]>;

interface Variant {
  id: string;
  label: string;
  kind: "single" | "bulk";
  /** fresh: every key new; duplicate: every key seeded beforehand, untimed, by `seed`. */
  keys: Keys;
  /** Its own task identifier (its rows are counted by it). */
  task: string;
  /** The variant its ratio is against ("" for none). */
  ref: string;
  /** Resolves the outcome of each enqueue ("added", "duplicate"; none when the API reports none). */
  run: Enqueue;
  seed?(tools: Tools, task: string, keys: string[]): Promise<unknown>;
}

const payload = (key: string) => ({ k: key });

/** One awaited call of `one` per key, one after another. */
const each =
  (one: (tools: Tools, task: string, key: string) => Promise<string>): Enqueue =>
  async (tools, task, keys) => {
    const outcomes = [];
    for (const key of keys) outcomes.push(await one(tools, task, key));
    return outcomes;
  };

/** The library's bulk enqueue with these unique options (also the seed of its duplicates). */
const locksBulk =
  (unique: UniqueSpec): Enqueue =>
  async ({ locks }, task, keys) =>
    (
      await locks.addJobs(keys.map((k) => ({ identifier: task, payload: payload(k), ...unique })))
    ).map((r) => r.outcome);

/** The library's single enqueue with these options. */
const locksOne = (spec: UniqueSpec & { preemptive?: false }) =>
  each(async ({ locks }, task, key) => (await locks.addJob(task, payload(key), spec)).outcome);

/**
 * graphile-worker's bulk enqueue, with a job key per job or none. `"library"`: the very key `locks.addJobs`
 * gives the job as a unique job (SHA-256 hex of its task and payload, 70 characters), computed here per job.
 */
const gwBulk =
  (keyed: boolean | "library"): Enqueue =>
  async ({ utils }, task, keys) => {
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

const seedWith = (bulk: Enqueue) => async (tools: Tools, task: string, keys: string[]) => {
  for (let i = 0; i < keys.length; i += 1000) await bulk(tools, task, keys.slice(i, i + 1000));
};

const dedupe = each(async ({ utils }, task, key) => {
  const job = await utils.addJob(task, payload(key), { jobKey: key, jobKeyMode: "unsafe_dedupe" });
  // unsafe_dedupe bumps the existing row's revision instead of inserting.
  return job.revision === 0 ? "added" : "duplicate";
});

/** A variant: bulk if its id says so, of duplicate keys if it has a seed. */
const variant = (id: string, label: string, ref: string, run: Enqueue, seed?: Variant["seed"]) => ({
  ...{ id, label, ref, run, ...(seed ? { seed } : {}) },
  kind: id.startsWith("bulk") ? ("bulk" as const) : ("single" as const),
  keys: seed ? ("duplicate" as const) : ("fresh" as const),
});

/** `locks.addJob` with these unique options, with fresh keys and over existing ones. */
const uniqueSingle = (id: string, label: string, unique: UniqueSpec) => [
  variant(`${id}/fresh`, label, "dedupe/fresh", locksOne(unique)),
  variant(
    `${id}/duplicate`,
    label,
    "dedupe/duplicate",
    locksOne(unique),
    seedWith(locksBulk(unique)),
  ),
];

const GW_DEDUPE = "graphile-worker addJob jobKey unsafe_dedupe";
const GW_KEYS = "graphile-worker addJobs, distinct job keys";
const UNIQUE_ACTIVE = "locks.addJobs unique: active";
const KEYED = "bulk-gw-keys/fresh";
const LIBRARY_KEYED = "bulk-gw-libkeys/fresh";
const uniqueActive = locksBulk({ unique: "active" });
const gwAdd = each(
  async ({ utils }, task, key) => (await utils.addJob(task, payload(key)), "added"),
);
/** Every variant; its order is the order of the table's rows. */
const VARIANTS: Variant[] = [
  variant("addJob", "graphile-worker addJob", "", gwAdd),
  variant("dedupe/fresh", GW_DEDUPE, "addJob", dedupe),
  variant("dedupe/duplicate", GW_DEDUPE, "addJob", dedupe, seedWith(gwBulk(true))),
  variant(
    "preemptive",
    "locks.addJob, preemptive check (exclusive drop task)",
    "addJob",
    locksOne({}),
  ),
  variant(
    "unchecked",
    "locks.addJob, same task, preemptive: false (reference)",
    "addJob",
    locksOne({ preemptive: false }),
  ),
  ...uniqueSingle("queued", "locks.addJob unique: queued", { unique: "queued" }),
  ...uniqueSingle("active", "locks.addJob unique: active", { unique: "active" }),
  ...uniqueSingle("exists", "locks.addJob unique: exists", { unique: "exists" }),
  ...uniqueSingle("uniqueFor", `locks.addJob uniqueFor: ${WINDOW_SECONDS} (alone)`, {
    uniqueFor: WINDOW_SECONDS,
  }),
  variant("locks-plain", "locks.addJob, no options (reference)", "addJob", locksOne({})),
  variant(
    "rate/fresh",
    "locks.addJob enqueueRate, a fresh key each",
    "locks-plain",
    locksOne(RATE_FRESH),
  ),
  variant(
    "rate/one-key",
    "locks.addJob enqueueRate, one key, a full log of 100",
    "locks-plain",
    locksOne(RATE_ONE_KEY),
  ),
  variant(
    "debounce/fresh",
    "locks.addJob debounce, a fresh key each",
    "locks-plain",
    locksOne({ debounce: { delay: 60_000, maxWait: 60_000 } }),
  ),
  variant("bulk-gw-plain", "graphile-worker addJobs, no job keys", KEYED, gwBulk(false)),
  variant(KEYED, GW_KEYS, "", gwBulk(true)),
  variant(
    LIBRARY_KEYED,
    "graphile-worker addJobs, job keys as the library's",
    KEYED,
    gwBulk("library"),
  ),
  variant(
    "bulk-gw-keys/duplicate",
    `${GW_KEYS} (existing: replaced)`,
    KEYED,
    gwBulk(true),
    seedWith(gwBulk(true)),
  ),
  variant("bulk-locks-plain", "locks.addJobs, no uniqueness (reference)", KEYED, locksBulk({})),
  variant(
    "bulk-rate/fresh",
    "locks.addJobs enqueueRate, a fresh key each",
    "bulk-locks-plain",
    locksBulk(RATE_FRESH),
  ),
  variant(
    "bulk-rate/ten-keys",
    "locks.addJobs enqueueRate, 10 keys, full logs of 100",
    "bulk-locks-plain",
    locksBulk(RATE_TEN_KEYS),
  ),
  variant("bulk-unique/fresh", UNIQUE_ACTIVE, LIBRARY_KEYED, uniqueActive),
  variant("bulk-unique/duplicate", UNIQUE_ACTIVE, KEYED, uniqueActive, seedWith(uniqueActive)),
].map((v, i) => ({
  ...v,
  task:
    v.id in EXCLUSIVE_TASKS ? EXCLUSIVE_TASKS[v.id as keyof typeof EXCLUSIVE_TASKS] : `enq_${i}`,
}));
/** The short name of each reference in the table's ratio column. */
const SHORT: Record<string, string> = {
  addJob: "addJob",
  "dedupe/fresh": "unsafe_dedupe fresh",
  "dedupe/duplicate": "unsafe_dedupe dup.",
  [KEYED]: "gw addJobs keys",
  [LIBRARY_KEYED]: "gw addJobs same keys",
  "locks-plain": "locks.addJob plain",
  "bulk-locks-plain": "locks.addJobs plain",
};

/** Rows in the job table per task identifier. */
async function rowsByTask(pool: pg.Pool): Promise<Map<string, number>> {
  const { rows } = await pool.query<{ identifier: string; n: number }>(
    `select t.identifier, count(*)::int as n
     from graphile_worker._private_jobs j join graphile_worker._private_tasks t on t.id = j.task_id
     group by t.identifier`,
  );
  return new Map(rows.map((r) => [r.identifier, r.n]));
}

/**
 * One phase of one round: every variant of `kind`, `count` enqueues each, interleaved slice by slice;
 * resolves each variant's enqueues per second.
 */
async function phase(
  ctx: BenchContext,
  tools: Tools,
  seedTools: Tools,
  kind: Variant["kind"],
  count: number,
  slices: number,
): Promise<Array<{ variant: string; perSecond: number }>> {
  const variants = VARIANTS.filter((v) => v.kind === kind);
  const keysOf = new Map(
    variants.map((v) => [v.id, Array.from({ length: count }, (_, i) => `${v.id}:${i + 1}`)]),
  );
  await resetJobs(ctx.pool);
  await ctx.pool.query(
    "truncate graphile_worker_locks.unique_windows, graphile_worker_locks.enqueue_rates, graphile_worker_locks.debounces",
  );
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
      const t0 = now();
      const result = await v.run(tools, v.task, keys);
      seconds.set(v.id, seconds.get(v.id)! + (now() - t0) / 1000);
      const tally = outcomes.get(v.id)!;
      for (const outcome of result) tally.set(outcome, (tally.get(outcome) ?? 0) + 1);
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
    return { variant: v.id, perSecond: Math.round(count / seconds.get(v.id)!) };
  });
}

export const enqueue = sizedSection(
  { id: "enqueue", title: "Enqueue throughput", sizes: SIZES, rounds: benchRounds(5) },
  async (ctx, size, rounds) => {
    const opened: Tools[] = [];
    const runs: Array<{ variant: string; round: number; perSecond: number }> = [];
    try {
      for (const name of ["single", "bulk", "seed"]) opened.push(await openTools(ctx, name));
      const [singleTools, bulkTools, seedTools] = opened as [Tools, Tools, Tools];
      for (let r = 0; r <= rounds; r++) {
        const [count, batches] = r === 0 ? [size.warmSingle, 1] : [size.single, size.bulkBatches];
        const results = [
          ...(await phase(ctx, singleTools, seedTools, "single", count, SLICES)),
          ...(await phase(ctx, bulkTools, seedTools, "bulk", size.bulkBatch * batches, batches)),
        ];
        ctx.log(
          `enqueue: ${r === 0 ? "warm-up" : `round ${r}`}: ` +
            results.map((f) => `${f.variant} ${fmtInt(f.perSecond)}/s`).join(", "),
        );
        runs.push(...results.map((f) => ({ ...f, round: r })));
      }
    } finally {
      for (const tools of opened) await tools.close();
    }

    const summaries = VARIANTS.map(({ id, label, kind, keys, ref }) => {
      const rates = runs.filter((r) => r.variant === id && r.round > 0).map((r) => r.perSecond);
      const enqueues = kind === "single" ? size.single : size.bulkBatch * size.bulkBatches;
      const figures = {
        medianPerSecond: Math.round(median(rates)),
        spread: round(spread(rates), 3),
      };
      return { id, label, kind, keys, ref, enqueues, ...figures };
    });
    const rate = (id: string) => summaries.find((s) => s.id === id)!.medianPerSecond;
    /** A goal on the ratio of `id` to `ref`: at least `least`. */
    const ratio = (name: string, what: string, id: string, ref: string, least: number) => {
      const value = rate(id) / rate(ref);
      return goal(name, `${what} ≥ ${fmtFixed(least, 2)}`, round(value, 3), value >= least);
    };
    const rows = (kind: Variant["kind"]) =>
      summaries
        .filter((s) => s.kind === kind)
        .map((s) => [
          s.label,
          s.keys,
          fmtInt(s.enqueues),
          `${fmtInt(s.medianPerSecond)} ±${fmtPercent(s.spread)}`,
          s.ref ? `${fmtFixed(s.medianPerSecond / rate(s.ref), 2)} × ${SHORT[s.ref]}` : "",
        ]);
    const headers = "variant | <keys | enqueues/run | per second | <ratio";
    return {
      tables: [
        table(
          `Enqueue, single (sequential, awaited one by one): enqueues/s, median of ${rounds} rounds (± = spread)`,
          headers,
          rows("single"),
          [
            "fresh: every key new (every enqueue adds a job); duplicate: every key already has a queued job (nothing is added).",
          ],
        ),
        table(
          `Enqueue, bulk (${size.bulkBatches} calls of ${fmtInt(size.bulkBatch)} jobs per round, interleaved): jobs/s, ` +
            `median of ${rounds} rounds`,
          headers,
          rows("bulk"),
          [
            "existing: replaced: graphile-worker's job key semantics; locks.addJobs answers duplicate, writes nothing.",
          ],
        ),
      ],
      goals: [
        ratio(
          "preemptive check",
          "locks.addJob preemptive / graphile-worker addJob",
          "preemptive",
          "addJob",
          0.9,
        ),
        ...(["fresh", "duplicate"] as const).flatMap((keys) =>
          ["queued", "active", "exists", "uniqueFor"].map((scope) =>
            ratio(
              `unique single, ${scope}, ${keys} keys`,
              `locks.addJob / addJob unsafe_dedupe (${keys})`,
              `${scope}/${keys}`,
              `dedupe/${keys}`,
              1,
            ),
          ),
        ),
        ratio(
          "rate-limited enqueue, single",
          "locks.addJob enqueueRate (fresh keys) / locks.addJob plain",
          "rate/fresh",
          "locks-plain",
          0.8,
        ),
        ratio(
          "unique bulk, fresh keys",
          "locks.addJobs unique / graphile-worker addJobs with job keys",
          "bulk-unique/fresh",
          KEYED,
          0.8,
        ),
        ratio(
          "unique bulk, fresh keys, same keys",
          "locks.addJobs unique / graphile-worker addJobs with the library's job keys",
          "bulk-unique/fresh",
          LIBRARY_KEYED,
          1,
        ),
      ],
      figures: { poolSize: POOL_SIZE, rounds, slices: SLICES, ...size, summaries, runs },
    };
  },
);
