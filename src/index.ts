/** The package's entry point: re-exports only. Public types are in types.ts. */
export { makeLocks } from "./locks.js";
export type * from "./types.js";
export type { LocksEvents, LocksEventName, LocksEventEmitter } from "./events.js";
export type { HandoffCounts } from "./session/handoff.js";
export type { MigrateOptions } from "./migrate.js";
export type { Blocker, CanStartResult, LimitBlocker } from "./exclusive/can-start.js";
export type { ErrorCode } from "./errors.js";
export type { LocksPresetOptions, TaskLocksOptions, TaskLocksOptionsMap } from "./preset/preset.js";
export type {
  AddJobSpec,
  ConflictStrategy,
  DefineOptions,
  ExclusiveOptions,
  LimitOptions,
  LocksOptions,
  RescheduleOptions,
  ResolvedExclusiveOptions,
  UniqueOptions,
  UniqueScope,
  DuplicateStrategy,
  EnqueueRateOptions,
  DebounceOptions,
} from "./options.js";
export { enqueueRateKey, debounceKey } from "./enqueue/limits.js";
export { uniqueJobKey } from "./enqueue/unique.js";
export { migrate, TESTED_WORKER_SCHEMAS } from "./migrate.js";
export { lockKey, lockFlag } from "./key.js";
export { ErrorCodes, LocksError, LockConflictError, InvalidArgumentError } from "./errors.js";
export { SupersededError, UniqueConflictError, UntestedWorkerSchemaError } from "./errors.js";
export { SnoozeError, snooze, PauseError, pause, NotPausableError } from "./errors.js";
export type { PauseScope } from "./errors.js";
export type { RateOptions } from "./rates/options.js";
export { LocksPreset, makeLocksFromPreset } from "./preset/preset.js";
