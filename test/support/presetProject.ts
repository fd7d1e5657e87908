/**
 * A graphile-worker project on disk, as a user of the preset has one: a `graphile.config.mjs` extending
 * `WorkerPreset` and `LocksPreset`, a `tasks/` folder (TypeScript and JavaScript task files) and optionally a
 * `crontab`. Every task records the start and end of each execution with the database's clock into
 * `test_executions` (`lock_key`: the key the test groups by, `note`: the payload's `n`).
 */
import { spawn, type ChildProcess } from "node:child_process";
import { mkdir, rm, symlink, writeFile } from "node:fs/promises";
import { randomBytes } from "node:crypto";
import { fileURLToPath } from "node:url";

const ROOT = fileURLToPath(new URL("../../", import.meta.url));
export const GRAPHILE_WORKER_BIN = `${ROOT}node_modules/.bin/graphile-worker`;

/** The body of a task that records its execution; `keyExpr` is a JS expression over `p` (the payload). */
export const recordingTask = (task: string, keyExpr: string) => `
  const p = payload;
  const { rows } = await helpers.query(
    "insert into test_executions (job_id, task, lock_key, worker, attempts, note) values ($1, $2, $3, $4, $5, $6) returning id",
    [helpers.job.id, ${JSON.stringify(task)}, String(${keyExpr}), process.env.WORKER_NAME ?? "in-process", helpers.job.attempts, String(p.n ?? "")],
  );
  await new Promise((resolve) => setTimeout(resolve, p.ms ?? 20));
  await helpers.query("update test_executions set ended_at = clock_timestamp() where id = $1", [rows[0].id]);
`;

export interface ProjectFiles {
  /** The package's built entry (see support/build.ts), imported by the config as a user's would be. */
  entry: string;
  /** The `worker` section of the config, as JavaScript source (an object literal's members). */
  worker: string;
  /** Task files by file name, e.g. `charge_card.ts`. */
  tasks: Record<string, string>;
  crontab?: string;
}

export interface Project {
  dir: string;
  configPath: string;
  remove(): Promise<void>;
}

export async function writeProject(files: ProjectFiles): Promise<Project> {
  const dir = fileURLToPath(
    new URL(`../.preset/p-${randomBytes(4).toString("hex")}/`, import.meta.url),
  );
  await mkdir(`${dir}tasks`, { recursive: true });
  const configPath = `${dir}graphile.config.mjs`;
  await writeFile(
    configPath,
    `import { WorkerPreset } from "graphile-worker";
import { LocksPreset } from ${JSON.stringify(files.entry)};

/** @type {GraphileConfig.Preset} */
const preset = {
  extends: [WorkerPreset, LocksPreset],
  worker: {
    connectionString: process.env.DATABASE_URL,
    taskDirectory: ${JSON.stringify(`${dir}tasks`)},
    crontabFile: ${JSON.stringify(`${dir}crontab`)},
    // graphile-worker 0.17.3 loads only .js, .cjs and .mjs task files unless told (0.18 adds .ts, .mts)
    fileExtensions: [".js", ".cjs", ".mjs", ".ts"],
    ${files.worker}
  },
};

export default preset;
`,
  );
  for (const [name, source] of Object.entries(files.tasks)) {
    await writeFile(`${dir}tasks/${name}`, source);
  }
  if (files.crontab !== undefined) await writeFile(`${dir}crontab`, files.crontab);
  return { dir, configPath, remove: () => rm(dir, { recursive: true, force: true }) };
}

export interface TypeScriptProjectFiles {
  /** The built package's folder (see support/build.ts), installed as `node_modules/graphile-worker-locks`. */
  packageDir: string;
  /** The graphile-worker package's folder, installed as `node_modules/graphile-worker`. */
  graphileWorkerDir: string;
  /** The `worker` section of the config, as TypeScript source (an object literal's members). */
  worker: string;
  /** Task files by file name, e.g. `hello.ts`. */
  tasks: Record<string, string>;
}

/**
 * A project as the README describes one in TypeScript: a `graphile.config.mts` that only loads with
 * TypeScript's syntax understood (a type annotation, an `import type`), importing both packages by name
 * from its own `node_modules`; its copy as `graphile.config.ts`; and a `tasks/` folder.
 */
