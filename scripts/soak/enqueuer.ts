/**
 * The enqueuing process of `npm run soak`: until SOAK_UNTIL (epoch ms), adds jobs of the soak's two tasks
 * through `locks.addJob`, a third of them unique (`unique: "queued"`), half of those followed at once by a
 * duplicate enqueue of the same unique key. Each enqueue runs in a transaction that also writes its
 * `enqueues` row (ref, task, key, outcome, job id), so a row exists exactly when the enqueue committed: an
 * enqueue that fails (PostgreSQL restarting) is retried until its row exists. Choices come from SOAK_SEED.
 */
import pg from "pg";
import { makeLocks, type ExclusiveOptions } from "../../src/index.js";
import { between, seeded } from "./random.js";
import { makePool, SOAK_SCHEMA, soakLogger, type SoakPayload } from "./shared.js";
import { defineLimitsTasks, LIMITS_TASKS } from "./limits.js";
import { enqueueRated } from "./rated.js";
import { defineSupersedeTask, enqueueSuperseding } from "./superseding.js";

const url = process.env.DATABASE_URL!;
const until = Number(process.env.SOAK_UNTIL);
const random = seeded(Number(process.env.SOAK_SEED ?? 1));
const rate = Number(process.env.SOAK_RATE ?? 25);
const KEYS = 6;

const logger = soakLogger("[soak enqueuer]");
const pool = makePool({ connectionString: url, max: 2, application_name: "gwl-soak-enqueuer" });
const locks = makeLocks({
  pgPool: pool,
  applicationName: "graphile-worker-locks/soak-enqueuer",
  logger,
});
type Options = ExclusiveOptions<SoakPayload & { u?: string }>;
locks.define("soak_serial", {
  exclusive: true,
  onConflict: "reschedule",
  key: (p: SoakPayload) => p.k,
  reschedule: { minDelay: 20, maxDelay: 200 },
} as Options & { exclusive: true });
locks.define("soak_dedupe", {
  exclusive: true,
  onConflict: "drop",
  key: (p: SoakPayload) => p.k,
} as Options & { exclusive: true });

defineLimitsTasks(locks);
defineSupersedeTask(locks);

let errors = 0;
async function enqueue(
  task: string,
  payload: SoakPayload & { u?: string },
  unique: boolean,
): Promise<void> {
  for (;;) {
    let client: pg.PoolClient | undefined;
    try {
      client = await pool.connect();
      const done = await client.query(`select 1 from ${SOAK_SCHEMA}.enqueues where ref = $1`, [
        payload.ref,
      ]);
      if (done.rowCount) return;
      await client.query("begin");
      const { job, outcome } = await locks.addJob(task, payload, {
        pgClient: client,
        maxAttempts: 25,
        ...(unique ? { unique: "queued" as const, uniqueKey: (p: { u?: string }) => p.u } : {}),
      });
      await client.query(
        `insert into ${SOAK_SCHEMA}.enqueues (ref, task, k, unique_key, outcome, job_id)
         values ($1, $2, $3, $4, $5, $6)`,
        [payload.ref, task, payload.k, payload.u ?? null, outcome, job?.id ?? null],
      );
      await client.query("commit");
      client.release();
      return;
    } catch (error) {
      errors++;
      client?.release(true);
      if (Date.now() > until + 20_000) throw error;
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }
}

process.on("unhandledRejection", (reason) => {
  console.error(`[soak enqueuer] unhandled rejection: ${String(reason)}`);
});

let n = 0;
const started = Date.now();
while (Date.now() < until) {
  const r = random();
  const task =
    r < 0.45 ? "soak_serial" : r < 0.7 ? "soak_dedupe" : LIMITS_TASKS[Math.floor((r - 0.7) * 10)]!;
  const k = `k${between(random, 1, KEYS)}`;
  const ms = between(random, 20, 120);
  const ref = `e${++n}`;
  const unique = random() < 1 / 3;
  const payload = unique ? { k, ref, ms, u: `u${n}` } : { k, ref, ms };
  await enqueue(task, payload, unique);
  if (unique && random() < 0.5) await enqueue(task, { ...payload, ref: `${ref}d` }, true);
  await enqueueRated(pool, n);
  await enqueueSuperseding(locks, pool, n, until);
  // Paced to `rate` enqueues a second on average.
  const behind = started + (n * 1000) / rate - Date.now();
  if (behind > 0) await new Promise((resolve) => setTimeout(resolve, behind));
}
await locks.release();
await pool.end();
process.send?.({ type: "done", enqueued: n, errors }, () => process.exit(0));
