/**
 * A `reschedule` task on one key ("one key") whose jobs (payload `n`) record their span on the machine
 * clock: a gated job runs until `gate` resolves (at the latest when the test ends, through `cleanups`), any
 * other for `ms`. `options` are added to the task's (a lock group, the reschedule delays).
 */
import { setTimeout as sleep } from "node:timers/promises";
import type { ExclusiveOptions, Locks } from "../../src/index.js";
import { deferred } from "./db.js";

type Payload = { n: number; gated?: boolean };

export function spannedTask(
  cleanups: Array<() => Promise<unknown>>,
  locks: Locks,
  identifier: string,
  ms: number,
  options: Omit<ExclusiveOptions<Payload>, "key" | "onConflict"> = {},
) {
  const gate = deferred();
  cleanups.push(async () => gate.resolve());
  const spans = new Map<number, { start: number; end: number | null }>();
  const task = locks.exclusive(
    identifier,
    async (p: Payload) => {
      const span = { start: performance.now(), end: null as number | null };
      spans.set(p.n, span);
      await (p.gated ? gate.promise : sleep(ms));
      span.end = performance.now();
    },
    { ...options, key: () => "one key", onConflict: "reschedule" },
  );
  return { task, spans, gate };
}
