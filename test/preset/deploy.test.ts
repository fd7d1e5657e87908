/**
 * A deploy: 10 worker processes started at once against a new database (or one with only graphile-worker
 * 0.17.3's schema, which they upgrade), through the `graphile-worker` CLI and through `run({ preset })`.
 * Each of them must start: graphile-worker's migrations and the preset's race each other across the
 * processes, and none may fail. `TEST_DEPLOY_ROUNDS` sets the number of rounds of each (default 3).
 */
import { Logger as Logger017, runMigrations as runMigrations017 } from "graphile-worker-0.17";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { buildPackage, type BuiltPackage } from "../support/build.js";
import { LAST_MIGRATION, requestedGraphileWorker } from "../support/graphile-worker.js";
import {
  GRAPHILE_WORKER_BIN,
  PRESET_WORKER_READY,
  startCliCommand,
  startPresetWorker,
  writeProject,
  type CliWorker,
  type Project,
} from "../support/presetProject.js";
import { MIGRATION_IDS, useScratchDatabases } from "../support/scratch.js";

const ROUNDS = Number(process.env.TEST_DEPLOY_ROUNDS ?? 3);
const PROCESSES = 10;
if (!Number.isInteger(ROUNDS) || ROUNDS < 1) {
  throw new TypeError(
    `TEST_DEPLOY_ROUNDS must be a positive integer, got "${process.env.TEST_DEPLOY_ROUNDS}"`,
  );
}

const scratch = useScratchDatabases();
let built: BuiltPackage;
let project: Project;
beforeAll(async () => {
  built = await buildPackage("deploy");
  project = await writeProject({
    entry: built.entry,
    worker: `concurrentJobs: 1,
    pollInterval: 1000,
    locks: {
      applicationName: "graphile-worker-locks/" + (process.env.WORKER_NAME ?? "cli"),
      tasks: { noop: { onConflict: "drop" } },
    },`,
    tasks: { "noop.js": "export default async () => {};\n" },
  });
}, 120_000);
afterAll(async () => {
  await project?.remove();
  await built?.remove();
});

/** Round `round`'s database: empty on even rounds, with graphile-worker 0.17.3's schema only on odd ones. */
async function databaseFor(round: number): Promise<string> {
  const url = await scratch.create();
  if (round % 2 === 1)
    await runMigrations017({ connectionString: url, logger: new Logger017(() => () => undefined) });
  return url;
}

/** Resolves when the worker has printed `marker`; rejects with its output when it exits first. */
function started(worker: CliWorker, marker: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const check = () => {
      if (!worker.output().includes(marker)) return;
      worker.child.stdout!.off("data", check);
      resolve();
    };
    worker.child.stdout!.on("data", check);
    void worker.exited.then((code) =>
      reject(new Error(`exited with ${String(code)} before starting:\n${worker.output()}`)),
    );
  });
}

/**
 * Rounds of PROCESSES workers started together, each round on a database of its own; every worker must
 * start, and then the database must have both schemas at their latest migration.
 */
async function deploy(
  start: (url: string, name: string) => CliWorker,
  marker: string,
  workerLevel: number,
): Promise<void> {
  const failures: string[] = [];
  for (let round = 0; round < ROUNDS; round++) {
    const url = await databaseFor(round);
    const workers = Array.from({ length: PROCESSES }, (_, i) => start(url, `r${round}-w${i}`));
    try {
      const outcomes = await Promise.allSettled(workers.map((w) => started(w, marker)));
      outcomes.forEach((outcome, i) => {
        if (outcome.status === "rejected") {
          failures.push(`round ${round}, worker ${i}: ${String(outcome.reason)}`);
        }
      });
    } finally {
      await Promise.all(workers.map((w) => w.stop()));
    }
    const pool = scratch.pool(url);
    const ours = await pool.query<{ id: number }>(
      "select id from graphile_worker_locks.migrations order by id",
    );
    expect(ours.rows.map((r) => r.id)).toEqual(MIGRATION_IDS);
    const theirs = await pool.query<{ level: number }>(
      "select max(id)::int as level from graphile_worker.migrations",
    );
    expect(theirs.rows[0]!.level).toBe(workerLevel);
  }
  console.log(`${ROUNDS} rounds x ${PROCESSES} processes: ${failures.length} failed to start`);
  expect(failures, failures.join("\n\n")).toEqual([]);
}

describe(`${PROCESSES} workers started together on a new or older database`, () => {
  it(
    `the graphile-worker CLI, ${ROUNDS} rounds: every process starts`,
    async () => {
      // (graphile-worker 0.18's CLI, whichever version the suite runs; with no loader, which this
      // JavaScript project does not need)
      await deploy(
        (url) =>
          startCliCommand(project, url, {
            cli: GRAPHILE_WORKER_BIN,
            config: project.configPath,
            nodeOptions: "",
          }),
        "looking for jobs",
        LAST_MIGRATION["0.18"],
      );
    },
    ROUNDS * 120_000,
  );

  it(
    `run({ preset }) in processes of their own, ${ROUNDS} rounds: every process starts`,
    async () => {
      await deploy(
        startPresetWorker,
        PRESET_WORKER_READY,
        LAST_MIGRATION[requestedGraphileWorker()],
      );
    },
    ROUNDS * 120_000,
  );
});
