/**
 * Payload types from graphile-worker's `GraphileWorker.Tasks` declaration merging: a task declared there
 * has its payload type checked by this library's API; any other task takes `unknown`.
 */
import "graphile-worker";

/** The payload type of `taskIdentifier`: from `GraphileWorker.Tasks` if declared there, else `unknown`. */
export type TaskPayload<TIdentifier extends string> = TIdentifier extends keyof GraphileWorker.Tasks
  ? GraphileWorker.Tasks[TIdentifier]
  : unknown;
