import { defineConfig } from "vitest/config";
import { graphileWorkerPackage, requestedGraphileWorker } from "./test/support/graphile-worker.js";

const graphileWorker = graphileWorkerPackage(requestedGraphileWorker());

export default defineConfig({
  // TEST_GRAPHILE_WORKER picks the graphile-worker every import of it gets (see test/support/graphile-worker.ts).
  resolve: {
    alias:
      graphileWorker === "graphile-worker"
        ? []
        : [{ find: /^graphile-worker$/, replacement: graphileWorker }],
  },
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
