import { describe, expect, it } from "vitest";
import { maxConcurrencyPerKey, type Execution } from "./executions.js";

const ex = (lockKey: string, start: number, end: number): Execution => ({
  jobId: `${lockKey}${start}`,
  lockKey,
  worker: "w",
  attempts: 1,
  start: BigInt(start),
  end: BigInt(end),
});

describe("maxConcurrencyPerKey (the overlap checker itself)", () => {
  it("detects an overlap, and only per key", () => {
    const result = maxConcurrencyPerKey([
      ex("a", 0, 10),
      ex("a", 5, 15),
      ex("b", 0, 100),
      ex("a", 20, 30),
    ]);
    expect(result.get("a")).toBe(2);
    expect(result.get("b")).toBe(1);
  });
  it("counts back-to-back executions (end = next start) as not overlapping", () => {
    expect(maxConcurrencyPerKey([ex("a", 0, 10), ex("a", 10, 20)]).get("a")).toBe(1);
  });
  it("refuses an execution that never ended", () => {
    expect(() => maxConcurrencyPerKey([{ ...ex("a", 0, 1), end: null }])).toThrow(/has no end/);
  });
});
