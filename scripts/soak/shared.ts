/** What the soak's processes share: the records' schema, the job payload, the IPC messages, pools and logs. */
import { Logger } from "graphile-worker";
import pg from "pg";

/** The schema of the soak's records (created by scripts/soak.ts). */
export const SOAK_SCHEMA = "gwl_soak";

export interface SoakPayload {
  /** The lock key. */
  k: string;
  /** The enqueue this job comes from (kept by rescheduled copies). */
  ref: string;
  /** How long an execution takes. */
  ms: number;
}

export type SoakMessage =
  | { type: "ready"; pid: number }
  | { type: "workerId"; workerId: string }
  | { type: "lost"; at: number; holds: number; code: string | null }
  | { type: "connected"; at: number }
  | { type: "completed"; jobId: string; attempts: number; failed: boolean }
  | { type: "status"; at: number; status: SoakWorkerStatus }
  | { type: "stopped" };

/** What a worker process is doing, as the soak asks after the restart. */
export interface SoakWorkerStatus {
  /** The lock session's state, and the keys this process holds. */
  session: string;
  held: number;
  /** Jobs waiting for the lock session, and being given back, in the wrapper. */
  waitingForSession: number;
  givingBack: number;
  /** Jobs graphile-worker started and has not completed. */
  running: number;
  /** Jobs this process started since it was asked last. */
  startedSinceLast: number;
}

/** A pool whose errors (a server-side disconnection of an idle or a busy client) are ignored, never thrown. */
export function makePool(config: pg.PoolConfig): pg.Pool {
  const pool = new pg.Pool(config);
  pool.on("error", () => undefined);
  pool.on("connect", (client) => client.on("error", () => undefined));
  return pool;
}

/**
 * The logger of the soak's processes: silent (job failures are recorded and counted in the report), or,
 * with SOAK_VERBOSE=1, warnings and errors on stderr.
 */
export function soakLogger(prefix: string): Logger {
  if (process.env.SOAK_VERBOSE !== "1") return new Logger(() => () => undefined);
  return new Logger(() => (level, message) => {
    if (level === "error" || level === "warning") console.error(`${prefix} ${level}: ${message}`);
  });
}
