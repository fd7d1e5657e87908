export { makeLocks } from "./locks.js";
export type { Locks, HeldLock, UniqueTask, AddJobsItem } from "./locks.js";
export type { ExclusiveTask } from "./exclusive.js";
export type { AddJobResult } from "./enqueue.js";
export type { LocksEvents, LocksEventName, LocksEventEmitter } from "./events.js";
export type {
  AddJobSpec,
  ConflictStrategy,
  DefineOptions,
  ExclusiveOptions,
  LocksOptions,
  RescheduleOptions,
  ResolvedExclusiveOptions,
} from "./options.js";
export { CONFLICT_STRATEGIES } from "./options.js";
export {
  lockKey,
  lockKeyMaterial,
  slotKeys,
  canonicalJson,
  assertJsonSafe,
  advisoryParts,
  lockFlag,
  KEY_VERSION,
} from "./key.js";
export { migrate, TESTED_WORKER_SCHEMAS } from "./migrate.js";
export type { MigrateOptions } from "./migrate.js";
export type { HandoffCounts } from "./handoff.js";
export {
  ErrorCodes,
  LocksError,
  LockConflictError,
  InvalidArgumentError,
  UniqueConflictError,
  UntestedWorkerSchemaError,
} from "./errors.js";
export { UNIQUE_SCOPES, DUPLICATE_STRATEGIES, uniqueJobKey, uniqueKeyMaterial } from "./unique.js";
export type { UniqueOptions, UniqueScope, DuplicateStrategy } from "./unique.js";
export type { ErrorCode } from "./errors.js";
export {
  LocksPreset,
  LocksPlugin,
  makeLocksFromPreset,
  validateLocksPresetOptions,
  payloadWithoutCron,
} from "./preset.js";
export type { LocksPresetOptions, TaskLocksOptions, TaskLocksOptionsMap } from "./preset.js";
export type { TaskPayload } from "./types.js";
