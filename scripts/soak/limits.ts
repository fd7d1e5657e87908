/**
 * The soak's composed limits: `soak_stacked`, with two limits (one job per key `k`, and at most
 * STACKED_CAP in all, a limit of the group `soak-cap`), and `soak_grp_a` and `soak_grp_b`, two tasks sharing
 * the lock group `soak-shared` (one job per key across both). All `reschedule`, so every job must run.
 *
 * Their executions are recorded under a lock key that names what must not overlap: `soak_stacked:<k>`,
 * and `soak-shared:<k>` for both group tasks, so the soak's overlap check per key covers the key limit and
 * the group; `limitsViolations` counts the times the cap was exceeded.
 */
import type { JobHelpers, Task } from "graphile-worker";
import type { ExclusiveOptions, Locks } from "../../src/index.js";
import type { SoakPayload } from "./shared.js";

export const STACKED_CAP = 2;
export const LIMITS_TASKS = ["soak_stacked", "soak_grp_a", "soak_grp_b"] as const;

const reschedule = { minDelay: 20, maxDelay: 200 };
const RULES: Record<(typeof LIMITS_TASKS)[number], ExclusiveOptions<SoakPayload>> = {
  soak_stacked: {
    onConflict: "reschedule",
    limits: [{ key: (p) => p.k }, { key: () => "all", limit: STACKED_CAP, group: "soak-cap" }],
    reschedule,
  },
  soak_grp_a: { onConflict: "reschedule", lockGroup: "soak-shared", key: (p) => p.k, reschedule },
  soak_grp_b: { onConflict: "reschedule", lockGroup: "soak-shared", key: (p) => p.k, reschedule },
};
/** What each task's executions are recorded as (`<label>:<k>` is the key they must not overlap on). */
const LABEL = {
  soak_stacked: "soak_stacked",
  soak_grp_a: "soak-shared",
  soak_grp_b: "soak-shared",
};

/** The tasks for a worker's task list; `body(label, ...)` records an execution under `<label>:<k>`. */
export function limitsTasks(
  locks: Locks,
  body: (label: string, payload: SoakPayload, helpers: JobHelpers) => Promise<void>,
): Record<string, Task> {
  return Object.fromEntries(
    LIMITS_TASKS.map((task) => [
      task,
      locks.exclusive<SoakPayload>(task, (p, h) => body(LABEL[task], p, h), RULES[task]),
    ]),
  );
}

/** Registers the tasks' rules for the enqueuer. */
export function defineLimitsTasks(locks: Locks): void {
  for (const task of LIMITS_TASKS) locks.define(task, { ...RULES[task], exclusive: true } as never);
}

/**
 * How many times a `soak_stacked` execution started while STACKED_CAP others ran, not counting those that
 * had lost their lock (aborted `lock:lost`: their key went with their session), as violations.
 */
export function limitsViolations(
  executions: ReadonlyArray<{
    lockKey: string;
    start: bigint;
    end: bigint | null;
    aborted: string | null;
  }>,
): string[] {
  const runs = executions
    .filter((e) => e.lockKey.startsWith("soak_stacked:") && e.aborted !== "lock:lost")
    .map((e) => ({ start: e.start, end: e.end ?? e.start }))
    .sort((a, b) => (a.start < b.start ? -1 : a.start > b.start ? 1 : 0));
  let excess = 0;
  for (let i = 0; i < runs.length; i++) {
    let open = 0;
    for (let j = 0; j < i; j++) if (runs[j]!.end > runs[i]!.start) open++;
    if (open >= STACKED_CAP) excess++;
  }
  return excess > 0
    ? [`${excess} soak_stacked execution(s) started beyond its cap of ${STACKED_CAP}`]
    : [];
}
