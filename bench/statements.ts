/**
 * Section "statements": what one lock statement costs PostgreSQL, by what its batch carries. A marked
 * backend (as a lock session's) runs the statement `batchQuery` (src/session/batch.ts) builds for a batch of
 * each kind, in a loop: each statement unlocks the previous one's hold and takes the next keys, as the
 * statement of a busy worker does. Measured: that backend's CPU per statement (Linux's schedstat of its
 * process, so only on an embedded server) and the round trip on this process's clock. The kinds alternate,
 * BENCH_ROUNDS rounds (default 5), medians. No worker and no job: the statement alone, which is what the
 * `limits` section's per-job figures add up over a run.
 */
import pg from "pg";
import type * as Batch from "../src/session/batch.js";
import type { HoldImpl, HoldInfo, LockRequest } from "../src/session/holds.js";
import type * as Sql from "../src/sql.js";
import { lockRequest } from "../test/support/lock-requests.js";
import { processSched } from "./cpu.js";
import { load } from "./library.js";
import { benchRounds, fmtFixed, fmtInt, median, sizedSection, table } from "./lib.js";

const SIZES = { full: { statements: 4000 }, quick: { statements: 300 } };
const MARK = "bench-statements";
/** Far from any key a bench job takes; each kind's keys are offsets from it (limit n: n × 2^32). */
const BASE = 7_000_000_000n;

type Hold = Pick<HoldImpl, "keyText" | "keyTexts" | "stacked" | "info">;
interface Kind {
  label: string;
  /** The requests of statement `i`, and the hold they make (unlocked by statement i + 1). */
  step(i: number): { locks: LockRequest[]; hold: Hold };
}

const key = (limit: number, i: number) => String(BASE + (BigInt(limit) << 32n) + BigInt(i));
const plain: HoldInfo = { taskIdentifier: "bench", jobId: "1", reschedule: false };

/** A job of `count` limits of one key each, its limits after the first in a group (woken at release). */
function limits(count: number): Kind {
  return {
    label: `${count} limits, one key each (the others in groups)`,
    step(i) {
      const keys = Array.from({ length: count }, (_, n) => key(n, i));
      const info: HoldInfo = { ...plain, wakeKeys: keys.slice(1).map(BigInt) };
      return {
        locks: [
          lockRequest(keys, info, { limits: keys.map((k) => [k]), lines: keys.map((k) => k) }),
        ],
        hold: { keyText: keys[0]!, keyTexts: keys, stacked: true, info },
      };
    },
  };
}

const KINDS: Kind[] = [
  {
    label: "1 key (plain exclusive)",
    step: (i) => ({
      locks: [lockRequest([key(0, i)], plain)],
      hold: { keyText: key(0, i), keyTexts: [key(0, i)], stacked: false, info: plain },
    }),
  },
  {
    label: "1 key in a group (its line woken at release)",
    step(i) {
      const info: HoldInfo = { ...plain, wakeKeys: [BigInt(key(0, i))] };
      return {
        locks: [lockRequest([key(0, i)], info)],
        hold: { keyText: key(0, i), keyTexts: [key(0, i)], stacked: false, info },
      };
    },
  },
  {
    label: "1 key, `reschedule` (its place in line asked)",
    step(i) {
      const info: HoldInfo = {
        taskIdentifier: "bench",
        jobId: String(1_000_000 + i),
        reschedule: true,
        wakeKey: BigInt(key(0, i)),
        prewakeAfterMs: null,
        releaseWaitMs: 0,
      };
      return {
        locks: [lockRequest([key(0, i)], info)],
        hold: { keyText: key(0, i), keyTexts: [key(0, i)], stacked: false, info },
      };
    },
  },
  limits(2),
  limits(3),
  {
    // (the contended run of section `limits`: a tenant's key, and a cap of 4 slots in a group)
    label: "2 limits, `reschedule`, the second a cap of 4 slots",
    step(i) {
      const tenant = key(0, i);
      const cap = [1, 2, 3, 4].map((slot) => key(slot, 0));
      const info: HoldInfo = {
        taskIdentifier: "bench",
        jobId: String(2_000_000 + i),
        reschedule: true,
        wakeKey: BigInt(tenant),
        wakeKeys: [BigInt(tenant), BigInt(cap[0]!)],
        prewakeAfterMs: null,
        releaseWaitMs: 0,
      };
      return {
        locks: [
          lockRequest([tenant, ...cap], info, { limits: [[tenant], cap], lines: [tenant, ""] }),
        ],
        hold: { keyText: tenant, keyTexts: [tenant, cap[0]!], stacked: true, info },
      };
    },
  },
];

