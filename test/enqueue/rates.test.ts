/**
 * Rate-limited enqueues (`enqueueRate`) against real PostgreSQL: exactly `limit` admitted per window under
 * concurrent enqueuers on separate connections, the sliding window checked on the stamps the database
 * recorded, callers' transactions, bulk enqueues, what does not count, and validation before anything is
 * written.
 */
import { createHash } from "node:crypto";
import pg from "pg";
import { beforeAll, describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  enqueueRateKey,
  type AddJobResult,
  type LocksEvents,
} from "../../src/index.js";
import { enqueueRateKeyMaterial } from "../../src/enqueue/limits.js";
import { recordRateStamps } from "../support/rates.js";
import { useUniqueHarness } from "../support/unique.js";

const h = useUniqueHarness();
const { db, cleanups, client, jobCount } = h;

beforeAll(async () => {
  await h.locks.migrate();
  await recordRateStamps(db.pool());
});

/** The stamps recorded for `rateKey`, in microseconds since the epoch, in order. */
async function stampsOf(rateKey: string): Promise<number[]> {
  const { rows } = await db
    .pool()
    .query<{ us: string }>(
      "select (extract(epoch from stamp) * 1000000)::bigint::text as us from test_rate_stamps where rate_key = $1 order by stamp",
      [rateKey],
    );
  return rows.map((r) => Number(r.us));
}

/** `count` connections of their own, connected. */
async function clients(count: number): Promise<pg.Client[]> {
  return Promise.all(Array.from({ length: count }, () => client()));
}

const outcomes = (results: AddJobResult[]) => {
  const counts: Record<string, number> = {};
  for (const r of results) counts[r.outcome] = (counts[r.outcome] ?? 0) + 1;
  return counts;
};

describe("keys", () => {
  it("are pinned and versioned", () => {
    expect(enqueueRateKeyMaterial("sync", { account: 7 })).toBe(
      'gwl:v1:enqueue-rate:"sync":{"account":7}',
    );
    const hex = createHash("sha256")
      .update('gwl:v1:enqueue-rate:"sync":{"account":7}', "utf8")
      .digest("hex");
    expect(enqueueRateKey("sync", { account: 7 })).toBe(`gwl:r:${hex}`);
    expect(enqueueRateKey("sync", { account: 7 })).toBe(
      "gwl:r:a23f4b4b8e4f09af3d9f566604ade509e1b291ffd08bec5d44be993c98f96228",
    );
    expect(enqueueRateKey("sync", { a: 1, b: 2 })).toBe(enqueueRateKey("sync", { b: 2, a: 1 }));
    expect(() => enqueueRateKey("sync", { n: 1n })).toThrow(InvalidArgumentError);
  });
});

