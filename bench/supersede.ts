/**
 * Section "supersede": how soon a superseding enqueue stops the job running for its key in another process,
 * and how soon the new job starts once the old one lets go (method: bench/README.md, "Supersede"). Two
 * worker processes (supersede-worker.ts) run a `reschedule` task; this process enqueues. Each round runs one
 * key, in one of two variants, alternating (A B, then B A):
 * - A, supersede: the old job runs until its signal fires; the new job is enqueued with `supersede: true`.
 *   Measured: enqueue → the old job's signal (its start of the enqueue call to the signal firing, machine
 *   clock), and the old job's return → the new job's start.
 * - B, line: the old job runs OLD_MS and returns on its own; the new job is enqueued meanwhile without
 *   supersede, parks, and is woken by the release. Measured: the old job's return → the new job's start,
 *   the hand-off supersede relies on, as a reference.
 */
import { fmtFixed, goal, machineClock as clock, median, percentile, sleep, table } from "./lib.js";
import { withWorkers, waitUntilNoJobs, type BenchContext, type Section } from "./lib.js";
import { library } from "./library.js";
import {
  SUPERSEDE_TASK,
  supersedeOptions,
  type SupersedeMark,
  type SupersedeRequest,
} from "./supersede-worker.js";

const OLD_MS = 300;
const ROUNDS = { full: 30, quick: 3 };
type Variant = "supersede" | "line";

export const supersede: Section = {
  id: "supersede",
  title: "Supersede: stop the running job, start the new one",
  async run(ctx: BenchContext) {
    const rounds = ctx.quick ? ROUNDS.quick : ROUNDS.full;
    const locks = library.makeLocks({ connectionString: ctx.url, logger: undefined });
    locks.define(SUPERSEDE_TASK, { ...supersedeOptions, exclusive: true });
    const figures = {
      stopMs: [] as number[],
      startMs: [] as number[],
      lineStartMs: [] as number[],
    };
    try {
      await withWorkers(
        new URL("./supersede-worker.ts", import.meta.url),
        2,
        { DATABASE_URL: ctx.url },
        async (workers) => {
          const startedJobs = new Set<string>();
          for (const w of workers) {
            w.onEvent = (event, data) => {
              if (event === "started") startedJobs.add(String(data));
            };
          }
          const waitStarted = async (jobId: string) => {
            const deadline = clock() + 30_000;
            while (!startedJobs.has(jobId)) {
              if (clock() > deadline) throw new Error(`job ${jobId} did not start`);
              await sleep(2);
            }
          };
          const order: Variant[] = [];
          for (let i = 0; i < rounds; i++)
            order.push(
              ...((i % 2 === 0 ? ["supersede", "line"] : ["line", "supersede"]) as Variant[]),
            );
          for (const [i, variant] of order.entries()) {
            await Promise.all(
              workers.map((w) => w.request({ type: "reset" } satisfies SupersedeRequest)),
            );
            const k = `r${i}`;
            const ms = variant === "supersede" ? 30_000 : OLD_MS;
            const old = (await locks.addJob(SUPERSEDE_TASK, { k, ms }, { supersede: false })).job!;
            await waitStarted(old.id);
            const t0 = clock();
            const added = await locks.addJob(
              SUPERSEDE_TASK,
              { k, ms: 0 },
              { supersede: variant === "supersede" },
            );
            await waitUntilNoJobs(ctx.pool, 60_000);
            const marks = (
              await Promise.all(workers.map((w) => w.request<SupersedeMark[]>({ type: "collect" })))
            ).flat();
            const first = marks.find((m) => m.jobId === old.id);
            const next = marks.find((m) => m.jobId !== old.id);
            if (!first || !next)
              throw new Error(`round ${i}: ${marks.length} execution(s) recorded`);
            if (next.start < first.end)
              throw new Error(`round ${i}: the new job overlapped the old`);
            if (variant === "supersede") {
              if (first.reason !== "GWL_SUPERSEDED" || first.aborted === null)
                throw new Error(`round ${i}: the old job was not superseded (${first.reason})`);
              figures.stopMs.push(first.aborted - t0);
              figures.startMs.push(next.start - first.end);
            } else figures.lineStartMs.push(next.start - first.end);
            void added;
          }
        },
      );
    } finally {
      await locks.release();
    }
    const row = (label: string, values: number[]) => [
      label,
      String(values.length),
      fmtFixed(median(values), 1),
      fmtFixed(percentile(values, 90), 1),
      fmtFixed(Math.max(...values), 1),
    ];
    const stopP50 = median(figures.stopMs);
    const startP50 = median(figures.startMs);
    return {
      tables: [
        table(
          "Supersede across processes (ms, machine clock; A and B alternate)",
          "measure | rounds | p50 | p90 | max",
          [
            row("A supersede: enqueue → old job's signal", figures.stopMs),
            row("A supersede: old job returns → new job starts", figures.startMs),
            row("B line: old job returns → next job starts", figures.lineStartMs),
          ],
          [
            "2 worker processes (concurrency 4, attached); the enqueuer is a third process.",
            "Figures under this machine's shared load are weak: compare A with B rather than read them alone.",
          ],
        ),
      ],
      goals: [
        goal("stop p50", "enqueue → signal p50 ≤ 100 ms", stopP50, stopP50 <= 100),
        goal("start p50", "release → new job p50 ≤ 50 ms", startP50, startP50 <= 50),
      ],
      figures,
    };
  },
};
