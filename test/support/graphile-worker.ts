/**
 * Which graphile-worker the tests run against. `TEST_GRAPHILE_WORKER=0.17` selects 0.17.3 (the
 * devDependency alias `graphile-worker-0.17`); unset or `0.18`, the `graphile-worker` devDependency.
 *
 * The selection reaches every `import ... from "graphile-worker"`, the library's own included:
 * - in vitest (test files, src/, test/globalSetup.ts), through `resolve.alias` in vitest.config.ts;
 * - in the worker processes the tests fork, through the resolve hook of graphile-worker-hook.mjs, which
 *   test/support/processes.ts loads with `--import`.
 */
export const GRAPHILE_WORKER_VERSIONS = ["0.17", "0.18"] as const;
export type GraphileWorkerVersion = (typeof GRAPHILE_WORKER_VERSIONS)[number];

/** The version `TEST_GRAPHILE_WORKER` names; anything but a listed version is refused. */
export function requestedGraphileWorker(
  value = process.env.TEST_GRAPHILE_WORKER,
): GraphileWorkerVersion {
  if (value === undefined || value === "") return "0.18";
  if ((GRAPHILE_WORKER_VERSIONS as readonly string[]).includes(value)) {
    return value as GraphileWorkerVersion;
  }
  throw new TypeError(
    `TEST_GRAPHILE_WORKER must be one of ${GRAPHILE_WORKER_VERSIONS.join(", ")}, got "${value}"`,
  );
}

/** The npm package (installed name) of `version`. */
export function graphileWorkerPackage(version: GraphileWorkerVersion): string {
  return version === "0.17" ? "graphile-worker-0.17" : "graphile-worker";
}

/** The highest graphile_worker.migrations id each version's `runMigrations` leaves. */
export const LAST_MIGRATION: Record<GraphileWorkerVersion, number> = { "0.17": 19, "0.18": 20 };
