/**
 * `npm run bench [-- <section id>...]`: starts PostgreSQL once (DATABASE_URL if set, else an embedded
 * server in a temp directory), creates a throwaway database on it, runs the sections, prints their tables
 * and goals, and writes a summary (every printed row and goal) to bench/results.json, or to
 * bench/results.partial.json when only some sections or variants ran or with BENCH_QUICK=1 (which shrinks
 * the job counts for a smoke run). Every figure of every run, with the machine's description, goes to
 * bench/results.full.json (not committed).
 *
 * BENCH_ROUNDS: measured rounds per configuration (default 3). BENCH_LIB=src: measure src/ through tsx
 * rather than the build in dist/ (which `npm run bench` builds first); see library.ts.
 *
 * A missed goal is reported, not failed: the exit code is non-zero only when something broke.
 *
 * To add a section: write a module exporting a `Section` (see lib.ts) and list it in SECTIONS.
 */
import { fileURLToPath } from "node:url";
import {
  describeMachine,
  fmtFixed,
  formatTable,
  now,
  summaryRows,
  openBench,
  writeJsonAtomic,
  type Goal,
  type Section,
} from "./lib.js";
import { throughput } from "./throughput.js";
import { contention } from "./contention.js";
import { enqueue } from "./enqueue.js";
import { peers } from "./peers.js";
import { latency } from "./latency.js";

const SECTIONS: Section[] = [throughput, contention, enqueue, peers, latency];

const quick = !["", "0", "false"].includes(process.env.BENCH_QUICK ?? "");
const log = (message: string): void => {
  process.stderr.write(`[bench] ${message}\n`);
};

async function main(): Promise<void> {
  const wanted = process.argv.slice(2);
  const unknown = wanted.filter((id) => !SECTIONS.some((s) => s.id === id));
  if (unknown.length > 0) {
    throw new Error(
      `Unknown section(s): ${unknown.join(", ")}. Known: ${SECTIONS.map((s) => s.id).join(", ")}`,
    );
  }
  const sections = wanted.length > 0 ? SECTIONS.filter((s) => wanted.includes(s.id)) : SECTIONS;
  // Only a full run replaces results.json (the figures the README quotes); a part of one goes beside it.
  const partial =
    quick ||
    sections.length < SECTIONS.length ||
    process.env.BENCH_CONTENTION !== undefined ||
    process.env.BENCH_LATENCY !== undefined;
  const summaryFile = new URL(
    partial ? "./results.partial.json" : "./results.json",
    import.meta.url,
  );
  const fullFile = new URL("./results.full.json", import.meta.url);

  const started = now();
  const bench = await openBench(log, quick);
  try {
    const { ctx, machine } = bench;
    process.stdout.write(`${describeMachine(machine)}\n`);
    const results: Record<string, { title: string; seconds: number; figures: unknown }> = {};
    const rows: Record<string, string[]> = {};
    const goals: Goal[] = [];
    for (const section of sections) {
      log(`section ${section.id}: ${section.title}`);
      const t0 = now();
      const result = await section.run(ctx);
      const seconds = Math.round(now() - t0) / 1000;
      results[section.id] = { title: section.title, seconds, figures: result.figures };
      goals.push(...result.goals);
      for (const table of result.tables) {
        process.stdout.write(`\n${formatTable(table)}\n`);
        rows[table.title] = summaryRows(table);
      }
    }

    const goalLines = goals.map(
      (g) =>
        `${g.met ? "met   " : "MISSED"}  ${g.section} ${g.name}: ${g.target}, measured ${fmtFixed(g.value, 2)}`,
    );
    if (goals.length > 0) {
      process.stdout.write("\nGoals (reported, not enforced)\n");
      for (const line of goalLines) process.stdout.write(`  ${line}\n`);
    }
    const seconds = Math.round(now() - started) / 1000;
    process.stdout.write(`\nTotal time: ${seconds.toFixed(1)} s${quick ? " (BENCH_QUICK)" : ""}\n`);
    const run = { date: machine.date, commit: machine.commit, machine: describeMachine(machine) };
    await writeJsonAtomic(summaryFile, { ...run, quick, seconds, goals: goalLines, rows });
    await writeJsonAtomic(fullFile, { quick, seconds, machine, goals, sections: results });
    log(`wrote ${fileURLToPath(summaryFile)} and ${fileURLToPath(fullFile)}`);
  } finally {
    await bench.close();
  }
}

main().then(
  () => {
    // Nothing else should keep the process alive; do not wait for stray timers of the code under test.
    process.exit(process.exitCode ?? 0);
  },
  (error: unknown) => {
    process.stderr.write(
      `[bench] failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`,
    );
    process.exit(1);
  },
);
