/**
 * `node --import tsx bench/ab.ts [commit|dist]...`: an A/B comparison of the contention section's variants
 * between builds of the library, alternating them run by run so that a machine's load falls on each side
 * alike. Each commit is built from its own tree (`git archive`, its `src/` and `sql/`) into
 * `.bench-ab/<commit>/`; `dist` is the working tree's build (`npm run build`). Each run is one
 * `bench/run.ts contention` with BENCH_LIB set to the build and BENCH_ROUNDS=1; after BENCH_AB_RUNS rounds
 * (default 3) it prints every run's figures and their medians per build and variant (a run that failed, e.g.
 * jobs still queued after its time limit on a loaded machine, is left out and said so).
 * BENCH_CONTENTION chooses the variants (default: the line variants and the hot keys). Beside each build's
 * figures stand the floors measured in the same runs (see contention.ts): a lock-statement round trip and
 * the makespan floor.
 *
 * Example: `node --import tsx bench/ab.ts 8961c80 dist` (the default).
 */
import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, symlinkSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const builds = process.argv.slice(2).length > 0 ? process.argv.slice(2) : ["8961c80", "dist"];
const runs = Math.max(1, Number(process.env.BENCH_AB_RUNS ?? 3) || 3);
const variants = process.env.BENCH_CONTENTION ?? "line,lineAddJobs,lineQueue,hotKey,hotKeyLocal";
const log = (message: string): void => void process.stderr.write(`[ab] ${message}\n`);

/** Builds `name` (a commit, or `dist`) and answers its BENCH_LIB, relative to the repository. */
function build(name: string): string {
  const run = (cmd: string, args: string[], cwd = root) =>
    execFileSync(cmd, args, { cwd, stdio: ["ignore", "ignore", "inherit"] });
  if (name === "dist") {
    run("npm", ["run", "build"]);
    return "dist";
  }
  const commit = execFileSync("git", ["rev-parse", "--short", name], { cwd: root })
    .toString()
    .trim();
  const dir = `.bench-ab/${commit}`;
  if (!existsSync(`${root}${dir}/dist/index.js`)) {
    log(`building ${name} (${commit}) into ${dir}`);
    mkdirSync(`${root}${dir}`, { recursive: true });
    const tar = execFileSync(
      "git",
      ["archive", commit, "src", "sql", "tsconfig.json", "tsconfig.build.json"],
      {
        cwd: root,
        maxBuffer: 64 << 20,
      },
    );
    execFileSync("tar", ["-x", "-C", dir], { cwd: root, input: tar });
    if (!existsSync(`${root}${dir}/node_modules`))
      symlinkSync(`${root}node_modules`, `${root}${dir}/node_modules`);
    run("npx", ["tsc", "-p", "tsconfig.build.json", "--outDir", "dist"], `${root}${dir}`);
  }
  return `${dir}/dist`;
}

interface Summary {
  variant: string;
  makespanMs: number;
  makespanOverIdeal: number;
  handoffP50Ms: number;
  handoffP99Ms: number;
  fetchesPerJob: number;
  worstOutOfOrder: number;
  maxPerKey: number;
  executed: number;
  rttP50Ms: number;
  rttMeanMs?: number;
  makespanFloorOverIdeal: number;
  makespanFloorP50OverIdeal?: number;
}

const libs = builds.map((name) => ({ name, lib: build(name) }));
const results: Array<{ build: string; run: number } & Summary> = [];
for (let r = 1; r <= runs; r++) {
  for (const { name, lib } of libs) {
    log(`run ${r}/${runs}: ${name} (BENCH_LIB=${lib})`);
    const child = spawnSync(process.execPath, ["--import", "tsx", "bench/run.ts", "contention"], {
      cwd: root,
      env: { ...process.env, BENCH_LIB: lib, BENCH_ROUNDS: "1", BENCH_CONTENTION: variants },
      stdio: ["ignore", "ignore", "inherit"],
    });
    if (child.status !== 0) {
      log(`run ${r} of ${name} failed (exit ${child.status}): left out`);
      continue;
    }
    const full = JSON.parse(readFileSync(`${root}bench/results.full.json`, "utf8")) as {
      sections: { contention: { figures: { summaries: Summary[] } } };
    };
    for (const s of full.sections.contention.figures.summaries)
      results.push({ ...s, build: name, run: r });
  }
}

const median = (values: number[]): number => {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
};
const fmt = (v: number, digits = 2) => v.toFixed(digits);
process.stdout.write(
  "build | variant | makespan/ideal (runs) | median | floor (mean round trip) | floor (p50 round trip) | hand-off p50 ms | p99 ms | round trip p50 ms (floor of a hand-off) | round trip mean ms | fetches/job | worst out of order | max per key | executed\n",
);
for (const { name } of libs) {
  for (const variant of new Set(results.map((x) => x.variant))) {
    const mine = results.filter((x) => x.build === name && x.variant === variant);
    if (mine.length === 0) continue;
    const m = (f: (x: Summary) => number, digits = 2) => fmt(median(mine.map(f)), digits);
    const row = [
      name,
      variant,
      mine.map((x) => fmt(x.makespanOverIdeal)).join(" "),
      m((x) => x.makespanOverIdeal),
      m((x) => x.makespanFloorOverIdeal ?? NaN),
      m((x) => x.makespanFloorP50OverIdeal ?? NaN),
      m((x) => x.handoffP50Ms),
      m((x) => x.handoffP99Ms),
      m((x) => x.rttP50Ms ?? NaN),
      m((x) => x.rttMeanMs ?? NaN),
      m((x) => x.fetchesPerJob),
      String(Math.max(...mine.map((x) => x.worstOutOfOrder))),
      String(Math.max(...mine.map((x) => x.maxPerKey))),
      m((x) => x.executed, 0),
    ];
    process.stdout.write(`${row.join(" | ")}\n`);
  }
  const line = results.filter((x) => x.build === name && x.variant === "line");
  const queue = results.filter((x) => x.build === name && x.variant === "lineQueue");
  if (line.length > 0 && queue.length > 0) {
    const ratios = line.map((x, i) => x.makespanMs / (queue[i]?.makespanMs ?? NaN));
    process.stdout.write(
      `${name} | line / queueName anchor, same run | ${ratios.map((x) => fmt(x)).join(" ")} | ${fmt(median(ratios))}\n`,
    );
  }
}
