import { execFile } from "node:child_process";
import * as crypto from "node:crypto";
import { createHash } from "node:crypto";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { InvalidArgumentError, lockKey, makeLocks, uniqueJobKey } from "../src/index.js";
import { advisoryParts, jobLockKeys, lockKeyMaterial, slotKeys } from "../src/key.js";
import { resolveExclusiveOptions } from "../src/options.js";
import { ruledLockKeys } from "../src/preset/rules.js";

/** Keys of many payloads (non-ASCII ones among them): lock keys with a second slot, and unique job keys. */
const KEYS_SCRIPT = `
  const { slotKeys } = await import(process.env.GWL_KEY);
  const { uniqueJobKey } = await import(process.env.GWL_INDEX);
  const keys = [];
  for (let i = 0; i < 500; i++) {
    const payload = { i, s: ["plain", "é", "名前", "🙂", "\\u0000"][i % 5].repeat(i % 7) };
    keys.push(...slotKeys("x", payload, 2).map(String), uniqueJobKey("x", payload, null));
  }
  const crypto = await import("node:crypto");
  console.log(JSON.stringify({ oneShot: typeof crypto.hash, keys }));`;

describe("lockKey", () => {
  it("is pinned: a change of derivation must be deliberate (and bump KEY_VERSION)", () => {
    expect(lockKeyMaterial("charge_card", { userId: 1 })).toBe(
      'gwl:v1:lock:charge_card:{"userId":1}',
    );
    expect(lockKey("charge_card", { userId: 1 })).toBe(-2845878471433284211n);
    expect(lockKey("charge_card", { b: [1, "x", null], a: { z: true, y: 1.5 } })).toBe(
      5326669206727628750n,
    );
    expect(lockKey("t", {})).toBe(-6689673674604766519n);
    expect(lockKey("t", null)).toBe(-8116930185374386854n);
    expect(slotKeys("t", { a: 1 }, 3)).toEqual([
      -463490328411734452n,
      1635828814036869118n,
      -2364969172733044843n,
    ]);
  });

  it("is the first 8 bytes of SHA-256 of the material, as a signed 64-bit integer", () => {
    const material = lockKeyMaterial("x", { n: [1, 2] });
    const digest = createHash("sha256").update(material).digest();
    expect(lockKey("x", { n: [1, 2] })).toBe(digest.readBigInt64BE(0));
    // Over many payloads (non-ASCII ones among them), negative and positive keys alike, with slots.
    let negative = 0;
    for (let i = 0; i < 2_000; i++) {
      const payload = { i, s: ["plain", "é", "名前", "🙂", "\u0000"][i % 5]!.repeat(i % 7) };
      const keyMaterial = lockKeyMaterial("x", payload);
      const expected = createHash("sha256").update(keyMaterial, "utf8").digest().readBigInt64BE(0);
      expect(lockKey("x", payload)).toBe(expected);
      const slot = createHash("sha256").update(`${keyMaterial}#slot:1`).digest().readBigInt64BE(0);
      expect(slotKeys("x", payload, 2)).toEqual([expected, slot]);
      if (expected < 0n) negative++;
    }
    expect(negative).toBeGreaterThan(800);
    expect(negative).toBeLessThan(1_200);
  });

  it("ignores key order, distinguishes tasks and values", () => {
    expect(lockKey("t", { a: 1, b: { c: 2, d: 3 } })).toBe(
      lockKey("t", { b: { d: 3, c: 2 }, a: 1 }),
    );
    expect(lockKey("t", { a: 1 })).not.toBe(lockKey("u", { a: 1 }));
    expect(lockKey("t", { a: 1 })).not.toBe(lockKey("t", { a: "1" }));
    expect(lockKey("t", [1, 2])).not.toBe(lockKey("t", [2, 1]));
  });

  it("treats values that JSON cannot tell apart as the same key (1 and 1.0, -0 and 0, Date and its ISO string)", () => {
    expect(lockKey("t", { n: 1 })).toBe(lockKey("t", { n: 1.0 }));
    expect(lockKey("t", { n: -0 })).toBe(lockKey("t", { n: 0 }));
    const date = new Date("2026-01-02T03:04:05.678Z");
    expect(lockKey("t", { at: date })).toBe(lockKey("t", { at: "2026-01-02T03:04:05.678Z" }));
    expect(lockKey("t", { a: 1, gone: undefined })).toBe(lockKey("t", { a: 1 }));
  });

  it("slot 0 of a semaphore is the plain key; slots are distinct", () => {
    const slots = slotKeys("t", { a: 1 }, 5);
    expect(slots[0]).toBe(lockKey("t", { a: 1 }));
    expect(new Set(slots).size).toBe(5);
  });

  it("rejects what JSON cannot carry faithfully, naming the path, with a TypeError", () => {
    const cyclic: Record<string, unknown> = { a: 1 };
    cyclic.self = cyclic;
    const cases: Array<[unknown, RegExp]> = [
      [{ amount: 10n }, /payload\.amount is a BigInt/],
      [{ items: [{ f: () => 1 }] }, /payload\.items\[0\]\.f is a function/],
      [{ s: Symbol("x") }, /payload\.s is a symbol/],
      [cyclic, /payload\.self is a circular reference/],
      [{ n: Number.NaN }, /payload\.n is NaN/],
      [{ n: Number.POSITIVE_INFINITY }, /payload\.n is Infinity/],
      [{ list: [1, undefined] }, /payload\.list\[1\] is undefined/],
      [{ "odd key": 1n }, /payload\["odd key"\] is a BigInt/],
      [undefined, /payload is undefined/],
    ];
    for (const [value, message] of cases) {
      const attempt = () => lockKey("t", value);
      expect(attempt).toThrow(InvalidArgumentError);
      expect(attempt).toThrow(TypeError);
      expect(attempt).toThrow(message);
    }
  });

  it("allows a shared (non-cyclic) reference", () => {
    const shared = { x: 1 };
    expect(lockKey("t", { a: shared, b: shared })).toBe(lockKey("t", { a: { x: 1 }, b: { x: 1 } }));
  });

  it("rejects an empty task identifier", () => {
    expect(() => lockKey("", {})).toThrow(/`taskIdentifier` must be a non-empty string/);
  });

  it("maps to pg_locks coordinates (classid = high 32 bits, objid = low 32 bits, unsigned)", () => {
    expect(advisoryParts(1n)).toEqual({ classid: 0, objid: 1 });
    expect(advisoryParts(-1n)).toEqual({ classid: 0xffffffff, objid: 0xffffffff });
    expect(advisoryParts(-(2n ** 63n))).toEqual({ classid: 0x80000000, objid: 0 });
    expect(advisoryParts(0x1234567890abcdefn)).toEqual({ classid: 0x12345678, objid: 0x90abcdef });
  });
});

