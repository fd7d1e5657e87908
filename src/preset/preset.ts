/**
 * `LocksPreset`: the library as a graphile-worker preset, for `graphile.config.ts`, `run({ preset })`, the
 * `graphile-worker` CLI, task folders and crontabs. Its plugin, through graphile-worker's own hooks:
 *
 * - `init` (middleware): validates `worker.locks` (a wrong option throws, naming the task and the option),
 *   and gives the runner the lock session's forbidden flags when it has no local queue (with one, the
 *   lock-ahead of `attach` serves instead: graphile-worker's `forbiddenFlags` turns its batching off).
 * - `postmigrate`: installs or upgrades the library's schema beside graphile-worker's.
 * - `loadTaskFromFiles`: reads a task file's `locks` export (its rules, beside its function).
 * - `startWorker`: on a pool's first worker, takes the process's `Locks` instance for this config (one per
 *   process and config, however many pools run), attaches the pool's events (lock-ahead, early wakes),
 *   and wraps every task with rules, whether it came from `taskList`, `taskDirectory` or the CLI.
 * - `poolGracefulShutdown` / `poolForcefulShutdown` (middleware) and `pool:release`: the pool lets go of
 *   the instance; the last pool to do so releases it (closing the lock session).
 */
import type { Pool } from "pg";
import { resolvePreset } from "graphile-config";
import { WorkerPreset } from "graphile-worker";
import type { Task, TaskList, WorkerPool, WorkerEvents } from "graphile-worker";
import { InvalidArgumentError } from "../errors.js";
import { makeLocks } from "../locks.js";
import type { Locks } from "../types.js";
import { migrate } from "../migrate.js";
import { validateLocksTimings, type LocksOptions } from "../options.js";
import { pickTaskFile, readFileRules } from "./files.js";
import { migrateOptionsOf, PRESET_OPTION_NAMES, type PresetOptionName } from "./options.js";
import {
  defineTask,
  mergeRules,
  validateTaskRules,
  wrapTask,
  type TaskLocksOptions,
  type TaskLocksOptionsMap,
} from "./rules.js";

export type { TaskLocksOptions, TaskLocksOptionsMap } from "./rules.js";

/** `worker.locks` of a graphile-worker preset. */
export interface LocksPresetOptions extends Pick<
  LocksOptions,
  Exclude<PresetOptionName, "connectionString">
> {
  /**
   * Connection string for enqueueing and introspection (and the lock session, unless
   * `lockConnectionString` is set).
   * @defaultValue `worker.connectionString` (graphile-worker's, itself `DATABASE_URL` by default)
   */
  connectionString?: string;
  /**
   * Each task's rules, by task identifier. A task with an entry here is wrapped wherever it comes from
   * (`taskList`, `taskDirectory`). Where a task file also exports `locks`, this entry wins, option by
   * option. A name that matches no task is a warning (tasks may be loaded later), not an error.
   */
  tasks?: TaskLocksOptionsMap;
}

declare global {
  // eslint-disable-next-line @typescript-eslint/no-namespace -- graphile-config's options merge into this namespace
  namespace GraphileConfig {
    interface WorkerOptions {
      /** graphile-worker-locks: exclusive execution and unique jobs (see `LocksPreset`). */
      locks?: LocksPresetOptions;
    }
    interface Plugins {
      LocksPlugin: true;
    }
  }
}

const VERSION = "0.1.0";

/** Validates `worker.locks`, throwing an `InvalidArgumentError` naming the task and the option. */
export function validateLocksPresetOptions(
  options: unknown,
): asserts options is LocksPresetOptions | undefined {
  if (options === undefined) return;
  if (!options || typeof options !== "object" || Array.isArray(options)) {
    throw new InvalidArgumentError(`\`worker.locks\` must be an object, got ${String(options)}`);
  }
  for (const name of Object.keys(options)) {
    if (!PRESET_OPTION_NAMES.includes(name)) {
      throw new InvalidArgumentError(
        `\`worker.locks\`: unknown option \`${name}\` (known: ${PRESET_OPTION_NAMES.join(", ")})`,
      );
    }
  }
  try {
    validateLocksTimings(options as LocksPresetOptions);
  } catch (error) {
    if (!(error instanceof InvalidArgumentError)) throw error;
    throw new InvalidArgumentError(`\`worker.locks\`: ${error.message}`, { cause: error });
  }
  const { tasks } = options as LocksPresetOptions;
  if (tasks === undefined) return;
  if (!tasks || typeof tasks !== "object" || Array.isArray(tasks)) {
    throw new InvalidArgumentError(
      `\`worker.locks.tasks\` must be an object keyed by task identifier, got ${String(tasks)}`,
    );
  }
  for (const [taskIdentifier, rules] of Object.entries(tasks)) {
    validateTaskRules(taskIdentifier, rules, "`worker.locks.tasks`");
  }
}

