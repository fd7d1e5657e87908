/**
 * The abort signal a locked task sees: graphile-worker's own, combined with the lock session's loss.
 */
import type { JobHelpers } from "graphile-worker";
import type { Hold } from "../session/holds.js";

/** The abort signal a locked task sees, and its promise form. */
interface LockedAbort {
  readonly lost: AbortSignal;
  readonly signal: AbortSignal;
  readonly promise: Promise<void>;
}

/**
 * The task's abort signal fires on graphile-worker's own abort (the worker's signal, shared by its jobs) and
 * when the lock session is lost (one signal per connection, shared by its holds). Both are long-lived and
 * shared, so their combination is made once per worker and connection, not per job: a job pays for a
 * spread of its helpers and nothing else.
 */
export class LockedAborts {
  private readonly byWorker = new WeakMap<object, LockedAbort>();
  private readonly noWorkerSignal = {};

  helpers(helpers: JobHelpers, hold: Hold): JobHelpers {
    const lost = hold.sessionSignal;
    const workerSignal: AbortSignal | undefined = helpers.abortSignal;
    const owner = workerSignal ?? this.noWorkerSignal;
    let abort = this.byWorker.get(owner);
    if (abort?.lost !== lost) {
      abort = combine(lost, workerSignal);
      this.byWorker.set(owner, abort);
    }
    return { ...helpers, abortSignal: abort.signal, abortPromise: abort.promise };
  }
}

function combine(lost: AbortSignal, workerSignal: AbortSignal | undefined): LockedAbort {
  const controller = new AbortController();
  const sources = workerSignal ? [workerSignal, lost] : [lost];
  const onAbort = (event: Event) => {
    for (const source of sources) source.removeEventListener("abort", onAbort);
    controller.abort((event.target as AbortSignal).reason);
  };
  const aborted = sources.find((source) => source.aborted);
  if (aborted) controller.abort(aborted.reason);
  else for (const source of sources) source.addEventListener("abort", onAbort, { once: true });
  const { signal } = controller;
  const promise = new Promise<void>((_resolve, reject) => {
    if (signal.aborted) reject(signal.reason);
    else signal.addEventListener("abort", () => reject(signal.reason), { once: true });
  });
  promise.catch(() => undefined);
  return { lost, signal, promise };
}
