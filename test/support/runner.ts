import { Logger, run, type Runner, type RunnerOptions, type TaskList } from "graphile-worker";
import type { Locks, LocksEvents } from "../../src/index.js";
import { maxConcurrencyPerKey } from "./executions.js";

export const quietLogger = new Logger(() => () => undefined);

/** A logger that keeps the warnings it is given, in `warnings`, and drops everything else. */
export function warningsLogger(): { logger: Logger; warnings: string[] } {
  const warnings: string[] = [];
  const logger = new Logger(() => (level, message) => {
    if (level === "warning") warnings.push(message);
  });
  return { logger, warnings };
}

/** A real graphile-worker runner in this process, quiet and quick to poll. */
export function startRunner(options: RunnerOptions & { taskList: TaskList }): Promise<Runner> {
  return run({ noHandleSignals: true, pollInterval: 50, logger: quietLogger, ...options });
}

/** Resolves with the next event of that name matching `predicate`. */
export function nextEvent<K extends keyof LocksEvents>(
  locks: Locks,
  name: K,
  predicate: (payload: LocksEvents[K]) => boolean = () => true,
  timeoutMs = 20_000,
): Promise<LocksEvents[K]> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      locks.events.off(name, listener);
      reject(new Error(`timed out waiting for '${name}'`));
    }, timeoutMs);
    const listener = (payload: LocksEvents[K]) => {
      if (!predicate(payload)) return;
      clearTimeout(timer);
      locks.events.off(name, listener);
      resolve(payload);
    };
    locks.events.on(name, listener);
  });
}

/** Counts events by name. */
export function countEvents(
  locks: Locks,
  names: ReadonlyArray<keyof LocksEvents>,
): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const name of names) {
    counts[name] = 0;
    locks.events.on(name, () => {
      counts[name] = (counts[name] ?? 0) + 1;
    });
  }
  return counts;
}

/** Records [start, end] of executions per key, with one process's monotonic clock. */
export class Timeline {
  readonly executions: Array<{
    key: string;
    start: bigint;
    end: bigint | null;
    jobId: string;
    attempts: number;
  }> = [];
  begin(key: string, jobId: string, attempts: number): () => void {
    const entry = {
      key,
      start: process.hrtime.bigint(),
      end: null as bigint | null,
      jobId,
      attempts,
    };
    this.executions.push(entry);
    return () => {
      entry.end = process.hrtime.bigint();
    };
  }
  /** Highest number of executions of one key (of any key, when omitted) running at the same instant. */
  maxConcurrency(key?: string): number {
    const perKey = maxConcurrencyPerKey(
      this.executions.map((e) => ({
        ...e,
        lockKey: e.key,
        worker: "",
        start: e.start,
        end: e.end,
      })),
    );
    return key === undefined ? Math.max(0, ...perKey.values()) : (perKey.get(key) ?? 0);
  }
}
