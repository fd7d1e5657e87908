/**
 * The options `worker.locks` takes beside `tasks`: every option of `makeLocks` except those graphile-worker
 * supplies. One list, from which the type of `worker.locks`, its validation and the options the plugin's
 * `postmigrate` hook gives `migrate` all derive, so that an option added to `makeLocks` fails to compile
 * until it is listed here.
 */
import type { MigrateOptions } from "../migrate.js";
import type { LocksOptions } from "../options.js";

/** The options of `makeLocks` the plugin takes from graphile-worker (its pool, its schema, its logger). */
export type OptionsFromWorker = "pgPool" | "workerSchema" | "logger";

/** How the plugin uses an option of `worker.locks`, beside giving it to `makeLocks`. */
interface PresetOptionUse {
  /** Whether `postmigrate` gives it to `migrate` (the library's schema is installed with graphile-worker's). */
  readonly migrate: boolean;
}

/** Every option of `makeLocks` that `worker.locks` takes; see the module comment. */
export const PRESET_OPTIONS = {
  connectionString: { migrate: false },
  lockConnectionString: { migrate: false },
  schema: { migrate: true },
  allowUntestedWorkerSchema: { migrate: true },
  applicationName: { migrate: false },
  heartbeatInterval: { migrate: false },
  heartbeatTimeout: { migrate: false },
  lockSessionWait: { migrate: false },
  partitionTimeout: { migrate: false },
  reconnectDelay: { migrate: false },
  defaults: { migrate: false },
  preparedStatements: { migrate: false },
} as const satisfies {
  readonly [K in Exclude<keyof LocksOptions, OptionsFromWorker>]-?: PresetOptionUse;
};

/** The name of an option of `worker.locks` other than `tasks`. */
export type PresetOptionName = keyof typeof PRESET_OPTIONS;

/** The options of `worker.locks` that `postmigrate` gives `migrate`. */
type MigrateOptionName = {
  [K in PresetOptionName]: (typeof PRESET_OPTIONS)[K]["migrate"] extends true ? K : never;
}[PresetOptionName];

/** The names `worker.locks` accepts, `tasks` included. */
export const PRESET_OPTION_NAMES: readonly string[] = [...Object.keys(PRESET_OPTIONS), "tasks"];

/** Whether `name` is an option of `worker.locks` other than `tasks`. */
export function isPresetOption(name: string): name is PresetOptionName {
  return Object.hasOwn(PRESET_OPTIONS, name);
}

/** The options of `worker.locks` that `migrate` takes. */
export function migrateOptionsOf(
  options: Partial<Pick<LocksOptions, PresetOptionName>> | undefined,
): Pick<MigrateOptions, MigrateOptionName> {
  const picked: Partial<Record<PresetOptionName, unknown>> = {};
  for (const [name, value] of Object.entries(options ?? {})) {
    if (isPresetOption(name) && PRESET_OPTIONS[name].migrate && value !== undefined) {
      picked[name] = value;
    }
  }
  return picked as Pick<MigrateOptions, MigrateOptionName>;
}