describe("admission", () => {
  it("admits exactly `limit` per window under 20 concurrent enqueuers on separate connections", async () => {
    // (50 of them: rates.long.test.ts)
    const connections = await clients(20);
    const rate = { limit: 7, period: 600_000 };
    const results = await Promise.all(
      connections.map((c, i) =>
        h.locks.addJob(
          "report",
          { account: 1, i },
          { enqueueRate: { ...rate, key: (p: { account: number }) => p.account }, pgClient: c },
        ),
      ),
    );
    expect(outcomes(results)).toEqual({ added: 7, rateLimited: 13 });
    expect(results.filter((r) => r.outcome === "rateLimited").every((r) => r.job === null)).toBe(
      true,
    );
    expect(await jobCount("task_identifier = 'report'")).toBe(7);
    expect(await stampsOf(enqueueRateKey("report", 1))).toHaveLength(7);
  });

  it("admits exactly `limit` per window under 10 concurrent bulk enqueuers", async () => {
    const connections = await clients(10);
    const enqueueRate = { limit: 8, period: 600_000, key: () => "bulk" };
    const results = await Promise.all(
      connections.map((c, i) =>
        h.locks.addJobs(
          [0, 1, 2].map((n) => ({ identifier: "bulk_report", payload: { i, n }, enqueueRate })),
          { pgClient: c },
        ),
      ),
    );
    expect(outcomes(results.flat())).toEqual({ added: 8, rateLimited: 22 });
    expect(await jobCount("task_identifier = 'bulk_report'")).toBe(8);
    // Within a batch, items are admitted in their order: a later item is never added while an earlier one
    // of the same key was refused.
    for (const batch of results) {
      const firstRefused = batch.findIndex((r) => r.outcome === "rateLimited");
      if (firstRefused >= 0) {
        expect(batch.slice(firstRefused).every((r) => r.outcome === "rateLimited")).toBe(true);
      }
    }
  });

  it("slides: at most `limit` stamps in any `period`, and a slot frees when the oldest stamp ages out", async () => {
    const period = 500;
    const limit = 3;
    const key = "sliding";
    const enqueueRate = { limit, period, key: () => key };
    const rateKey = enqueueRateKey("slide", key);
    const connections = await clients(4);
    const results: AddJobResult[] = [];
    let added = 0;
    // Four enqueuers hammer the key until three windows' worth were admitted.
    await Promise.all(
      connections.map(async (c, i) => {
        for (let n = 0; added < 3 * limit; n++) {
          const result = await h.locks.addJob("slide", { i, n }, { enqueueRate, pgClient: c });
          results.push(result);
          if (result.outcome === "added") added++;
        }
      }),
    );
    const stamps = await stampsOf(rateKey);
    expect(stamps.length).toBe(results.filter((r) => r.outcome === "added").length);
    expect(await jobCount("task_identifier = 'slide'")).toBe(stamps.length);
    expect(results.some((r) => r.outcome === "rateLimited")).toBe(true);
    // No window of `period` holds more than `limit` stamps: any limit + 1 consecutive ones span a period.
    for (let i = 0; i + limit < stamps.length; i++) {
      expect(stamps[i + limit]! - stamps[i]!, `stamps ${i}..${i + limit}`).toBeGreaterThanOrEqual(
        period * 1000,
      );
    }

    // A slot frees the moment the oldest of the last `limit` stamps is a period old (database clock).
    const c = connections[0]!;
    const last = await stampsOf(rateKey);
    const oldest = last[last.length - limit]!;
    await c.query(
      "select pg_sleep(greatest(0, ($1::float8 - extract(epoch from clock_timestamp()) * 1000000) / 1000000))",
      [oldest + period * 1000 + 1000],
    );
    expect((await h.locks.addJob("slide", { late: 2 }, { enqueueRate, pgClient: c })).outcome).toBe(
      "added",
    );
  });
});

