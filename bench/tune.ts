/**
 * `node --import tsx bench/tune.ts`: the sweep behind configuration B of the throughput section. Measures
 * plain graphile-worker (no wrapper) at concurrency 24 over local queue sizes, completion batch delays and
 * pool sizes, to pick the settings at which plain is at its best (wrapped is then measured with the same).
 * Not part of `npm run bench`; rerun it on a new machine before trusting B's settings there.
 *
 * TUNE_JOBS (default 60000) jobs per run, TUNE_REPEAT (default 2) runs per setting, median reported.
 */
import { formatTable, fmtInt, median, openBench } from "./lib.js";
import { measure, openVariants, type WorkerPreset } from "./throughput.js";

const log = (message: string): void => {
  process.stderr.write(`[tune] ${message}\n`);
};
const jobs = Number(process.env.TUNE_JOBS ?? 60_000);
const repeat = Number(process.env.TUNE_REPEAT ?? 2);
const concurrency = 24;

interface Setting {
  label: string;
  worker: WorkerPreset;
  maxPoolSize?: number;
}

const bench = await openBench(log, false);
const { variants, close } = await openVariants(bench.ctx);
const plain = variants.find((v) => v.id === "plain")!;
const rows: string[][] = [];

async function score(setting: Setting): Promise<number> {
  const rates: number[] = [];
  for (let i = 0; i < repeat; i++) {
    const worker: WorkerPreset = {
      ...setting.worker,
      ...(setting.maxPoolSize ? { maxPoolSize: setting.maxPoolSize } : {}),
    };
    const r = await measure(bench.ctx, { id: "tune", concurrency, worker }, plain, jobs, i + 1);
    rates.push(r.jobsPerSecond);
  }
  const m = median(rates);
  log(`${setting.label}: ${fmtInt(m)} jobs/s (${rates.map(fmtInt).join(", ")})`);
  rows.push([setting.label, fmtInt(m), rates.map(fmtInt).join(", ")]);
  return m;
}

async function best(settings: Setting[]): Promise<Setting> {
  let top = settings[0]!;
  let topScore = -1;
  for (const s of settings) {
    const m = await score(s);
    if (m > topScore) [top, topScore] = [s, m];
  }
  return top;
}

try {
  // Warm-up (not reported).
  await measure(bench.ctx, { id: "tune", concurrency, worker: {} }, plain, 10_000, 0);
  await score({ label: "no local queue, no batching (defaults)", worker: {} });
  // 1. Local queue size, with completion batched in the same tick.
  const sizes = [24, 100, 250, 500, 1000, 2000];
  const bySize = await best(
    sizes.map((size) => ({
      label: `localQueue ${size}, completeJobBatchDelay 0`,
      worker: { localQueue: { size }, completeJobBatchDelay: 0, failJobBatchDelay: 0 },
    })),
  );
  const size = bySize.worker.localQueue!.size;
  // 2. Completion batch delay at that size.
  const byDelay = await best(
    [-1, 0, 1, 2, 5, 10].map((delay) => ({
      label: `localQueue ${size}, completeJobBatchDelay ${delay}`,
      worker: { localQueue: { size }, completeJobBatchDelay: delay, failJobBatchDelay: delay },
    })),
  );
  // 3. Pool size (default 10, below the concurrency of 24).
  await best(
    [10, 26].map((maxPoolSize) => ({
      label: `${byDelay.label}, maxPoolSize ${maxPoolSize}`,
      worker: byDelay.worker,
      maxPoolSize,
    })),
  );
  process.stdout.write(
    `\n${formatTable({
      title: `Plain graphile-worker, concurrency ${concurrency}, ${fmtInt(jobs)} no-op jobs per run, median of ${repeat}`,
      columns: [
        { header: "setting", align: "left" },
        { header: "jobs/s" },
        { header: "runs", align: "left" },
      ],
      rows,
    })}\n`,
  );
} finally {
  await close();
  await bench.close();
}
