/**
 * The abort signal a locked task sees: graphile-worker's own, combined with the lock session's loss and, for
 * a job of a `reschedule` task, its supersession by a newer job of its key (`supersede`).
 */
import { setMaxListeners } from "node:events";
import type { JobHelpers } from "graphile-worker";
import type { Hold } from "../session/holds.js";

/** The abort signal a locked task sees, and its promise form. */
interface LockedAbort {
  readonly lost: AbortSignal;
  readonly signal: AbortSignal;
  readonly promise: Promise<void>;
  /** Stops listening to the sources (they outlive the job). */
  detach(): void;
}

/**
 * The task's abort signal fires on graphile-worker's own abort (the worker's signal, shared by its jobs) and
 * when the lock session is lost (one signal per connection, shared by its holds). Both are long-lived and
 * shared, so their combination is made once per worker and connection, not per job: a job pays for a
 * spread of its helpers and nothing else. A job of a `reschedule` task may also be superseded, which is its
 * own: its combination of that shared one and its supersession is made per job, on the task's first look at
 * its signal, and stops listening when the job ends (`done`). So graphile-worker's signal and the session's
 * have one listener each per worker and connection, however many jobs run; the shared combination has one
 * per running job that looked, and no limit on their number (Node.js warns of a leak past ten listeners).
 */
export class LockedAborts {
  private readonly byWorker = new WeakMap<object, LockedAbort>();
  private readonly relays = new WeakMap<AbortSignal, AbortSignal>();
  private readonly noWorkerSignal = {};
  private readonly perJob = new WeakMap<Hold, () => LockedAbort | undefined>();

  /** The job of `hold` has ended: its own combination, if it made one, stops listening. */
  done(hold: Hold): void {
    this.perJob.get(hold)?.()?.detach();
    this.perJob.delete(hold);
  }

  helpers(helpers: JobHelpers, hold: Hold): JobHelpers {
    const shared = this.shared(helpers, hold);
    if (hold.info.reschedule) {
      const { helpers: own, made } = supersedable(helpers, hold, shared);
      this.perJob.set(hold, made);
      return own;
    }
    return { ...helpers, abortSignal: shared.signal, abortPromise: shared.promise };
  }

  /**
   * graphile-worker's signal (`helpers.abortSignal`) relayed by one listener to a signal of ours that takes any
   * number: what a job waits on before it holds its lock (a rate's slot, a give-back's retry), so that many
   * jobs waiting at once add no listener each to graphile-worker's.
   */
  workerSignal(helpers: JobHelpers): AbortSignal | undefined {
    const signal: AbortSignal | undefined = helpers.abortSignal;
    if (!signal) return undefined;
    let relayed = this.relays.get(signal);
    if (!relayed) {
      relayed = combine(signal, [signal]).signal;
      setMaxListeners(0, relayed);
      this.relays.set(signal, relayed);
    }
    return relayed;
  }

  /** The combination of the worker's signal and the session's loss, made once per worker and connection. */
  private shared(helpers: JobHelpers, hold: Hold): LockedAbort {
    const lost = hold.sessionSignal;
    const workerSignal: AbortSignal | undefined = helpers.abortSignal;
    const owner = workerSignal ?? this.noWorkerSignal;
    let abort = this.byWorker.get(owner);
    if (abort?.lost !== lost) {
      abort = combine(lost, workerSignal ? [workerSignal, lost] : [lost]);
      // (each running job of a `reschedule` task that looked at its signal listens to it)
      setMaxListeners(0, abort.signal);
      this.byWorker.set(owner, abort);
    }
    return abort;
  }
}

/**
 * Helpers whose abort signal fires on `shared` (the worker's and the session's) and when `hold`'s job is
 * superseded, made when first read; and `made`, the combination if it was made.
 */
function supersedable(
  helpers: JobHelpers,
  hold: Hold,
  shared: LockedAbort,
): { helpers: JobHelpers; made: () => LockedAbort | undefined } {
  let abort: LockedAbort | undefined;
  const make = () => {
    if (abort) return abort;
    return (abort = combine(shared.lost, [shared.signal, hold.supersedeSignal]));
  };
  const own = Object.defineProperties(
    { ...helpers },
    {
      abortSignal: { get: () => make().signal, enumerable: true },
      abortPromise: { get: () => make().promise, enumerable: true },
    },
  );
  return { helpers: own, made: () => abort };
}

function combine(lost: AbortSignal, sources: AbortSignal[]): LockedAbort {
  const controller = new AbortController();
  const detach = () => {
    for (const source of sources) source.removeEventListener("abort", onAbort);
  };
  const onAbort = (event: Event) => {
    detach();
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
  return { lost, signal, promise, detach };
}