describe("lockKey without crypto.hash", () => {
  it("is the same where node:crypto has no one-shot hash (Node.js before 20.12)", async () => {
    // A process whose node:crypto lacks `hash` from the start, as older Node.js versions do, so that the
    // library takes its createHash path.
    const hide = `data:text/javascript,${encodeURIComponent(
      'import crypto from "node:crypto"; import { syncBuiltinESMExports } from "node:module";' +
        " delete crypto.hash; syncBuiltinESMExports();",
    )}`;
    const { stdout } = await promisify(execFile)(
      process.execPath,
      ["--import", hide, "--import", "tsx", "--input-type=module", "-e", KEYS_SCRIPT],
      {
        env: {
          ...process.env,
          GWL_INDEX: fileURLToPath(new URL("../src/index.ts", import.meta.url)),
          GWL_KEY: fileURLToPath(new URL("../src/key.ts", import.meta.url)),
        },
      },
    );
    const other = JSON.parse(stdout) as { oneShot: string; keys: string[] };
    expect(other.oneShot).toBe("undefined");
    const keys: string[] = [];
    for (let i = 0; i < 500; i++) {
      const payload = { i, s: ["plain", "é", "名前", "🙂", "\u0000"][i % 5]!.repeat(i % 7) };
      keys.push(...slotKeys("x", payload, 2).map(String), uniqueJobKey("x", payload, null));
    }
    expect(other.keys).toHaveLength(1_500);
    expect(other.keys).toEqual(keys);
    // This process takes the one-shot path on Node.js 20.12 and later (CI runs 20 and 24), so both paths ran.
    const [major, minor] = process.versions.node.split(".").map(Number) as [number, number];
    if (major > 20 || minor >= 12)
      expect(typeof (crypto as { hash?: unknown }).hash).toBe("function");
  });
});