/** A `Locks` instance shared by every pool of this process that runs under the same config. */
interface Shared {
  key: string;
  locks: Locks;
  users: number;
}
const sharedInstances = new Map<string, Shared>();
const identities = new WeakMap<object, number>();
let nextIdentity = 1;
const identity = (value: object | undefined): number => {
  if (!value) return 0;
  let id = identities.get(value);
  if (id === undefined) identities.set(value, (id = nextIdentity++));
  return id;
};

/** What the plugin keeps per resolved preset (one per `run()` or CLI start). */
interface PresetState {
  fileRules: Map<string, TaskLocksOptions>;
  pools: Map<WorkerPool, { shared: Shared; detach: () => void }>;
  current: Shared | null;
  warned: boolean;
}
const states = new WeakMap<object, PresetState>();
const stateOf = (resolvedPreset: object): PresetState => {
  let state = states.get(resolvedPreset);
  if (!state) {
    state = { fileRules: new Map(), pools: new Map(), current: null, warned: false };
    states.set(resolvedPreset, state);
  }
  return state;
};
const wrappedTasks = new WeakSet<Task>();

interface Ctx {
  resolvedPreset: GraphileConfig.ResolvedPreset;
  workerSchema: string;
  events: WorkerEvents;
  logger: LocksOptions["logger"] & object;
  _rawOptions?: { pgPool?: Pool; forbiddenFlags?: unknown };
}

function acquire(ctx: Ctx): Shared {
  const worker = ctx.resolvedPreset.worker ?? {};
  const options = worker.locks ?? {};
  const pgPool = ctx._rawOptions?.pgPool;
  const connectionString = options.connectionString ?? worker.connectionString;
  if (!pgPool && !connectionString) {
    throw new InvalidArgumentError(
      "graphile-worker-locks needs a database: set `worker.connectionString` (or `DATABASE_URL`), or `worker.locks.connectionString`",
    );
  }
  const key = JSON.stringify([
    connectionString ?? `pool#${identity(pgPool)}`,
    options.lockConnectionString ?? null,
    options.schema ?? null,
    ctx.workerSchema,
    identity(worker.locks),
  ]);
  let shared = sharedInstances.get(key);
  if (!shared) {
    const { tasks: _tasks, connectionString: _cs, ...rest } = options;
    const locks = makeLocks({
      ...rest,
      ...(options.connectionString || !pgPool ? { connectionString } : { pgPool }),
      workerSchema: ctx.workerSchema,
      logger: ctx.logger,
    });
    shared = { key, locks, users: 0 };
    sharedInstances.set(key, shared);
  }
  shared.users += 1;
  return shared;
}

async function letGo(ctx: Ctx, workerPool: WorkerPool): Promise<void> {
  const state = stateOf(ctx.resolvedPreset);
  const entry = state.pools.get(workerPool);
  if (!entry) return;
  state.pools.delete(workerPool);
  entry.detach();
  const { shared } = entry;
  shared.users -= 1;
  if (shared.users > 0) return;
  if (sharedInstances.get(shared.key) === shared) sharedInstances.delete(shared.key);
  if (state.current === shared) state.current = null;
  await shared.locks.release();
}

/** Wraps, in place, every task of `tasks` that has rules (from the preset or its file). */
function wrapTasks(ctx: Ctx, tasks: TaskList, locks: Locks): void {
  const state = stateOf(ctx.resolvedPreset);
  const presetRules = ctx.resolvedPreset.worker?.locks?.tasks ?? {};
  for (const taskIdentifier of Object.keys(tasks)) {
    const task = tasks[taskIdentifier];
    if (!task || wrappedTasks.has(task)) continue;
    const rules = mergeRules(
      state.fileRules.get(taskIdentifier),
      presetRules[taskIdentifier] as TaskLocksOptions | undefined,
    );
    if (!rules) continue;
    validateTaskRules(taskIdentifier, rules, "the rules");
    const wrapped = wrapTask(locks, taskIdentifier, task, rules);
    wrappedTasks.add(wrapped);
    tasks[taskIdentifier] = wrapped;
  }
  if (!state.warned) {
    state.warned = true;
    const unknown = Object.keys(presetRules).filter((name) => !(name in tasks));
    if (unknown.length > 0) {
      ctx.logger.warn(
        `graphile-worker-locks: \`worker.locks.tasks\` names task(s) this worker does not have: ${unknown.map((n) => `'${n}'`).join(", ")}`,
      );
    }
  }
}

/** A pool-like object over one client, for the library's migrations on graphile-worker's client. */
function poolOver(client: { query: Pool["query"] }): Pool {
  return {
    connect: async () => ({ query: client.query.bind(client), release: () => undefined }),
  } as unknown as Pool;
}

