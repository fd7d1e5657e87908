/**
 * `LocksPreset` for real: the `graphile-worker` CLI in separate processes with a `graphile.config.mjs`, a
 * `tasks/` folder (TypeScript and JavaScript) and a crontab; the README's commands that start the CLI with
 * a TypeScript config, as written; and `run({ preset })` in this process.
 */
import { execFile } from "node:child_process";
import { readFile, writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { resolvePreset } from "graphile-config";
import { register } from "tsx/esm/api";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { buildPackage, type BuiltPackage } from "../support/build.js";
import { run, runMigrations, WorkerPreset, makeWorkerUtils, type Task } from "graphile-worker";
import {
  LocksPreset,
  lockKey,
  makeLocksFromPreset,
  InvalidArgumentError,
  TESTED_WORKER_SCHEMAS,
  UntestedWorkerSchemaError,
  type LocksOptions,
} from "../../src/index.js";
import { useTestDatabase } from "../support/db.js";
import { quietLogger } from "../support/runner.js";
import { useScratchDatabases } from "../support/scratch.js";
import { maxConcurrencyPerKey, readExecutions } from "../support/executions.js";
import { graphileWorkerPackage, requestedGraphileWorker } from "../support/graphile-worker.js";
import {
  recordingTask,
  startCliCommand,
  startCliWorker,
  writeProject,
  writeTypeScriptProject,
  type Project,
} from "../support/presetProject.js";

const db = useTestDatabase();
const scratch = useScratchDatabases();
const projects: Project[] = [];
let built: BuiltPackage;
beforeAll(async () => {
  built = await buildPackage("preset");
}, 120_000);
afterAll(async () => {
  await Promise.all(projects.map((p) => p.remove()));
  await built?.remove();
});
/** Removes what a test left behind (jobs and records), whether it passed or not. */
async function cleanUp() {
  await db.pool().query("delete from graphile_worker._private_jobs");
  await db.pool().query("delete from test_executions");
}

async function waitFor(what: string, check: () => Promise<boolean>, timeoutMs = 90_000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

const jobsLeft = async (task: string) =>
  Number(
    (
      await db
        .pool()
        .query<{ n: string }>(
          "select count(*) as n from graphile_worker.jobs where task_identifier = $1",
          [task],
        )
    ).rows[0]!.n,
  );

/** Each key's executions never overlap, and each `n` in `expected` ran exactly once. */
async function expectExclusiveAndComplete(task: string, expected: number[]) {
  const executions = await readExecutions(db.pool(), task);
  for (const [key, highest] of maxConcurrencyPerKey(executions)) {
    expect(highest, `executions of ${task} key ${key} overlapped`).toBe(1);
  }
  const { rows } = await db
    .pool()
    .query<{ note: string }>("select note from test_executions where task = $1", [task]);
  expect(rows.map((r) => Number(r.note)).sort((a, b) => a - b)).toEqual(expected);
}

const CHARGE_CARD_TS = `import type { Task } from "graphile-worker";
const task: Task = async (payload: any, helpers) => {${recordingTask("charge_card", "p.userId")}};
export default task;
`;
// Rules beside the function, in the task file.
const REPORT_JS = `export const locks = {
  onConflict: "reschedule",
  key: (p) => ({ r: p.r }),
  reschedule: { minDelay: 20, maxDelay: 200 },
};
export default async (payload, helpers) => {${recordingTask("report", "p.r")}};
`;
const WORKER = `concurrentJobs: 4,
    pollInterval: 200,
    locks: {
      applicationName: "graphile-worker-locks/preset-" + (process.env.WORKER_NAME ?? "in-process"),
      tasks: {
        charge_card: {
          onConflict: "reschedule",
          key: (p) => ({ userId: p.userId }),
          reschedule: { minDelay: 20, maxDelay: 200 },
        },
      },
    },`;

const range = (n: number) => Array.from({ length: n }, (_, i) => i);

/** A project with the `charge_card` (TypeScript) and `report` tasks under WORKER's preset, and that preset. */
async function chargeCardProject() {
  const project = await writeProject({
    entry: built.entry,
    worker: WORKER,
    tasks: { "charge_card.ts": CHARGE_CARD_TS, "report.js": REPORT_JS },
  });
  projects.push(project);
  const { default: preset } = (await import(project.configPath)) as {
    default: GraphileConfig.Preset;
  };
  return { project, preset };
}

describe("LocksPreset through the graphile-worker CLI", () => {
  it("2 processes x concurrency 4: no overlap per key, every job run once (rules from the preset and from a task file)", async () => {
    const { project, preset } = await chargeCardProject();

    // Enqueue-only side: the same preset gives `locks.addJob` the task's rules.
    const utils = await makeWorkerUtils({ connectionString: db.url });
    const locks = makeLocksFromPreset(preset, { connectionString: db.url });
    try {
      for (const n of range(40)) {
        const { outcome, job } = await locks.addJob("charge_card", { userId: n % 4, n, ms: 15 });
        expect(outcome).toBe("added");
        // A reschedule task's job carries its key's flag: the preset's rules reached the enqueue.
        expect(Object.keys(job!.flags ?? {})[0]).toMatch(/^gwl:lock:/);
        await utils.addJob("report", { r: n % 3, n, ms: 15 });
      }
    } finally {
      await locks.release();
      await utils.release();
    }

    const workers = [
      startCliWorker(project, db.url, "cli-a"),
      startCliWorker(project, db.url, "cli-b"),
    ];
    try {
      await waitFor(
        "the jobs to drain",
        async () => (await jobsLeft("charge_card")) + (await jobsLeft("report")) === 0,
      );
      await expectExclusiveAndComplete("charge_card", range(40));
      await expectExclusiveAndComplete("report", range(40));
      // Both processes took part.
      const { rows } = await db
        .pool()
        .query<{ worker: string }>("select distinct worker from test_executions order by worker");
      expect(rows.map((r) => r.worker)).toEqual(["cli-a", "cli-b"]);
    } finally {
      const codes = await Promise.all(workers.map((w) => w.stop()));
      const outputs = workers.map((w) => w.output()).join("\n");
      await cleanUp();
      for (const code of codes) expect([0, "SIGINT"], outputs).toContain(code);
    }
  }, 180_000);

  it("a crontab entry of an exclusive task never overlaps itself: backfilled runs that meet the held key are dropped", async () => {
    const project = await writeProject({
      entry: built.entry,
      worker: `concurrentJobs: 4,
    pollInterval: 200,
    locks: { tasks: { nightly: { onConflict: "drop" } } },`,
      tasks: {
        "nightly.js": `export default async (payload, helpers) => {${recordingTask("nightly", '"nightly"')}};`,
      },
      // Every minute, backfilling the last 10 minutes' runs at start-up.
      crontab: `* * * * * nightly ?fill=10m {ms: 1500}\n`,
    });
    projects.push(project);
    const pool = db.pool();
    // Every job graphile-worker's cron adds for `nightly`, counted as it is inserted.
    await pool.query(`
      create or replace function public.test_count_cron() returns trigger language plpgsql as $$
      begin
        if (select identifier from graphile_worker._private_tasks where id = new.task_id) = 'nightly' then
          insert into public.test_events (job_id, kind, detail) values (new.id, 'cron:added', new.payload);
        end if;
        return new;
      end $$;
      create trigger test_count_cron after insert on graphile_worker._private_jobs
        for each row execute function public.test_count_cron();`);
    // The crontab has been known for 10 minutes, so its missed runs are backfilled at once on start.
    await pool.query(
      "insert into graphile_worker._private_known_crontabs (identifier, known_since) values ('nightly', now() - interval '10 minutes')",
    );

    const workers = [
      startCliWorker(project, db.url, "cron-a"),
      startCliWorker(project, db.url, "cron-b"),
    ];
    try {
      await waitFor(
        "the backfilled runs",
        async () =>
          Number(
            (
              await pool.query<{ n: string }>(
                "select count(*) as n from test_events where kind = 'cron:added'",
              )
            ).rows[0]!.n,
          ) >= 9,
      );
      await waitFor("the cron jobs to drain", async () => (await jobsLeft("nightly")) === 0);
      const added = Number(
        (
          await pool.query<{ n: string }>(
            "select count(*) as n from test_events where kind = 'cron:added'",
          )
        ).rows[0]!.n,
      );
      const executions = await readExecutions(pool, "nightly");
      expect(executions.length).toBeGreaterThanOrEqual(1);
      // At most one run at a time, and the runs that met the held key were dropped, not run.
      expect(maxConcurrencyPerKey(executions).get("nightly")).toBe(1);
      expect(executions.length).toBeLessThan(added);
    } finally {
      const codes = await Promise.all(workers.map((w) => w.stop()));
      for (const code of codes) {
        expect([0, "SIGINT"], workers.map((w) => w.output()).join("\n")).toContain(code);
      }
      await pool.query("drop trigger if exists test_count_cron on graphile_worker._private_jobs");
      await cleanUp();
    }
  }, 180_000);
});

/** The README's commands that start the CLI with a TypeScript config, with the Node version each names. */
const configCommands = [
  ...(await readFile(new URL("../../README.md", import.meta.url), "utf8")).matchAll(
    /^(?:NODE_OPTIONS="([^"]*)" )?npx graphile-worker -C (graphile\.config\.\w+) +# Node (\d+)(?:\.(\d+))? and later$/gm,
  ),
].map((m) => ({
  line: m[0].replace(/ +#/, " #"),
  nodeOptions: m[1] ?? "",
  config: m[2]!,
  since: [Number(m[3]), Number(m[4] ?? 0)] as const,
}));
const [nodeMajor = 0, nodeMinor = 0] = process.versions.node.split(".").map(Number);
const runsOnThisNode = ([major, minor]: readonly [number, number]) =>
  nodeMajor > major || (nodeMajor === major && nodeMinor >= minor);

describe(`The README's TypeScript-config commands, as written, on this Node (${process.version})`, () => {
  const graphileWorkerDir = fileURLToPath(
    new URL(
      `../../node_modules/${graphileWorkerPackage(requestedGraphileWorker())}/`,
      import.meta.url,
    ),
  );
  let project: Project;
  beforeAll(async () => {
    project = await writeTypeScriptProject({
      packageDir: built.dir,
      graphileWorkerDir,
      worker: `pollInterval: 200,
    locks: { tasks: { ts_hello: { onConflict: "drop", key: (p: { n: number }) => ({ n: p.n }) } } },`,
      tasks: {
        "ts_hello.ts": `import type { Task } from "graphile-worker";
const task: Task = async (payload: any, helpers) => {${recordingTask("ts_hello", "p.n")}};
export default task;
`,
      },
    });
    projects.push(project);
  });

  it("the README gives a command for Node 20, the oldest Node this library supports", () => {
    expect(configCommands.filter((c) => c.since[0] <= 20)).not.toEqual([]);
  });

  it.runIf(!runsOnThisNode([22, 18]))(
    "a graphile.config.ts does not start here, as the README says, even through tsx's ESM loader",
    async () => {
      const worker = startCliCommand(project, db.url, {
        cli: `${graphileWorkerDir}dist/cli.js`,
        config: "graphile.config.ts",
        nodeOptions: "--import tsx/esm",
      });
      expect(await worker.exited).toBe(1);
      expect(worker.output()).toMatch(/SyntaxError/);
    },
    120_000,
  );

  configCommands.forEach((command, index) => {
    it.runIf(runsOnThisNode(command.since))(
      `${command.line}: starts, loads the TypeScript task and runs its job`,
      async () => {
        const worker = startCliCommand(project, db.url, {
          cli: `${graphileWorkerDir}dist/cli.js`,
          config: command.config,
          nodeOptions: command.nodeOptions,
        });
        try {
          await waitFor("the worker to start", async () => {
            if (worker.child.exitCode !== null) {
              throw new Error(`exited with ${worker.child.exitCode}:\n${worker.output()}`);
            }
            return /looking for jobs.*ts_hello/.test(worker.output());
          });
          await db
            .pool()
            .query("select graphile_worker.add_job('ts_hello', json_build_object('n', $1::int))", [
              index,
            ]);
          await waitFor("the job to run", async () => (await jobsLeft("ts_hello")) === 0);
          const executions = await readExecutions(db.pool(), "ts_hello");
          expect(executions.map((e) => e.lockKey)).toEqual([String(index)]);
        } finally {
          await worker.stop();
          await cleanUp();
        }
        expect([0, "SIGINT"], worker.output()).toContain(await worker.exited);
      },
      120_000,
    );
  });
});

describe("LocksPreset through run({ preset }) in this process", () => {
  it("two runners share one lock session; no overlap per key; every job run once", async () => {
    const { preset } = await chargeCardProject();
    // This process loads the TypeScript task file as the CLI does under `--import tsx`.
    const unregister = register();
    const locks = makeLocksFromPreset(preset, { connectionString: db.url });
    try {
      for (const n of range(24)) {
        await locks.addJob("charge_card", { userId: n % 3, n, ms: 15 });
        await locks.addJob("report", { r: n % 2, n, ms: 15 });
      }
    } finally {
      await locks.release();
    }
    const withUrl: GraphileConfig.Preset = {
      extends: [preset],
      worker: { connectionString: db.url },
    };
    const runners = [await run({ preset: withUrl }), await run({ preset: withUrl })];
    try {
      await waitFor(
        "the jobs to drain",
        async () => (await jobsLeft("charge_card")) + (await jobsLeft("report")) === 0,
      );
      const { rows } = await db
        .pool()
        .query<{ n: string }>(
          "select count(*) as n from pg_stat_activity where application_name = 'graphile-worker-locks/preset-in-process'",
        );
      expect(Number(rows[0]!.n)).toBe(1);
      await expectExclusiveAndComplete("charge_card", range(24));
      await expectExclusiveAndComplete("report", range(24));
    } finally {
      await Promise.all(runners.map((r) => r.stop()));
      await unregister();
      await cleanUp();
    }
  }, 120_000);
});

describe("LocksPreset configuration errors", () => {
  it("a wrong option is a typed error at start-up naming the task and the option", async () => {
    const preset: GraphileConfig.Preset = {
      extends: [WorkerPreset, LocksPreset],
      worker: {
        connectionString: db.url,
        taskList: {},
        locks: { tasks: { charge_card: { onConflict: "later" as never } } },
      } as GraphileConfig.WorkerOptions,
    };
    const error = await run({ preset, taskList: {} }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect(String((error as Error).message)).toMatch(/charge_card/);
    expect(String((error as Error).message)).toMatch(/onConflict/);
    expect(() =>
      makeLocksFromPreset({
        worker: { connectionString: db.url, locks: { tasks: { x: { limt: 2 } as never } } },
      }),
    ).toThrow(/task 'x'.*unknown option `limt`/);
  });
});

describe("LocksPreset options", () => {
  it("takes every option of makeLocks under `worker.locks` (but those graphile-worker supplies), at start-up and in makeLocksFromPreset", async () => {
    // Every option, so that one added to makeLocks fails to compile here until it is listed.
    const every: Required<Omit<LocksOptions, "pgPool" | "workerSchema" | "logger">> = {
      connectionString: db.url,
      lockConnectionString: db.url,
      schema: "gwl_every_option",
      allowUntestedWorkerSchema: false,
      applicationName: "graphile-worker-locks/every-option",
      heartbeatInterval: 5000,
      heartbeatTimeout: 20_000,
      lockSessionWait: 5000,
      partitionTimeout: 60_000,
      reconnectDelay: { min: 100, max: 5000 },
      defaults: { onConflict: "drop" },
      preparedStatements: true,
    };
    const preset: GraphileConfig.Preset = {
      extends: [WorkerPreset, LocksPreset],
      worker: {
        connectionString: db.url,
        logger: quietLogger,
        pollInterval: 100,
        locks: { ...every, tasks: { every_option: {} } },
      },
    };
    const locks = makeLocksFromPreset(preset);
    try {
      expect((await locks.addJob("every_option", { n: 1 })).outcome).toBe("added");
    } finally {
      await locks.release();
    }
    // The application name of the session holding the job's key, as the job saw it.
    let seen: string | null = null;
    const task: Task = async (_payload, helpers) => {
      const { rows } = await helpers.query<{ application_name: string }>(
        `select a.application_name from gwl_every_option.held_locks h
         join pg_stat_activity a on a.pid = h.pid where h.lock_key = $1`,
        [String(lockKey("every_option", { n: 1 }))],
      );
      seen = rows[0]?.application_name ?? "(no lock held)";
    };
    const runner = await run({ preset, taskList: { every_option: task }, noHandleSignals: true });
    try {
      await waitFor("the job", async () => (await jobsLeft("every_option")) === 0);
    } finally {
      await runner.stop();
    }
    expect(seen).toBe(every.applicationName);
  }, 60_000);

  it("graphile-worker's migrations give `allowUntestedWorkerSchema` to the library's", async () => {
    const url = await scratch.create();
    await runMigrations({ connectionString: url, logger: quietLogger });
    const pool = scratch.pool(url);
    // A level beyond every tested one (graphile-worker itself goes ahead, with a warning).
    await pool.query("insert into graphile_worker.migrations (id) values ($1)", [
      Math.max(...TESTED_WORKER_SCHEMAS.map((t) => t.level)) + 1,
    ]);
    const migrateWith = (locks: GraphileConfig.WorkerOptions["locks"]) =>
      runMigrations({
        preset: {
          extends: [WorkerPreset, LocksPreset],
          worker: { connectionString: url, logger: quietLogger, locks },
        },
      });
    const installed = async () =>
      (
        await pool.query<{ ok: boolean }>(
          "select to_regclass('graphile_worker_locks.migrations') is not null as ok",
        )
      ).rows[0]!.ok;

    await expect(migrateWith({})).rejects.toBeInstanceOf(UntestedWorkerSchemaError);
    expect(await installed()).toBe(false);
    await migrateWith({ allowUntestedWorkerSchema: true });
    expect(await installed()).toBe(true);
  });

  it("a preset extending a preset: the workers, makeLocksFromPreset and the CLI apply the same rules, graphile-config's", async () => {
    const project = await writeProject({ entry: built.entry, worker: "", tasks: {} });
    projects.push(project);
    // `leaf` extends `base`, each with rules for one task under `worker.locks.tasks`.
    const configPath = `${project.dir}extending.config.mjs`;
    await writeFile(
      configPath,
      `import { WorkerPreset } from "graphile-worker";
import { LocksPreset } from ${JSON.stringify(built.entry)};

const rules = { onConflict: "reschedule", key: (p) => ({ id: p.id }) };
const base = {
  extends: [WorkerPreset, LocksPreset],
  worker: {
    connectionString: ${JSON.stringify(db.url)},
    taskDirectory: ${JSON.stringify(`${project.dir}tasks`)},
    locks: { tasks: { from_base: rules } },
  },
};
export default { extends: [base], worker: { pollInterval: 100, locks: { tasks: { from_leaf: rules } } } };
`,
    );
    const { default: preset } = (await import(configPath)) as { default: GraphileConfig.Preset };
    const tasks = ["from_base", "from_leaf"] as const;
    const payload = { id: 1, n: 7 };
    // Whether a view of the preset gives the task rules: the job's key is then that of `{ id }`.
    const ruledKey = (task: string) => lockKey(task, { id: payload.id });

    // graphile-config: the leaf's `worker.locks` replaces the base's.
    const resolved = resolvePreset(preset).worker?.locks?.tasks ?? {};
    const expected = Object.fromEntries(tasks.map((t) => [t, t in resolved]));
    expect(expected).toEqual({ from_base: false, from_leaf: true });

    // makeLocksFromPreset: a `reschedule` job carries its key's flag.
    const enqueue: Record<string, boolean> = {};
    const locks = makeLocksFromPreset(preset, { connectionString: db.url });
    try {
      for (const task of tasks) {
        const { job } = await locks.addJob(task, payload);
        enqueue[task] = Object.keys(job!.flags ?? {}).some((flag) =>
          flag.includes(String(ruledKey(task))),
        );
      }
    } finally {
      await locks.release();
    }

    // The CLI: the key `status` computes for the job.
    const cli: Record<string, boolean> = {};
    const bin = `${built.dir}dist/cli/cli.js`;
    for (const task of tasks) {
      const { stdout } = await promisify(execFile)(
        process.execPath,
        [bin, "status", task, JSON.stringify(payload), "-C", configPath, "--json"],
        { env: { ...process.env, DATABASE_URL: "" }, timeout: 30_000 },
      );
      cli[task] = (JSON.parse(stdout) as { keys: string[] }).keys[0] === String(ruledKey(task));
    }

    // The workers: whether the job held the key of its rules while it ran.
    const workers: Record<string, boolean> = {};
    const recordHeld: Task = async (_payload, helpers) => {
      const task = helpers.job.task_identifier;
      const { rows } = await helpers.query(
        "select 1 from graphile_worker_locks.held_locks where lock_key = $1",
        [String(ruledKey(task))],
      );
      workers[task] = rows.length > 0;
    };
    const runner = await run({
      preset,
      taskList: { from_base: recordHeld, from_leaf: recordHeld },
      logger: quietLogger,
      noHandleSignals: true,
    });
    try {
      await waitFor(
        "both jobs",
        async () => (await jobsLeft("from_base")) + (await jobsLeft("from_leaf")) === 0,
      );
    } finally {
      await runner.stop();
      await cleanUp();
    }

    expect({ workers, enqueue, cli }).toEqual({
      workers: expected,
      enqueue: expected,
      cli: expected,
    });
  }, 90_000);
});
