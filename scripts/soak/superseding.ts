/**
 * The soak's superseding task, `soak_super`: `reschedule`, one job per key `k` at a time, `supersede: true`.
 * The enqueuer adds one for every SUPER.every-th of its enqueues, through `addJob` with the task's option or
 * `supersede: false`, or through `addJobs` (a plain item and a superseding one of the same key), and writes
 * in the same transaction the enqueue (`super_enqueues`) and the ids of the waiting jobs it removed
 * (`super_removed`). Executions are recorded with the other tasks' (`soak_super:<k>`, so the soak's overlap
 * check covers the key); a worker also records the task's `job:superseded` events (a job stopped running,
 * or ended on its way to the key) and the copies its jobs left (`job:deferred`; parks are recorded for
 * every task as `rescheduled`), so that a removed copy is traced back to its enqueue.
 *
 * `supersedeViolations` counts: an enqueue whose job neither ran to its end nor was superseded (stopped,
 * ended on its way, or removed waiting), and a superseded job that failed or ran again after it was superseded
 * (an attempt that failed before, for the chaos, is graphile-worker's retry, which then ends superseded).
 * Overlaps of a key are the soak's own check.
 */
import type { JobHelpers, Task } from "graphile-worker";
import type pg from "pg";
import type { Locks } from "../../src/index.js";
import { SOAK_SCHEMA, type SoakPayload } from "./shared.js";

export const SUPER = { task: "soak_super", keys: 3, every: 3 };

const RULES = {
  onConflict: "reschedule",
  supersede: true,
  key: (p: SoakPayload) => p.k,
  reschedule: { minDelay: 20, maxDelay: 200 },
} as const;

/** The tables of superseding enqueues and the jobs they removed (created with the soak's records). */
export const SUPER_SCHEMA = `create table ${SOAK_SCHEMA}.super_enqueues (
  ref text primary key, job_id bigint not null);
  create table ${SOAK_SCHEMA}.super_removed (job_id bigint primary key, by_ref text not null);`;

/** The task; `body(label, ...)` records an execution under `<label>:<k>`, `record` writes an event. */
export function supersedeTask(
  locks: Locks,
  body: (label: string, payload: SoakPayload, helpers: JobHelpers) => Promise<void>,
  record: (text: string, values: unknown[]) => void,
): Record<string, Task> {
  const event = (kind: string, jobId: string, ref: string, detail: string) =>
    record(
      `insert into ${SOAK_SCHEMA}.events (kind, job_id, ref, detail) values ($1, $2, $3, $4)`,
      [kind, jobId, ref, detail],
    );
  locks.events.on("job:superseded", ({ taskIdentifier, jobId, job, state }) => {
    if (taskIdentifier === SUPER.task && job) {
      event("superseded", jobId, (job.payload as SoakPayload).ref, state);
    }
  });
  locks.events.on("job:deferred", ({ taskIdentifier, job, newJobId }) => {
    if (taskIdentifier === SUPER.task) {
      event("super:deferred", job.id, (job.payload as SoakPayload).ref, newJobId);
    }
  });
  return {
    [SUPER.task]: locks.exclusive<SoakPayload>(SUPER.task, (p, h) => body(SUPER.task, p, h), RULES),
  };
}

/** Registers the task's rules for the enqueuer. */
export function defineSupersedeTask(locks: Locks): void {
  locks.define(SUPER.task, { ...RULES, exclusive: true });
}

/**
 * For every SUPER.every-th enqueue `n`: adds a job of the task (two with `addJobs`), with its records, in
 * one transaction; retried until its record exists, for up to 20 s after `until` (PostgreSQL may restart).
 */
