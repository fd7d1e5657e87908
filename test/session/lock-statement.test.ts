/**
 * The lock statement of a batch carries only the branches its requests use (`LockShape`, sql.ts), and a job
 * of several limits of one key each (no line) takes them all or none by one expression. Real PostgreSQL: the
 * statement runs on a marked backend, against keys another connection holds.
 */
import { describe, expect, it } from "vitest";
import { batchQuery, decodeBatch, makeBatch, type BatchRow } from "../../src/session/batch.js";
import type { HoldInfo, LockRequest } from "../../src/session/holds.js";
import { makeSql } from "../../src/sql.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { lockRequest, markBackend, stackedRequest } from "../support/lock-requests.js";

const h = useExclusiveHarness();
const sql = makeSql("graphile_worker_locks", "graphile_worker");
const MARK = "lock-statement-test";
const lineInfo: HoldInfo = {
  taskIdentifier: "t",
  jobId: "2",
  reschedule: true,
  wakeKey: 0n,
  prewakeAfterMs: null,
  releaseWaitMs: 0,
};

/** A marked backend (as a lock session's) and a runner of batches on it. */
async function session() {
  const client = await h.connect();
  const pid = await markBackend(client, MARK);
  return {
    client,
    async run(locks: LockRequest[]) {
      const query = batchQuery(sql, makeBatch([], locks, [], false), pid, MARK);
      const { rows } = await client.query<BatchRow>(query);
      return { name: query.name!, text: query.text, answer: decodeBatch(rows) };
    },
    /** The advisory keys (one bigint each) this backend holds, sorted. */
    async held(): Promise<string[]> {
      const { rows } = await client.query<{ k: string }>(
        `select ((classid::bigint << 32) | objid::bigint)::text as k from pg_locks
          where locktype = 'advisory' and objsubid = 1 and pid = pg_backend_pid() order by 1`,
      );
      return rows.map((r) => r.k);
    },
  };
}

describe("the lock statement of a batch", () => {
  it("carries only the branches its requests use", async () => {
    const s = await session();
    const plain = await s.run([lockRequest(["11"])]);
    expect(plain.name).toBe("gwl_lock_plain");
    for (const absent of [
      "is_next",
      "try_lock_first",
      "try_lock_all",
      "release_waiters",
      "prewake",
    ])
      expect(plain.text).not.toContain(absent);

    const line = await s.run([lockRequest(["12"], lineInfo)]);
    expect(line.name).toBe("gwl_lock_lines");
    expect(line.text).toContain("is_next");
    expect(line.text).not.toContain("try_lock_all");

    const slots = await s.run([lockRequest(["13", "14"])]);
    expect(slots.name).toBe("gwl_lock_slots");
    expect(slots.answer.slots.get(1)).toBe("13");

    const fast = await s.run([stackedRequest([["15"], ["16"]])]);
    expect(fast.name).toBe("gwl_lock_limits2");
    expect(fast.text).not.toContain("try_lock_all");
    expect(fast.answer.stacked.get(1)).toBe("15,16");

    // (a line, or a limit of several slots, goes through try_lock_all; so do the others of its batch)
    const full = await s.run([
      stackedRequest([["17"], ["18"]]),
      stackedRequest([["19", "20"], ["21"]]),
    ]);
    expect(full.name).toBe("gwl_lock_stacked");
    expect([full.answer.stacked.get(1), full.answer.stacked.get(2)]).toEqual(["17,18", "19,21"]);
    expect(await s.held()).toEqual(["11", "12", "13", "15", "16", "17", "18", "19", "21"]);
  });

  it("takes a job's limits of one key each all or none, and says which limit was full", async () => {
    const s = await session();
    const other = await h.connect();
    await other.query("select pg_advisory_lock(k) from unnest('{102,203,301}'::bigint[]) as k");
    const { name, answer } = await s.run([
      stackedRequest([["101"], ["102"]]), // the second full
      stackedRequest([["201"], ["202"], ["203"]]), // the third full
      stackedRequest([["301"], ["302"], ["303"]]), // the first full
      stackedRequest([["401"], ["402"]]), // free
      stackedRequest([["501"], ["502"], ["503"]]), // free
    ]);
    expect(name).toBe("gwl_lock_limits3");
    expect([...answer.stacked.entries()].sort((a, b) => a[0] - b[0])).toEqual([
      [1, "!2"],
      [2, "!3"],
      [3, "!1"],
      [4, "401,402"],
      [5, "501,502,503"],
    ]);
    // Nothing of a request that failed is left held.
    expect(await s.held()).toEqual(["401", "402", "501", "502", "503"]);
  });

  it("answers as try_lock_all does, over many random batches", async () => {
    const s = await session();
    const other = await h.connect();
    const reference = await h.connect();
    let seed = 12345;
    const random = (n: number) => {
      seed = (seed * 1103515245 + 12345) % 2147483648;
      return seed % n;
    };
    let failures = 0;
    for (let round = 0; round < 300; round++) {
      // Keys 1..12 of this round; another connection holds some of them.
      const key = (k: number) => String(1_000_000 + round * 100 + k);
      const heldElsewhere = Array.from({ length: 12 }, (_, k) => k).filter(() => random(3) === 0);
      await other.query("select pg_advisory_unlock_all()");
      await other.query("select count(pg_advisory_lock(k)) from unnest($1::bigint[]) as k", [
        heldElsewhere.map(key),
      ]);
      // Requests of 2 or 3 limits over distinct keys of the round (a session never asks a key twice).
      const free = Array.from({ length: 12 }, (_, k) => k);
      const requests: string[][][] = [];
      while (free.length >= 3 && requests.length < 4) {
        const count = 2 + random(2);
        requests.push(
          Array.from({ length: count }, () => [key(free.splice(random(free.length), 1)[0]!)]),
        );
      }
      // try_lock_all's answers first, from a third connection (released before the batch runs)
      const expected: string[] = [];
      for (const limits of requests) {
        const { rows } = await reference.query<{ r: string }>(
          "select graphile_worker_locks.try_lock_all($1, null) as r",
          [limits.map((l) => `${l[0]}:${l[0]}`).join(";")],
        );
        expected.push(rows[0]!.r);
        if (rows[0]!.r.startsWith("!")) failures++;
      }
      await reference.query("select pg_advisory_unlock_all()");
      const { answer } = await s.run(requests.map((limits) => stackedRequest(limits)));
      expected.forEach((r, i) =>
        expect(answer.stacked.get(i + 1), `round ${round}, request ${i + 1}`).toBe(r),
      );
      expect(await s.held()).toEqual(
        requests
          .filter((_, i) => !answer.stacked.get(i + 1)!.startsWith("!"))
          .flat(2)
          .sort(),
      );
      await s.client.query("select pg_advisory_unlock_all()");
    }
    // (both outcomes were exercised)
    expect(failures).toBeGreaterThan(50);
    expect(failures).toBeLessThan(1100);
  });
});
