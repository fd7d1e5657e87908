/** What the soak's processes share: the records' schema, the job payload, the IPC messages. */

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
  | { type: "stopped" };
