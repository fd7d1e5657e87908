import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    globalSetup: ["test/globalSetup.ts"],
    include: ["test/**/*.test.ts"],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // Closing pools, stopping workers and PostgreSQL after the run.
    teardownTimeout: 30_000,
    // Tests spawn worker processes and hold database sessions: child processes, at most two at a time
    // (2-core machines).
    pool: "forks",
    poolOptions: { forks: { minForks: 1, maxForks: 2 } },
  },
});
