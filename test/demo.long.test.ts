/**
 * `npm run demo` end to end: scripts/demo.ts in a child process, against this file's fresh database
 * (DATABASE_URL), which already holds graphile-worker's and this library's schemas: the demo must not
 * assume it owns the database.
 */
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { expect, test } from "vitest";
import { useTestDatabase } from "./support/db.js";

const db = useTestDatabase();
const ROOT = fileURLToPath(new URL("..", import.meta.url));

interface DemoRun {
  code: number | null;
  signal: NodeJS.Signals | null;
  output: string;
}

/** Runs the demo as `npm run demo` does; kills it if it is still running after `timeoutMs`. */
function runDemo(url: string, timeoutMs: number): Promise<DemoRun> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ["--import", "tsx", "scripts/demo.ts"], {
      cwd: ROOT,
      env: { ...process.env, DATABASE_URL: url, NO_COLOR: "1" },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let output = "";
    child.stdout.on("data", (chunk: Buffer) => (output += chunk.toString()));
    child.stderr.on("data", (chunk: Buffer) => (output += chunk.toString()));
    // SIGTERM first: the demo then stops its workers and cleans up; SIGKILL if even that hangs.
    const term = setTimeout(() => child.kill("SIGTERM"), timeoutMs);
    const kill = setTimeout(() => child.kill("SIGKILL"), timeoutMs + 10_000);
    child.once("error", reject);
    child.once("close", (code, signal) => {
      clearTimeout(term);
      clearTimeout(kill);
      resolve({ code, signal, output });
    });
  });
}

test(
  "npm run demo exits 0: no key above its limit, every job accounted for",
  { timeout: 60_000 },
  async () => {
    // (the demo stops itself; 45 s is a bound for a hung run, not a speed target)
    const { code, signal, output } = await runDemo(db.url, 45_000);

    expect({ code, signal }, output).toEqual({ code: 0, signal: null });
    expect(output).toContain("PostgreSQL: DATABASE_URL");
    for (const line of [
      /^ {2}enqueued: +\d+ jobs fired, \d+ added$/m,
      /^ {2}dropped at enqueue: +\d+ /m,
      /^ {2}conflicts at run time: +\d+ \(dropped \d+, rescheduled \d+, raised \d+\)$/m,
      /^ {2}executed: +\d+ \(worker 1: \d+, worker 2: \d+, worker 3: \d+\)$/m,
      /^ {2}accounted for: +\d+ jobs = /m,
      /^OK: no key ran more jobs at once than its limit, and every job is accounted for/m,
    ]) {
      expect(output).toMatch(line);
    }
    expect(output).not.toContain("DEMO FAILED");

    // One "highest concurrency" line per key: 1 for every limit-1 key, and never above the limit.
    const figures = [
      ...output.matchAll(/^ {2}highest concurrency +(\S+) +(\S+) +(\d+) \(limit (\d+)\)/gm),
    ].map(([, task, key, highest, limit]) => ({
      key: `${task} ${key}`,
      highest: Number(highest),
      limit: Number(limit),
    }));
    expect(figures.length, output).toBeGreaterThanOrEqual(8);
    for (const { key, highest, limit } of figures) {
      if (limit === 1) expect(highest, key).toBe(1);
      else expect(highest, key).toBeLessThanOrEqual(limit);
    }
    expect(figures.filter((f) => f.limit === 1).length).toBeGreaterThanOrEqual(8);

    // The demo really contended (or it demonstrates nothing), and left no job behind.
    const conflicts = Number(/conflicts at run time: +(\d+)/.exec(output)?.[1]);
    expect(conflicts).toBeGreaterThan(0);
    const { rows } = await db
      .pool()
      .query<{ n: number }>("select count(*)::int as n from graphile_worker.jobs");
    expect(rows[0]!.n).toBe(0);
    // Its records are in the database, written by all three workers.
    const workers = await db
      .pool()
      .query<{ worker: string }>("select distinct worker from gwl_demo.executions order by worker");
    expect(workers.rows.map((r) => r.worker)).toEqual(["1", "2", "3"]);
  },
);
