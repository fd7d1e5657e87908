import { configDefaults, defineConfig } from "vitest/config";
import { graphileWorkerPackage, requestedGraphileWorker } from "./test/support/graphile-worker.js";

const graphileWorker = graphileWorkerPackage(requestedGraphileWorker());

/**
 * Checks too long for the default run (under 5 minutes): the deploy check and every `*.long.test.ts` file.
 * CI runs them in a step of their own with TEST_LONG=1 (see CONTRIBUTING.md).
 */
const LONG_TESTS = ["test/preset/deploy.test.ts", "test/**/*.long.test.ts"];
const long = !["", "0", "false"].includes(process.env.TEST_LONG ?? "");

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
    exclude: long ? configDefaults.exclude : [...configDefaults.exclude, ...LONG_TESTS],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // Closing pools, stopping workers and PostgreSQL after the run.
    teardownTimeout: 30_000,
    // Tests spawn worker processes and hold database sessions: child processes, one file at a time. On a
    // 2-core machine two files side by side starve each other's processes, and the hand-off and lock-ahead
    // tests wait on real timings.
    pool: "forks",
    fileParallelism: false,
  },
});