export async function enqueueSuperseding(
  locks: Locks,
  pool: pg.Pool,
  n: number,
  until: number,
): Promise<void> {
  if (n % SUPER.every !== 0) return;
  const i = n / SUPER.every;
  const k = `s${i % SUPER.keys}`;
  const ms = 40 + (i % 5) * 30;
  const ref = `s${i}`;
  for (;;) {
    let client: pg.PoolClient | undefined;
    try {
      client = await pool.connect();
      const done = await client.query(
        `select 1 from ${SOAK_SCHEMA}.super_enqueues where ref = $1 or ref = $2`,
        [ref, `${ref}b`],
      );
      if (done.rowCount) return client.release();
      await client.query("begin");
      // Three ways in turn: the task's option, `supersede: false`, and a bulk of a plain and a superseding item.
      const results =
        i % 3 === 2
          ? await locks.addJobs(
              [
                { identifier: SUPER.task, payload: { k, ms, ref }, supersede: false },
                { identifier: SUPER.task, payload: { k, ms, ref: `${ref}b` } },
              ],
              { pgClient: client },
            )
          : [
              await locks.addJob(
                SUPER.task,
                { k, ms, ref },
                {
                  pgClient: client,
                  supersede: i % 3 === 0,
                },
              ),
            ];
      for (const [j, result] of results.entries()) {
        const itemRef = j === 0 ? ref : `${ref}b`;
        await client.query(
          `insert into ${SOAK_SCHEMA}.super_enqueues (ref, job_id) values ($1, $2)`,
          [itemRef, result.job!.id],
        );
        for (const removed of result.superseded ?? []) {
          await client.query(
            `insert into ${SOAK_SCHEMA}.super_removed (job_id, by_ref) values ($1, $2)`,
            [removed, itemRef],
          );
        }
      }
      await client.query("commit");
      client.release();
      return;
    } catch (error) {
      client?.release(true);
      if (Date.now() > until + 20_000) throw error;
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }
}

/** The violations of the superseding task, and what became of its jobs. */
export async function supersedeViolations(admin: pg.Pool): Promise<{
  counts: Record<string, number>;
  violations: string[];
}> {
  const { rows } = await admin.query<{ ref: string; fate: string; retried: boolean }>(
    `with recursive ids (ref, job_id) as (
       select ref, job_id from ${SOAK_SCHEMA}.super_enqueues
       union
       select ids.ref, e.detail::bigint from ids
       join ${SOAK_SCHEMA}.events e on e.job_id = ids.job_id and e.kind in ('rescheduled', 'super:deferred')
     ), superseded as (
       select e.ref, e.job_id, e.at from ${SOAK_SCHEMA}.events e where e.kind = 'superseded'
     )
     select s.ref,
       case
         when exists (select 1 from ${SOAK_SCHEMA}.executions x
           where x.ref = s.ref and x.ended_at is not null and x.aborted is null) then 'ran'
         when exists (select 1 from superseded p where p.ref = s.ref) then 'stopped'
         when exists (select 1 from ids join ${SOAK_SCHEMA}.super_removed r on r.job_id = ids.job_id
           where ids.ref = s.ref) then 'removed'
         else 'lost'
       end as fate,
       exists (select 1 from superseded p
         where p.ref = s.ref and (
           exists (select 1 from ${SOAK_SCHEMA}.executions x
             where x.job_id = p.job_id and x.started_at > p.at)
           or exists (select 1 from ${SOAK_SCHEMA}.job_errors j
             where j.job_id = p.job_id and j.at > p.at))) as retried
     from ${SOAK_SCHEMA}.super_enqueues s`,
  );
  const counts: Record<string, number> = { enqueued: rows.length, retried: 0 };
  for (const row of rows) {
    counts[row.fate] = (counts[row.fate] ?? 0) + 1;
    if (row.retried) counts.retried!++;
  }
  const violations: string[] = [];
  const lost = rows.filter((r) => r.fate === "lost").map((r) => r.ref);
  if (lost.length > 0) {
    violations.push(
      `${lost.length} soak_super job(s) neither ran nor were superseded: ${lost.slice(0, 10).join(", ")}`,
    );
  }
  if (counts.retried! > 0) {
    violations.push(`${counts.retried} superseded soak_super job(s) failed or ran again`);
  }
  return { counts, violations };
}
