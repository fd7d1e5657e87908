/**
 * Unique jobs' bounded state, with a real PostgreSQL: 100,000 distinct keys churned through leave no row
 * behind. Long (about 15 s): it runs with TEST_LONG=1, in CI's long checks.
 */
import { expect, it, describe } from "vitest";
import { makeLocks } from "../../../src/index.js";
import { useUniqueHarness } from "../../support/unique.js";
import { quietLogger } from "../../support/runner.js";

const h = useUniqueHarness();
const { db, cleanups, jobCount } = h;

describe("bounded state", () => {
  it("100,000 distinct keys churned through leave nothing behind", async () => {
    // An instance of its own: enqueues of windows also sweep in the background, at most once a minute from
    // the instance's start, and one here at the end would race the sweep this test makes.
    const locks = makeLocks({ connectionString: db.url, logger: quietLogger });
    cleanups.push(() => locks.release());
    const windowRows = async () =>
      (
        await db
          .pool()
          .query<{ n: number }>(
            "select count(*)::int as n from graphile_worker_locks.unique_windows",
          )
      ).rows[0]!.n;
    const batch = (from: number, extra: object) =>
      Array.from({ length: 10_000 }, (_, i) => ({
        identifier: "churn",
        payload: { i: from + i },
        ...extra,
      }));
    const past = new Date(Date.now() - 60_000);
    for (let from = 0; from < 100_000; from += 20_000) {
      // Half scoped (state lives on the job row), half windows alone (a row each until it expires).
      const scoped = await locks.addJobs(batch(from, { unique: "active" }));
      const windows = await locks.addJobs(batch(from + 10_000, { uniqueFor: 1, runAt: past }));
      expect([...scoped, ...windows].every((r) => r.outcome === "added")).toBe(true);
      const ids = [...scoped, ...windows].map((r) => r.job!.id);
      await h.utils.completeJobs(ids);
    }
    expect(await jobCount()).toBe(0);
    // Every window is expired: the sweep removes each one left (all 50,000 unless a background sweep, on a
    // slow run, took some first), and nothing remains.
    const left = await windowRows();
    expect(left).toBeGreaterThan(0);
    expect(await locks.sweep()).toBe(left);
    expect(await windowRows()).toBe(0);
  });
});