/** The plugin of `LocksPreset`; see the module comment. */
const LocksPlugin: GraphileConfig.Plugin = {
  name: "LocksPlugin",
  version: VERSION,
  description: "graphile-worker-locks: exclusive execution and unique jobs",
  worker: {
    middleware: {
      init(next, event) {
        validateLocksPresetOptions(event.ctx.resolvedPreset.worker?.locks);
        const compiled = next();
        const ctx = compiled as unknown as Ctx;
        const raw = ctx._rawOptions;
        const localQueueSize = ctx.resolvedPreset.worker?.localQueue?.size ?? -1;
        if (raw && raw.forbiddenFlags == null && localQueueSize <= 1) {
          // (a copy: the caller's options object stays as it was given)
          const state = stateOf(ctx.resolvedPreset);
          ctx._rawOptions = {
            ...raw,
            forbiddenFlags: () => state.current?.locks.forbiddenFlags() ?? null,
          };
        }
        return compiled;
      },
      async poolGracefulShutdown(next, event) {
        try {
          return await next();
        } finally {
          await letGo(event.ctx as unknown as Ctx, event.workerPool);
        }
      },
      async poolForcefulShutdown(next, event) {
        try {
          return await next();
        } finally {
          await letGo(event.ctx as unknown as Ctx, event.workerPool);
        }
      },
    },
    hooks: {
      async postmigrate(ctx, event) {
        await migrate({
          ...migrateOptionsOf(ctx.resolvedPreset.worker?.locks),
          pgPool: poolOver(event.client),
          workerSchema: ctx.workerSchema,
        });
      },
      async loadTaskFromFiles(ctx, details) {
        const file = pickTaskFile(
          details.fileDetailsList,
          ctx.resolvedPreset.worker?.fileExtensions,
        );
        if (!file) return;
        const rules = await readFileRules(details.taskIdentifier, file.fullPath);
        if (rules !== undefined)
          stateOf(ctx.resolvedPreset).fileRules.set(details.taskIdentifier, rules);
      },
      startWorker(ctx, event) {
        const c = ctx as unknown as Ctx;
        const state = stateOf(c.resolvedPreset);
        const workerPool = event.worker.workerPool;
        let entry = state.pools.get(workerPool);
        if (!entry) {
          const shared = acquire(c);
          state.current = shared;
          const detachRunner = shared.locks.attach({ events: c.events });
          const onRelease = ({ workerPool: released }: { workerPool: WorkerPool }) => {
            if (released !== workerPool) return;
            c.events.off("pool:release", onRelease);
            void letGo(c, workerPool).catch((error: unknown) =>
              c.logger.error(`graphile-worker-locks: releasing failed: ${String(error)}`, {
                error,
              }),
            );
          };
          c.events.on("pool:release", onRelease);
          entry = {
            shared,
            detach: () => {
              c.events.off("pool:release", onRelease);
              detachRunner();
            },
          };
          state.pools.set(workerPool, entry);
        }
        wrapTasks(c, event.tasks as unknown as TaskList, entry.shared.locks);
      },
    },
  },
};

/**
 * The library as a graphile-worker preset: add it to `extends` beside `WorkerPreset`, and configure it
 * under `worker.locks`.
 */
export const LocksPreset: GraphileConfig.Preset = {
  plugins: [LocksPlugin],
};

/**
 * The `worker` options a runner of `preset` sees: resolved by graphile-config (as `run()` and the
 * `graphile-worker` CLI resolve it), over the defaults of graphile-worker's `WorkerPreset` (`DATABASE_URL`,
 * `GRAPHILE_WORKER_SCHEMA`, `./tasks`). graphile-config merges each `worker` option as a whole: a preset's
 * `worker.locks` replaces that of a preset it extends, `tasks` included.
 */
export function resolveWorkerOptions(preset: GraphileConfig.Preset): GraphileConfig.WorkerOptions {
  // WorkerPreset's options only: its plugins may come from another copy of graphile-worker than the
  // preset's own, which graphile-config would refuse as two plugins of the same name.
  return resolvePreset({ extends: [{ worker: WorkerPreset.worker }, preset] }).worker ?? {};
}

/**
 * A `Locks` instance for a process that only enqueues (a web server, a script), with the rules of the
 * preset's `worker.locks.tasks`, so that `locks.addJob` and `locks.lockAvailable` follow the same rules
 * as the workers. (Rules that only a task file declares are not known here: put the rules an enqueuing
 * process needs in the preset.) `overrides` replace the connection settings the preset implies.
 */
export function makeLocksFromPreset(
  preset: GraphileConfig.Preset,
  overrides: Partial<LocksOptions> = {},
): Locks {
  const worker = resolveWorkerOptions(preset);
  validateLocksPresetOptions(worker.locks);
  const { tasks, connectionString, ...rest } = worker.locks ?? {};
  const locks = makeLocks({
    ...rest,
    ...(overrides.pgPool
      ? {}
      : {
          connectionString: connectionString ?? worker.connectionString ?? process.env.DATABASE_URL,
        }),
    workerSchema: worker.schema,
    ...(worker.logger ? { logger: worker.logger } : {}),
    ...overrides,
  });
  for (const [taskIdentifier, rules] of Object.entries(tasks ?? {})) {
    if (rules) defineTask(locks, taskIdentifier, rules as TaskLocksOptions);
  }
  return locks;
}