describe("what counts", () => {
  it("nothing of a rolled-back caller transaction; a committed one's jobs", async () => {
    const c = await client();
    const enqueueRate = { limit: 2, period: 600_000, key: () => "tx" };
    await c.query("begin");
    expect((await h.locks.addJob("tx", { n: 1 }, { enqueueRate, pgClient: c })).outcome).toBe(
      "added",
    );
    expect((await h.locks.addJob("tx", { n: 2 }, { enqueueRate, pgClient: c })).outcome).toBe(
      "added",
    );
    expect((await h.locks.addJob("tx", { n: 3 }, { enqueueRate, pgClient: c })).outcome).toBe(
      "rateLimited",
    );
    await c.query("rollback");
    expect(await jobCount("task_identifier = 'tx'")).toBe(0);

    await c.query("begin");
    expect((await h.locks.addJob("tx", { n: 4 }, { enqueueRate, pgClient: c })).outcome).toBe(
      "added",
    );
    await c.query("commit");
    expect((await h.locks.addJob("tx", { n: 5 }, { enqueueRate })).outcome).toBe("added");
    expect((await h.locks.addJob("tx", { n: 6 }, { enqueueRate })).outcome).toBe("rateLimited");
    expect(await jobCount("task_identifier = 'tx'")).toBe(2);
  });

  it("a concurrent enqueue waits for an open transaction that holds the key's last slot", async () => {
    const [a, b] = await clients(2);
    const enqueueRate = { limit: 1, period: 600_000, key: () => "wait" };
    await a!.query("begin");
    expect((await h.locks.addJob("wait", { n: 1 }, { enqueueRate, pgClient: a })).outcome).toBe(
      "added",
    );
    const pending = h.locks.addJob("wait", { n: 2 }, { enqueueRate, pgClient: b });
    await h.blocked(h.pidOf(b!));
    await a!.query("rollback");
    // The slot the rolled-back transaction held is the waiting enqueue's.
    expect((await pending).outcome).toBe("added");
  });

  it("a repeatable-read caller whose snapshot predates a key's log gets a serialization failure", async () => {
    const [a, b] = await clients(2);
    const enqueueRate = { limit: 5, period: 600_000, key: () => "rr" };
    await a!.query("begin isolation level repeatable read");
    await a!.query("select 1");
    expect((await h.locks.addJob("rr", { n: 1 }, { enqueueRate, pgClient: b })).outcome).toBe(
      "added",
    );
    await expect(
      h.locks.addJob("rr", { n: 2 }, { enqueueRate, pgClient: a }),
    ).rejects.toMatchObject({
      code: "40001",
    });
    await a!.query("rollback");
    expect((await h.locks.addJob("rr", { n: 3 }, { enqueueRate, pgClient: a })).outcome).toBe(
      "added",
    );
  });

  it("not duplicates nor replacements of unique jobs; `uniqueFor` keeps its own behaviour", async () => {
    const task = h.locks.unique("digest", async () => undefined, {
      unique: "queued",
      enqueueRate: { limit: 2, period: 600_000, key: () => "all" },
    });
    expect((await task.addJob({ list: 1 })).outcome).toBe("added");
    expect((await task.addJob({ list: 1 })).outcome).toBe("duplicate");
    expect((await task.addJob({ list: 1 }, { onDuplicate: "replace" })).outcome).toBe("replaced");
    expect((await task.addJob({ list: 2 })).outcome).toBe("added");
    expect((await task.addJob({ list: 3 })).outcome).toBe("rateLimited");
    // A duplicate on a key the rate has not seen yet leaves no stamp either.
    const once = { enqueueRate: { limit: 1, period: 600_000, key: () => "once" } };
    expect((await h.locks.addJob("digest2", { list: 1 }, { unique: "queued" })).outcome).toBe(
      "added",
    );
    expect(
      (await h.locks.addJob("digest2", { list: 1 }, { unique: "queued", ...once })).outcome,
    ).toBe("duplicate");
    expect((await h.locks.addJob("digest2", { list: 2 }, once)).outcome).toBe("added");
    expect((await h.locks.addJob("digest2", { list: 3 }, once)).outcome).toBe("rateLimited");
    // The N = 1 case stays `uniqueFor`'s: a duplicate, answered with the window's job.
    const windowed = await h.locks.addJob("win", { a: 1 }, { uniqueFor: 600 });
    const again = await h.locks.addJob("win", { a: 1 }, { uniqueFor: 600 });
    expect([windowed.outcome, again.outcome]).toEqual(["added", "duplicate"]);
    expect(again.job?.id).toBe(windowed.job?.id);
  });

  it("not an enqueue the preemptive check dropped", async () => {
    const holder = await client();
    const guarded = h.locks.exclusive("guarded", async () => undefined, {
      enqueueRate: { limit: 1, period: 600_000, key: () => "g" },
    });
    const key = guarded.lockKey({ a: 1 });
    await holder.query("select pg_advisory_lock($1)", [key]);
    expect((await h.locks.addJob("guarded", { a: 1 })).outcome).toBe("dropped");
    await holder.query("select pg_advisory_unlock($1)", [key]);
    expect((await h.locks.addJob("guarded", { a: 1 })).outcome).toBe("added");
    expect((await h.locks.addJob("guarded", { a: 1 })).outcome).toBe("rateLimited");
  });
});

