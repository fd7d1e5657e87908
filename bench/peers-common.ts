/**
 * What the two sides of section "peers" (bench/peers.ts) share: the rows' vocabulary, the interface each
 * side implements (bench/peers-pgboss.ts, bench/peers-ours.ts), the job both run, and the analysis of a
 * contended run.
 */
import { now, sleep } from "./lib.js";

/** pg-boss 12's queue policies that take a `singletonKey` (its `standard` has no uniqueness). */
export const POLICIES = ["short", "singleton", "stately", "exclusive"] as const;
export type Policy = (typeof POLICIES)[number];

/** What our side does for each pg-boss policy (see peers-ours.ts; the section's notes say the same). */
export const OUR_MATCH: Record<Policy, string> = {
  short: 'unique: "queued"',
  singleton: "exclusive task, no unique",
  stately: 'exclusive task + unique: "queued"',
  exclusive: 'unique: "active"',
};

export type KeyMode = "fresh" | "duplicate";

export type PeerId = "pg-boss" | "ours";

/** The payload of every job of the section, on both sides. */
export interface PeerPayload {
  /** The key ("singletonKey" on pg-boss's side, the lock and unique key on ours). */
  key: string;
  i: number;
  /** How long the job sleeps, in ms (0: returns at once). */
  ms: number;
}

export interface SendFigures {
  seconds: number;
  opsPerSecond: number;
  /** Jobs stored. */
  added: number;
  /** Sends refused as duplicates. */
  duplicates: number;
}

/** One job's run, in `now()` milliseconds, as the job function saw it. */
export interface JobSpan {
  key: string;
  i: number;
  start: number;
  end: number;
}

export interface ContendedRun {
  spans: JobSpan[];
  /** Jobs (their `i`) that met a held key and were parked (ours: `reschedule`; pg-boss never does). */
  parked: number[];
}

export interface Peer {
  id: PeerId;
  /** What this side runs with, for the tables' notes. */
  settings: string[];
  /** Empties its job table, then sends one job per item of `keys` (sequentially), timed. */
  send(policy: Policy, keys: readonly string[], round: number): Promise<SendFigures>;
  /**
   * Empties its job table, inserts one job per item of `keys` in that order (untimed, in bulk), starts
   * its workers (`concurrency` jobs at once), and resolves every job's span once all have run; the workers are stopped by then.
   */
  contended(keys: readonly string[], jobMs: number, concurrency: number): Promise<ContendedRun>;
  /** Starts idle workers for `pickup`. */
  startIdle(concurrency: number): Promise<void>;
  /** Enqueues one job (key unique to `i`) on the idle workers; resolves ms from before the send to its start. */
  pickup(i: number): Promise<number>;
  stopIdle(): Promise<void>;
  close(): Promise<void>;
}

/**
 * Calls to the job function: starts and ends per job, for contended runs, and a start waiter per job, for
 * pickups. One instance per side.
 */
export class Recorder {
  spans: JobSpan[] = [];
  private readonly startWaiters = new Map<number, (at: number) => void>();
  private doneWaiter: { count: number; resolve(): void } | undefined;

  /** The job function, as both sides run it. */
  readonly run = async (payload: PeerPayload): Promise<void> => {
    const start = now();
    this.startWaiters.get(payload.i)?.(start);
    this.startWaiters.delete(payload.i);
    if (payload.ms > 0) await sleep(payload.ms);
    this.spans.push({ key: payload.key, i: payload.i, start, end: now() });
    if (this.doneWaiter && this.spans.length >= this.doneWaiter.count) this.doneWaiter.resolve();
  };

  /** Clears the spans; resolves once `count` jobs have run (rejects after `timeoutMs`). */
  expect(count: number, timeoutMs: number): Promise<JobSpan[]> {
    this.spans = [];
    return new Promise<JobSpan[]>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.doneWaiter = undefined;
        reject(new Error(`only ${this.spans.length} of ${count} jobs ran within ${timeoutMs} ms`));
      }, timeoutMs);
      this.doneWaiter = {
        count,
        resolve: () => {
          clearTimeout(timer);
          this.doneWaiter = undefined;
          resolve(this.spans);
        },
      };
    });
  }

  /** Resolves when job `i` starts, with the time it started. */
  started(i: number, timeoutMs: number): Promise<number> {
    return new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.startWaiters.delete(i);
        reject(new Error(`job ${i} did not start within ${timeoutMs} ms`));
      }, timeoutMs);
      this.startWaiters.set(i, (at) => {
        clearTimeout(timer);
        resolve(at);
      });
    });
  }
}

/** The keys of a contended run: `perKey` jobs of each of `keys` keys, in a seeded random order. */
export function contendedKeys(keys: number, perKey: number, seed: number): string[] {
  const list: string[] = [];
  for (let k = 0; k < keys; k++) for (let j = 0; j < perKey; j++) list.push(`k${k}`);
  // Fisher–Yates with mulberry32, so that every run and both sides see the same order.
  let state = seed >>> 0;
  const random = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  for (let i = list.length - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [list[i], list[j]] = [list[j]!, list[i]!];
  }
  return list;
}

export interface ContendedAnalysis {
  jobs: number;
  /** Distinct jobs that ran (must equal `jobs`: none lost, none run twice). */
  distinct: number;
  /** First start to last end, in ms. */
  makespanMs: number;
  /** The busiest key's jobs × the job's duration, in ms. */
  idealMs: number;
  /** Per key, from the end of one job to the start of the next, in ms. */
  gaps: number[];
  /** Jobs of one key that started before the previous one of the key ended (must be 0). */
  overlaps: number;
}

export function analyse(spans: readonly JobSpan[], jobMs: number): ContendedAnalysis {
  const byKey = new Map<string, JobSpan[]>();
  for (const s of spans) {
    const list = byKey.get(s.key);
    if (list) list.push(s);
    else byKey.set(s.key, [s]);
  }
  const gaps: number[] = [];
  let overlaps = 0;
  let busiest = 0;
  for (const list of byKey.values()) {
    busiest = Math.max(busiest, list.length);
    list.sort((a, b) => a.start - b.start);
    for (let j = 1; j < list.length; j++) {
      const gap = list[j]!.start - list[j - 1]!.end;
      if (gap < 0) overlaps++;
      gaps.push(gap);
    }
  }
  const starts = spans.map((s) => s.start);
  const ends = spans.map((s) => s.end);
  return {
    jobs: spans.length,
    distinct: new Set(spans.map((s) => s.i)).size,
    makespanMs: Math.max(...ends) - Math.min(...starts),
    idealMs: busiest * jobMs,
    gaps,
    overlaps,
  };
}

/** The `p`-th percentile (0–100), nearest rank. */
export function percentile(values: readonly number[], p: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.min(sorted.length, Math.max(1, Math.ceil((p / 100) * sorted.length)));
  return sorted[rank - 1]!;
}
