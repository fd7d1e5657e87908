/**
 * Concurrent enqueues never deadlock: rounds of 2 to 4 bulk enqueues at once, on separate connections, with
 * overlapping unique keys in shuffled orders, and single enqueues of the same keys among them. Outside any
 * transaction, and inside the callers' own transactions (where nothing retries for them): no 40P01, one job
 * per key, every item answered with it.
 */
import fc from "fast-check";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { makeLocks, type AddJobResult, type Locks } from "../../src/index.js";
import { useTestDatabase } from "../support/db.js";
import { quietLogger } from "../support/runner.js";

const db = useTestDatabase();
const ROUNDS = 25;
const KEYS = 40;

let instances: Locks[] = [];
let clients: pg.Client[] = [];
beforeAll(async () => {
  instances = Array.from({ length: 5 }, () =>
    makeLocks({ connectionString: db.url, logger: quietLogger }),
  );
  clients = await Promise.all(
    Array.from({ length: 5 }, async () => {
      const client = new pg.Client({ connectionString: db.url });
      client.on("error", () => undefined);
      await client.connect();
      return client;
    }),
  );
});
afterAll(async () => {
  for (const locks of instances) await locks.release();
  for (const client of clients) await client.end();
});

type Mode = "no transaction" | "read committed" | "repeatable read";

interface Call {
  keys: number[];
  bulk: boolean;
}

/** One round's calls: 2-4 bulk enqueues of shuffled, overlapping key sets, and one caller of single enqueues. */
function roundPlan(seed: number): Call[] {
  const [plan] = fc.sample(
    fc.tuple(
      fc.array(fc.shuffledSubarray([...Array(KEYS).keys()], { minLength: KEYS / 2 }), {
        minLength: 2,
        maxLength: 4,
      }),
      fc.shuffledSubarray([...Array(KEYS).keys()], { minLength: 3, maxLength: 8 }),
    ),
    { seed, numRuns: 1 },
  );
  const [bulks, singles] = plan!;
  return [...bulks.map((keys) => ({ keys, bulk: true })), { keys: singles, bulk: false }];
}

/** Runs one caller's enqueues (in its own transaction for a transaction mode, retried on 40001 as documented). */
async function runCall(
  index: number,
  call: Call,
  round: string,
  mode: Mode,
  errors: string[],
): Promise<Array<[number, AddJobResult]>> {
  const locks = instances[index]!;
  const client = clients[index]!;
  const pgClient = mode === "no transaction" ? undefined : client;
  const enqueue = async (): Promise<Array<[number, AddJobResult]>> => {
    const payloadOf = (k: number) => ({ round, k });
    if (call.bulk) {
      const results = await locks.addJobs(
        call.keys.map((k) => ({
          identifier: "concurrent",
          payload: payloadOf(k),
          unique: "queued",
        })),
        { pgClient },
      );
      return results.map((r, i) => [call.keys[i]!, r]);
    }
    throw new Error("single enqueues go one by one");
  };
  const enqueueOne = async (k: number): Promise<Array<[number, AddJobResult]>> => [
    [k, await locks.addJob("concurrent", { round, k }, { unique: "queued", pgClient })],
  ];
  const inTransaction = async (
    fn: () => Promise<Array<[number, AddJobResult]>>,
  ): Promise<Array<[number, AddJobResult]>> => {
    for (;;) {
      try {
        if (mode === "no transaction") return await fn();
        await client.query(`begin isolation level ${mode}`);
        const results = await fn();
        await client.query("commit");
        return results;
      } catch (error) {
        const code = (error as { code?: string }).code ?? "none";
        if (mode !== "no transaction") await client.query("rollback");
        if (code === "40001" && mode === "repeatable read") continue;
        errors.push(`${code}: ${(error as Error).message}`);
        return [];
      }
    }
  };
  if (call.bulk) return inTransaction(enqueue);
  // Single enqueues each in a transaction of their own: a transaction that enqueues several keys one by one
  // takes them in the order its caller chose, which no enqueue can reorder.
  const out: Array<[number, AddJobResult]> = [];
  for (const k of call.keys) {
    out.push(...(await inTransaction(() => enqueueOne(k))));
  }
  return out;
}

describe("concurrent enqueues with overlapping keys in shuffled orders", () => {
  for (const mode of ["no transaction", "read committed", "repeatable read"] as const) {
    it(`never deadlock (${mode})`, async () => {
      const errors: string[] = [];
      for (let r = 0; r < ROUNDS; r++) {
        const round = `${mode}/${r}`;
        const calls = roundPlan(r + 1);
        const answered = await Promise.all(
          calls.map((call, index) => runCall(index, call, round, mode, errors)),
        );
        expect(errors, round).toEqual([]);
        // Every item answered, and every answer for a key is the one job of that key.
        const byKey = new Map<number, Set<string>>();
        let added = 0;
        answered.forEach((results, index) => {
          expect(results.length, `${round}: items answered by call ${index}`).toBe(
            calls[index]!.keys.length,
          );
          for (const [k, result] of results) {
            expect(["added", "duplicate"], round).toContain(result.outcome);
            if (result.outcome === "added") added++;
            const ids = byKey.get(k) ?? new Set<string>();
            ids.add(result.job!.id);
            byKey.set(k, ids);
          }
        });
        for (const [k, ids] of byKey) expect(ids.size, `${round}: jobs of key ${k}`).toBe(1);
        expect(added, `${round}: one job added per key`).toBe(byKey.size);
        const { rows } = await db.pool().query<{ n: number }>(
          `select count(*)::int as n from graphile_worker._private_jobs
            where payload->>'round' = $1`,
          [round],
        );
        expect(rows[0]!.n, round).toBe(byKey.size);
      }
    });
  }
});