describe("keys, groups and overrides", () => {
  it("counts per key and per group, and a per-enqueue option replaces or bypasses the task's", async () => {
    const events: Array<LocksEvents["job:rateLimited"]> = [];
    const listener = (e: LocksEvents["job:rateLimited"]) => events.push(e);
    h.locks.events.on("job:rateLimited", listener);
    cleanups.push(async () => h.locks.events.off("job:rateLimited", listener));
    const enqueueRate = {
      limit: 1,
      period: 600_000,
      key: (p: { account: number; n: number }) => p.account,
      group: "accounts",
    };
    const a = h.locks.unique("sync_a", async () => undefined, { enqueueRate });
    const b = h.locks.unique("sync_b", async () => undefined, { enqueueRate });
    expect((await a.addJob({ account: 1, n: 1 })).outcome).toBe("added");
    expect((await a.addJob({ account: 2, n: 1 })).outcome).toBe("added");
    // (the group is shared: task b's enqueue of account 1 counts against the same key)
    expect((await b.addJob({ account: 1, n: 2 })).outcome).toBe("rateLimited");
    expect((await b.addJob({ account: 1, n: 3 }, { enqueueRate: false })).outcome).toBe("added");
    expect(
      (await b.addJob({ account: 1, n: 4 }, { enqueueRate: { limit: 2, period: 600_000 } }))
        .outcome,
    ).toBe("added");
    expect(events).toEqual([
      {
        taskIdentifier: "sync_b",
        rateKey: enqueueRateKey("accounts", 1),
        payload: { account: 1, n: 2 },
        spec: undefined,
      },
    ]);
  });

  it("a key's log met under another limit counts the same stamps", async () => {
    const under = (limit: number) => ({
      enqueueRate: { limit, period: 600_000, key: () => "changed" },
    });
    const outcomesUnder = async (limit: number, count: number) => {
      const out: string[] = [];
      for (let i = 0; i < count; i++) {
        out.push((await h.locks.addJob("changed", { limit, i }, under(limit))).outcome);
      }
      return out;
    };
    expect(await outcomesUnder(3, 4)).toEqual(["added", "added", "added", "rateLimited"]);
    expect(await outcomesUnder(2, 1)).toEqual(["rateLimited"]);
    expect(await outcomesUnder(5, 3)).toEqual(["added", "added", "rateLimited"]);
    expect(await outcomesUnder(3, 1)).toEqual(["rateLimited"]);
    expect(await jobCount("task_identifier = 'changed'")).toBe(5);
  });

  it("in a batch: items in input order, limited ones beside plain and unique ones", async () => {
    const enqueueRate = { limit: 2, period: 600_000, key: () => "mixed" };
    const results = await h.locks.addJobs([
      { identifier: "mixed", payload: { n: 0 }, enqueueRate },
      { identifier: "plain", payload: { n: 1 } },
      { identifier: "mixed", payload: { n: 2 }, enqueueRate },
      { identifier: "uniq", payload: { n: 3 }, unique: "queued" },
      { identifier: "mixed", payload: { n: 4 }, enqueueRate },
      { identifier: "uniq", payload: { n: 3 }, unique: "queued" },
    ]);
    expect(results.map((r) => r.outcome)).toEqual([
      "added",
      "added",
      "added",
      "added",
      "rateLimited",
      "duplicate",
    ]);
    expect(results.map((r) => (r.job?.payload as { n: number } | undefined)?.n)).toEqual([
      0,
      1,
      2,
      3,
      undefined,
      3,
    ]);
    expect(results[0]!.job!.task_identifier).toBe("mixed");
  });
});

