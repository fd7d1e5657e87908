/**
 * Payload types from graphile-worker's `GraphileWorker.Tasks` declaration merging: a task declared there
 * has its payload type checked by this library's API; any other task takes `unknown`.
 */
import "graphile-worker";

/** The payload type of `taskIdentifier`: from `GraphileWorker.Tasks` if declared there, else `unknown`. */
export type TaskPayload<TIdentifier extends string> = TIdentifier extends keyof GraphileWorker.Tasks
  ? GraphileWorker.Tasks[TIdentifier]
  : unknown;

/** The task identifiers declared in `GraphileWorker.Tasks`. */
export type DeclaredTask = keyof GraphileWorker.Tasks & string;

/** `TIdentifier`, unless it is declared in `GraphileWorker.Tasks` (then the typed overload applies). */
export type UndeclaredTask<TIdentifier extends string> = TIdentifier extends DeclaredTask
  ? never
  : TIdentifier;
