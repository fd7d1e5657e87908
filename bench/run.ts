/**
 * `npm run bench [-- <section id>...]`: starts PostgreSQL once (lib.ts's openBench), runs the sections,
 * prints their tables and goals, and writes the summary of the run (machine, commit, every goal and every
 * printed row) to bench/results.json, or to bench/results.partial.json after a quick run (BENCH_QUICK=1,
 * small job counts) or a partial one (some sections, BENCH_CONTENTION, BENCH_LATENCY). Every figure of
 * every run goes to bench/results.full.json (not committed). A missed goal is reported, not failed: the
 * exit code is non-zero only when something broke. A section is a module exporting a `Section` (lib.ts),
 * listed in SECTIONS.
 */
import { fileURLToPath } from "node:url";
import { describeMachine, fmtFixed, formatTable, now, openBench, summaryRows } from "./lib.js";
import { writeJsonAtomic, type Goal, type Section } from "./lib.js";
import { throughput } from "./throughput.js";
import { contention } from "./contention.js";
import { enqueue } from "./enqueue.js";
import { peers } from "./peers.js";
import { latency } from "./latency.js";
import { limits } from "./limits.js";
import { supersede } from "./supersede.js";
import { rates } from "./rates.js";
import { statements } from "./statements.js";

const SECTIONS: Section[] = [
  throughput,
  contention,
  enqueue,
  peers,
  latency,
  limits,
  supersede,
  rates,
  statements,
];

const quick = !["", "0", "false"].includes(process.env.BENCH_QUICK ?? "");
const log = (message: string): void => void process.stderr.write(`[bench] ${message}\n`);
const print = (text: string): void => void process.stdout.write(`${text}\n`);

async function main(): Promise<void> {
  const wanted = process.argv.slice(2);
  const unknown = wanted.filter((id) => !SECTIONS.some((s) => s.id === id));
  if (unknown.length > 0) {
    const known = SECTIONS.map((s) => s.id).join(", ");
    throw new Error(`Unknown section(s): ${unknown.join(", ")}. Known: ${known}`);
  }
  const sections = wanted.length > 0 ? SECTIONS.filter((s) => wanted.includes(s.id)) : SECTIONS;
  // Only a full run replaces results.json (the figures the README quotes).
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
    print(describeMachine(machine));
    const figures: Record<string, { title: string; seconds: number; figures: unknown }> = {};
    const rows: Record<string, string[]> = {};
    const goals: Goal[] = [];
    for (const section of sections) {
      log(`section ${section.id}: ${section.title}`);
      const t0 = now();
      const result = await section.run(ctx);
      const seconds = Math.round(now() - t0) / 1000;
      figures[section.id] = { title: section.title, seconds, figures: result.figures };
      goals.push(...result.goals.map((g) => ({ ...g, section: section.id })));
      for (const table of result.tables) {
        print(`\n${formatTable(table)}`);
        rows[table.title] = summaryRows(table);
      }
    }
    const goalLines = goals.map(
      (g) =>
        `${g.met ? "met   " : "MISSED"}  ${g.section} ${g.name}: ${g.target}, measured ${fmtFixed(g.value, 2)}`,
    );
    if (goals.length > 0)
      print(`\nGoals (reported, not enforced)\n${goalLines.map((l) => `  ${l}\n`).join("")}`);
    const seconds = Math.round(now() - started) / 1000;
    print(
      `${goals.length > 0 ? "" : "\n"}Total time: ${seconds.toFixed(1)} s${quick ? " (BENCH_QUICK)" : ""}`,
    );
    const run = { date: machine.date, commit: machine.commit, machine: describeMachine(machine) };
    await writeJsonAtomic(summaryFile, { ...run, quick, seconds, goals: goalLines, rows });
    await writeJsonAtomic(fullFile, { quick, seconds, machine, goals, sections: figures });
    log(`wrote ${fileURLToPath(summaryFile)} and ${fileURLToPath(fullFile)}`);
  } finally {
    await bench.close();
  }
}

main().then(
  // Nothing else should keep the process alive; do not wait for stray timers of the code under test.
  () => process.exit(process.exitCode ?? 0),
  (error: unknown) => {
    log(`failed: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}`);
    process.exit(1);
  },
);