describe("a batch's keys", () => {
  it("each key's room taken in the batch's order, on top of its log; a key that meets a unique item goes one by one", async () => {
    const rate = (key: string, limit = 5) => ({ limit, period: 600_000, key: () => key });
    // Three stamps already on key "full": room for two more.
    for (let i = 0; i < 3; i++) {
      expect(
        (await h.locks.addJob("keyed", { pre: i }, { enqueueRate: rate("full") })).outcome,
      ).toBe("added");
    }
    const batch = [
      ...[0, 1, 2, 3].map((n) => ({
        identifier: "keyed",
        payload: { k: "full", n },
        enqueueRate: rate("full"),
      })),
      ...[0, 1, 2].map((n) => ({
        identifier: "keyed",
        payload: { k: "fresh", n },
        queueName: "keyed-q",
        enqueueRate: rate("fresh", 2),
      })),
      // A key whose items include a unique one: all of its items are decided one by one.
      { identifier: "keyed", payload: { k: "mixed", n: 0 }, enqueueRate: rate("mixed", 2) },
      {
        identifier: "keyed",
        payload: { k: "mixed", n: 1 },
        enqueueRate: rate("mixed", 2),
        unique: "queued" as const,
      },
      { identifier: "keyed", payload: { k: "mixed", n: 2 }, enqueueRate: rate("mixed", 2) },
    ];
    const results = await h.locks.addJobs(batch);
    expect(results.map((r) => r.outcome)).toEqual([
      "added",
      "added",
      "rateLimited",
      "rateLimited",
      "added",
      "added",
      "rateLimited",
      "added",
      "added",
      "rateLimited",
    ]);
    results.forEach((r, i) => {
      expect(r.job?.payload ?? null, `item ${i}`).toEqual(
        r.outcome === "added" ? batch[i]!.payload : null,
      );
    });
    expect(await jobCount("task_identifier = 'keyed' and queue_name = 'keyed-q'")).toBe(2);
    // The jobs of a key decided together have ids in the batch's order.
    expect(Number(results[0]!.job!.id)).toBeLessThan(Number(results[1]!.job!.id));
    expect(Number(results[4]!.job!.id)).toBeLessThan(Number(results[5]!.job!.id));
    // Each log holds every admission as a stamp, and the next enqueue of a full key is refused.
    expect(await stampsOf(enqueueRateKey("keyed", "full"))).toHaveLength(5);
    expect(await stampsOf(enqueueRateKey("keyed", "fresh"))).toHaveLength(2);
    expect(await stampsOf(enqueueRateKey("keyed", "mixed"))).toHaveLength(2);
    for (const key of ["full", "fresh", "mixed"]) {
      const limit = key === "full" ? 5 : 2;
      expect(
        (await h.locks.addJob("keyed", { after: key }, { enqueueRate: rate(key, limit) })).outcome,
        key,
      ).toBe("rateLimited");
    }
    expect(await jobCount("task_identifier = 'keyed'")).toBe(3 + 2 + 2 + 2);
  });

  it("batches of shared and fresh keys in opposite orders from 8 connections never deadlock, and admit exactly `limit` per key, while the sweep runs", async () => {
    const connections = await clients(8);
    const limit = 3;
    const shared = ["s0", "s1", "s2", "s3", "s4", "s5"];
    const enqueueRate = (key: string, period = 600_000) => ({
      limit,
      period,
      key: () => key,
    });
    let sweeping = true;
    const sweeps = (async () => {
      while (sweeping) await h.locks.sweep();
    })();
    const results: Array<{ key: string; outcome: string }> = [];
    try {
      await Promise.all(
        connections.map(async (c, i) => {
          for (let round = 0; round < 15; round++) {
            // Shared keys forwards or backwards, fresh keys of the round between them, and keys whose
            // stamps leave the window within the run (their rows may be swept between two batches).
            const order = i % 2 === 0 ? shared : [...shared].reverse();
            const keys = [
              ...order.slice(0, 3),
              `fresh-${round}-${i % 4}`,
              ...order.slice(3),
              `short-${i % 3}`,
            ];
            const batch = keys.map((key, n) => ({
              identifier: "crossed",
              payload: { key, i, round, n },
              enqueueRate: enqueueRate(key, key.startsWith("short") ? 1 : 600_000),
            }));
            const out = await h.locks.addJobs(batch, { pgClient: c });
            out.forEach((r, n) => results.push({ key: keys[n]!, outcome: r.outcome }));
          }
        }),
      );
    } finally {
      sweeping = false;
      await sweeps;
    }
    const added = (key: string) =>
      results.filter((r) => r.key === key && r.outcome === "added").length;
    for (const key of shared) expect(added(key), key).toBe(limit);
    for (let round = 0; round < 15; round++) {
      for (let k = 0; k < 4; k++) expect(added(`fresh-${round}-${k}`)).toBe(2);
    }
    expect(await jobCount("task_identifier = 'crossed'")).toBe(
      results.filter((r) => r.outcome === "added").length,
    );
  });

  it("a key met under another limit in the same batch goes one by one, each item under its own limit", async () => {
    const rate = (limit: number) => ({ limit, period: 600_000, key: () => "two-limits" });
    const results = await h.locks.addJobs(
      [3, 3, 1, 3].map((limit, n) => ({
        identifier: "two_limits",
        payload: { n },
        enqueueRate: rate(limit),
      })),
    );
    // Item 2 under a limit of 1 meets two stamps; item 3 under 3 finds the third slot.
    expect(results.map((r) => r.outcome)).toEqual(["added", "added", "rateLimited", "added"]);
  });
});

