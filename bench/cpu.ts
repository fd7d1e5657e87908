/**
 * Where a run's CPU went, from Linux's per-thread schedstat (`/proc/<pid>/task/<tid>/schedstat`: time on a
 * core, and time runnable but waiting for one, in ns): the PostgreSQL server's processes, and the main
 * threads of this process's children (the bench's worker processes). Two snapshots a run, so measuring costs
 * nothing while the run goes. A process that ends between them counts from zero at its birth up to the
 * second snapshot; one that ended before it is not counted, so the second snapshot is taken before the
 * runners stop (their pool backends still open).
 */
import { readdirSync, readFileSync } from "node:fs";

export interface CpuUse {
  /** PostgreSQL's processes: time on a core, and time waiting for one, ms. */
  serverMs: number;
  serverWaitMs: number;
  /** The worker processes' main threads (where JavaScript runs): the same, ms. */
  workerMs: number;
  workerWaitMs: number;
}
type Snapshot = Map<string, { server: boolean; run: number; wait: number }>;

const read = (path: string): string | null => {
  try {
    return readFileSync(path, "utf8");
  } catch {
    return null;
  }
};

/** The schedstat of every PostgreSQL process and of every child's main thread, now (empty off Linux). */
export function cpuSnapshot(): Snapshot {
  const out: Snapshot = new Map();
  let pids: string[];
  try {
    pids = readdirSync("/proc").filter((p) => /^\d+$/.test(p));
  } catch {
    return out;
  }
  for (const pid of pids) {
    const stat = read(`/proc/${pid}/stat`);
    if (!stat) continue;
    // The command name is in parentheses and may hold spaces; the fields after it are space-separated.
    const close = stat.lastIndexOf(")");
    const server = stat.slice(stat.indexOf("(") + 1, close) === "postgres";
    const parent = Number(stat.slice(close + 2).split(" ")[1]);
    if (!server && parent !== process.pid) continue;
    const fields = read(`/proc/${pid}/task/${pid}/schedstat`)?.trim().split(" ").map(Number);
    if (!fields || fields.length < 2) continue;
    out.set(pid, { server, run: fields[0]!, wait: fields[1]! });
  }
  return out;
}

/**
 * One process's schedstat so far (a backend's, by its pid): its time on a core and its time runnable but
 * waiting for one, ms; null where /proc cannot show it (another machine's server, not Linux).
 */
export function processSched(pid: number | null): { runMs: number; waitMs: number } | null {
  const fields = pid === null ? undefined : read(`/proc/${pid}/schedstat`)?.trim().split(" ");
  if (!fields || fields.length < 2) return null;
  return { runMs: Number(fields[0]) / 1e6, waitMs: Number(fields[1]) / 1e6 };
}

/** What was used between two snapshots. */
export function cpuBetween(before: Snapshot, after: Snapshot): CpuUse {
  const use: CpuUse = { serverMs: 0, serverWaitMs: 0, workerMs: 0, workerWaitMs: 0 };
  for (const [pid, now] of after) {
    const then = before.get(pid);
    const run = (now.run - (then?.run ?? 0)) / 1e6;
    const wait = (now.wait - (then?.wait ?? 0)) / 1e6;
    if (now.server) {
      use.serverMs += run;
      use.serverWaitMs += wait;
    } else {
      use.workerMs += run;
      use.workerWaitMs += wait;
    }
  }
  return use;
}