describe("lockKey properties", () => {
  it("is stable under a JSON round trip (what the worker receives)", () => {
    fc.assert(
      fc.property(fc.jsonValue(), (value) => {
        expect(lockKey("t", JSON.parse(JSON.stringify(value)))).toBe(lockKey("t", value));
      }),
      { numRuns: 500 },
    );
  });

  it("does not depend on the order of object keys", () => {
    const shuffle = (value: unknown, seed: number): unknown => {
      if (Array.isArray(value)) return value.map((v, i) => shuffle(v, seed + i));
      if (value && typeof value === "object") {
        const entries = Object.entries(value);
        entries.sort(
          (a, b) =>
            ((a[0].length * 31 + seed) % 7) - ((b[0].length * 31 + seed) % 7) ||
            (seed % 2 ? 1 : -1),
        );
        return Object.fromEntries(entries.reverse().map(([k, v]) => [k, shuffle(v, seed + 1)]));
      }
      return value;
    };
    fc.assert(
      fc.property(fc.jsonValue(), fc.integer({ min: 0, max: 1000 }), (value, seed) => {
        expect(lockKey("t", shuffle(value, seed))).toBe(lockKey("t", value));
      }),
      { numRuns: 300 },
    );
  });

  it("differs for different canonical values (no collision in a sample)", () => {
    fc.assert(
      fc.property(
        fc.uniqueArray(fc.jsonValue(), {
          minLength: 2,
          maxLength: 50,
          selector: (v) => lockKeyMaterial("t", v),
        }),
        (values) => {
          const keys = new Set(values.map((v) => lockKey("t", v)));
          expect(keys.size).toBe(values.length);
        },
      ),
      { numRuns: 100 },
    );
  });
});

describe("jobLockKeys: one derivation for the wrapper, the enqueuer and the CLI", () => {
  const payload = { userId: 7, note: "é" };

  it("is the payload's key, or the key of what `key` returns, with the task's slots", () => {
    expect(jobLockKeys("t", resolveExclusiveOptions({ limit: 3 }, undefined), payload)).toEqual(
      slotKeys("t", payload, 3),
    );
    const byUser = resolveExclusiveOptions({ key: (p: typeof payload) => p.userId }, undefined);
    expect(jobLockKeys("t", byUser as never, payload)).toEqual([lockKey("t", 7)]);
    // A job's payload read back from PostgreSQL derives the same keys as the caller's.
    expect(jobLockKeys("t", byUser as never, payload, "42", true)).toEqual([lockKey("t", 7)]);
  });

  it("gives the CLI the keys the wrapped task takes", () => {
    const task = makeLocks({ connectionString: "postgres://unused" });
    try {
      const rules = { key: (p: { userId: number }) => ({ user: p.userId }), limit: 2 };
      const wrapped = task.exclusive("t", () => undefined, rules);
      const cli = ruledLockKeys("t", rules as never, payload, undefined);
      expect(cli).toEqual(
        jobLockKeys("t", resolveExclusiveOptions(rules, undefined) as never, payload),
      );
      expect(cli![0]).toBe(wrapped.lockKey(payload));
    } finally {
      void task.release();
    }
  });

  it("names the task (and the job) when `key` fails, in the CLI too", () => {
    const throwing = resolveExclusiveOptions(
      {
        key: () => {
          throw new Error("no user");
        },
      },
      undefined,
    );
    expect(() => jobLockKeys("t", throwing as never, payload, "42", true)).toThrow(
      "job 42: `key` of task 't' threw: no user",
    );
    const rules = {
      key: () => {
        throw new Error("no user");
      },
    };
    let error: unknown;
    try {
      ruledLockKeys("t", rules as never, payload, undefined);
    } catch (caught) {
      error = caught;
    }
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect((error as Error).message).toBe("`key` of task 't' threw: no user");
  });

  it("checks a caller's payload, and trusts one read back from PostgreSQL", () => {
    const rules = resolveExclusiveOptions(undefined, undefined);
    const bad = { n: 1n };
    expect(() => jobLockKeys("t", rules as never, bad)).toThrow(InvalidArgumentError);
    expect(() => jobLockKeys("t", rules as never, bad)).toThrow("payload.n is a BigInt");
    expect(() => jobLockKeys("t", rules as never, payload, "42", true)).not.toThrow();
  });
});