describe("sweep", () => {
  it("removes a key's log once its newest stamp is a period old, not before", async () => {
    const enqueueRate = { limit: 2, period: 300, key: () => "swept" };
    const logOf = async () =>
      (
        await db
          .pool()
          .query("select 1 from graphile_worker_locks.enqueue_rates where rate_key = $1", [
            enqueueRateKey("swept", "swept"),
          ])
      ).rows.length;
    expect((await h.locks.addJob("swept", { n: 1 }, { enqueueRate })).outcome).toBe("added");
    await h.locks.sweep();
    expect(await logOf()).toBe(1);
    await db.pool().query("select pg_sleep(0.4)");
    await h.locks.sweep();
    expect(await logOf()).toBe(0);
  });
});

describe("validation", () => {
  it("refuses bad values naming the option, before anything is written", async () => {
    const bad: Array<[unknown, RegExp]> = [
      [{ limit: 0, period: 1000 }, /`enqueueRate.limit` must be a positive integer/],
      [{ limit: 1.5, period: 1000 }, /`enqueueRate.limit` must be a positive integer/],
      [{ limit: 1, period: -1 }, /`enqueueRate.period` must be a positive number of milliseconds/],
      [{ limit: 1 }, /`enqueueRate.period`/],
      [{ limit: 1, period: 10, burst: 2 }, /unknown option `enqueueRate.burst`/],
      [{ limit: 1, period: 10, key: "x" }, /`enqueueRate.key` must be a function/],
      [{ limit: 1, period: 10, group: "" }, /`enqueueRate.group` must be a non-empty string/],
      ["often", /`enqueueRate` must be an object or false/],
    ];
    for (const [enqueueRate, message] of bad) {
      await expect(h.locks.addJob("v", {}, { enqueueRate: enqueueRate as never })).rejects.toThrow(
        message,
      );
      expect(() =>
        h.locks.unique("v", async () => undefined, { enqueueRate: enqueueRate as never }),
      ).toThrow(message);
    }
    await expect(
      h.locks.addJob("v", {}, { enqueueRate: { limit: 1, period: 10 }, jobKey: "k" }),
    ).rejects.toThrow(/`jobKey`\/`jobKeyMode` cannot be combined with `enqueueRate`/);
    await expect(
      h.locks.addJob(
        "v",
        {},
        {
          enqueueRate: {
            limit: 1,
            period: 10,
            key: () => {
              throw new Error("no key");
            },
          },
        },
      ),
    ).rejects.toThrow(/`enqueueRate.key` of task 'v' threw: no key/);
    await expect(
      h.locks.addJobs([
        { identifier: "v", payload: {} },
        { identifier: "v", payload: {}, enqueueRate: { limit: 1, period: 0 } },
      ]),
    ).rejects.toThrow(/item 1: .*`enqueueRate.period`/);
    expect(await jobCount()).toBe(0);
    expect(await stampsOf(enqueueRateKey("v", {}))).toEqual([]);
  });
});