export const statements = sizedSection(
  {
    id: "statements",
    title: "One lock statement, by what its batch carries",
    sizes: SIZES,
    rounds: 5,
  },
  async (ctx, size, defaultRounds) => {
    // (loaded here, not when the bench starts: a build whose modules lie elsewhere still runs the other
    // sections, e.g. an earlier commit's in an A/B of the contention section, bench/ab.ts)
    const { batchQuery, makeBatch } = await load<typeof Batch>("session/batch");
    const { CLAIM_BACKEND, makeSql } = await load<typeof Sql>("sql");
    const rounds = ctx.quick ? 1 : benchRounds(defaultRounds);
    const client = new pg.Client({ connectionString: ctx.url });
    await client.connect();
    try {
      // As the lock session does: its mark, and generic plans (connection.ts).
      const { rows } = await client.query<{ pid: number }>(CLAIM_BACKEND, [MARK]);
      const pid = rows[0]!.pid;
      await client.query("set plan_cache_mode = force_generic_plan");
      const sql = makeSql("graphile_worker_locks", "graphile_worker");
      const cpu = KINDS.map(() => [] as number[]);
      const trips = KINDS.map(() => [] as number[]);
      const names = KINDS.map(() => new Set<string>());
      for (let r = -1; r < rounds; r++) {
        // (round -1 warms up: each statement prepared and planned once)
        const count = r < 0 ? 50 : size.statements;
        for (let k = 0; k < KINDS.length; k++) {
          const kind = KINDS[k]!;
          let previous: Hold | null = null;
          const cpu0 = processSched(pid);
          const t0 = performance.now();
          for (let i = 0; i < count; i++) {
            const { locks, hold } = kind.step(i);
            const batch = makeBatch(previous ? [previous as HoldImpl] : [], locks, [], false);
            const query = batchQuery(sql, batch, pid, MARK);
            if (i > 0) names[k]!.add(query.name!);
            const answer = await client.query<{ op: number; key: string | null }>(query);
            // (every unlock and lock succeeds: a row of UNLOCK_FAILED, LOCK_FAILED or a '!' is a broken kind)
            if (
              answer.rows.some((row) => row.op <= 1 || (row.op === 8 && row.key!.startsWith("!")))
            )
              throw new Error(`${kind.label}: a statement failed: ${JSON.stringify(answer.rows)}`);
            previous = hold;
          }
          const elapsed = performance.now() - t0;
          const cpu1 = processSched(pid);
          await client.query("select pg_catalog.pg_advisory_unlock_all()");
          if (r < 0) continue;
          if (cpu0 && cpu1) cpu[k]!.push(((cpu1.runMs - cpu0.runMs) * 1000) / count);
          trips[k]!.push((elapsed * 1000) / count);
        }
      }
      const med = KINDS.map((_, k) => ({ cpuUs: median(cpu[k]!), tripUs: median(trips[k]!) }));
      ctx.log(
        `statements: ${KINDS.map((kind, k) => `${kind.label} ${fmtInt(med[k]!.cpuUs)} µs`).join("; ")}`,
      );
      return {
        tables: [
          table(
            `One lock statement (${size.statements} in a row per kind, each unlocking the previous one's keys; medians of ${rounds} alternating rounds)`,
            "batch | <statement | PostgreSQL CPU µs | round trip µs",
            KINDS.map((kind, k) => [
              kind.label,
              [...names[k]!].map((n) => n.replace(/^gwl_lock_/, "")).join(", "),
              Number.isNaN(med[k]!.cpuUs) ? "–" : fmtInt(med[k]!.cpuUs),
              fmtFixed(med[k]!.tripUs, 0),
            ]),
            [
              "CPU is the statement's backend's (its schedstat), so it is shown only for an embedded server.",
              "The statement: the branches it carries (src/sql.ts, LockShape); wakes = its lines locked and woken.",
            ],
          ),
        ],
        goals: [],
        figures: { kinds: KINDS.map((k) => k.label), cpu, trips, names: names.map((n) => [...n]) },
      };
    } finally {
      await client.end();
    }
  },
);