export async function writeTypeScriptProject(files: TypeScriptProjectFiles): Promise<Project> {
  const dir = fileURLToPath(
    new URL(`../.preset/ts-${randomBytes(4).toString("hex")}/`, import.meta.url),
  );
  await mkdir(`${dir}tasks`, { recursive: true });
  await mkdir(`${dir}node_modules`, { recursive: true });
  await symlink(files.packageDir, `${dir}node_modules/graphile-worker-locks`, "dir");
  await symlink(files.graphileWorkerDir, `${dir}node_modules/graphile-worker`, "dir");
  const config = `import type { WorkerPreset as WorkerPresetType } from "graphile-worker";
import { WorkerPreset } from "graphile-worker";
import { LocksPreset } from "graphile-worker-locks";

const base: typeof WorkerPresetType = WorkerPreset;
const preset: GraphileConfig.Preset = {
  extends: [base, LocksPreset],
  worker: {
    connectionString: process.env.DATABASE_URL,
    fileExtensions: [".js", ".cjs", ".mjs", ".ts"],
    ${files.worker}
  },
};

export default preset;
`;
  await writeFile(`${dir}package.json`, '{ "private": true, "type": "module" }\n');
  await writeFile(`${dir}graphile.config.mts`, config);
  await writeFile(`${dir}graphile.config.ts`, config);
  for (const [name, source] of Object.entries(files.tasks)) {
    await writeFile(`${dir}tasks/${name}`, source);
  }
  return {
    dir,
    configPath: `${dir}graphile.config.mts`,
    remove: () => rm(dir, { recursive: true, force: true }),
  };
}

export interface CliWorker {
  child: ChildProcess;
  output(): string;
  /**
   * SIGINT (graphile-worker's graceful shutdown), then how the process ended: its exit code, or the signal
   * it re-raised on itself once shut down (graphile-worker does so).
   */
  stop(): Promise<number | string | null>;
  exited: Promise<number | string | null>;
}

/** Runs the real `graphile-worker` CLI with the project's config (TypeScript files loaded through tsx's ESM loader). */
export function startCliWorker(project: Project, url: string, name: string): CliWorker {
  return watch(
    spawn(GRAPHILE_WORKER_BIN, ["-C", project.configPath], {
      cwd: ROOT,
      env: {
        ...process.env,
        DATABASE_URL: url,
        WORKER_NAME: name,
        NODE_OPTIONS: "--import tsx/esm",
      },
      stdio: ["ignore", "pipe", "pipe"],
    }),
  );
}

/**
 * Runs a graphile-worker CLI (`cli`: its `dist/cli.js`) on this Node (`process.execPath`) in the project's
 * folder, as `NODE_OPTIONS="<nodeOptions>" graphile-worker -C <config>` there, and nothing else in
 * NODE_OPTIONS.
 */
export function startCliCommand(
  project: Project,
  url: string,
  command: { cli: string; config: string; nodeOptions: string },
): CliWorker {
  return watch(
    spawn(process.execPath, [command.cli, "-C", command.config], {
      cwd: project.dir,
      env: { ...process.env, DATABASE_URL: url, NODE_OPTIONS: command.nodeOptions },
      stdio: ["ignore", "pipe", "pipe"],
    }),
  );
}

const PRESET_WORKER = fileURLToPath(new URL("../fixtures/preset-worker.ts", import.meta.url));
/** Gives the process the graphile-worker TEST_GRAPHILE_WORKER selects, as vitest does here. */
const GRAPHILE_WORKER_HOOK = fileURLToPath(new URL("./graphile-worker-hook.mjs", import.meta.url));
/** What test/fixtures/preset-worker.ts prints once `run({ preset })` has resolved. */
export const PRESET_WORKER_READY = "preset worker ready";

/** Runs test/fixtures/preset-worker.ts (`run({ preset })` in a process of its own). */
export function startPresetWorker(url: string, name: string): CliWorker {
  return watch(
    spawn(process.execPath, ["--import", "tsx", "--import", GRAPHILE_WORKER_HOOK, PRESET_WORKER], {
      cwd: ROOT,
      env: { ...process.env, DATABASE_URL: url, WORKER_NAME: name },
      stdio: ["ignore", "pipe", "pipe"],
    }),
  );
}

function watch(child: ChildProcess): CliWorker {
  let output = "";
  child.stdout!.on("data", (d: Buffer) => (output += d.toString()));
  child.stderr!.on("data", (d: Buffer) => (output += d.toString()));
  const exited = new Promise<number | string | null>((resolve) =>
    child.once("exit", (code, signal) => resolve(code ?? signal)),
  );
  return {
    child,
    output: () => output,
    exited,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGINT");
      return exited;
    },
  };
}
