/**
 * The README's TypeScript snippets, and a runner that runs one as written (with `connectionString`
 * provided and the package import pointed at the source) in its own process.
 */
import { execFile } from "node:child_process";
import { mkdir, readFile, rm, writeFile } from "node:fs/promises";
import { promisify } from "node:util";

const readme = await readFile(new URL("../../README.md", import.meta.url), "utf8");

/** The README's ```ts blocks, in order. */
export const readmeSnippets: string[] = [...readme.matchAll(/```ts\n([\s\S]*?)```/g)].map(
  (m) => m[1]!,
);

/** What a snippet's `console.log(...); // …` comments say it prints, line by line. */
export function expectedOutput(snippet: string): string[] {
  return [...snippet.matchAll(/console\.log\(.*\); \/\/ (.*)$/gm)].map((m) => m[1]!.trim());
}

/**
 * Runs a snippet against `databaseUrl` from a file in `dir` (removed afterwards), and returns the lines it
 * printed (logger lines, which start with `[`, left out). Rejects with the process's error and stderr.
 */
export async function runSnippet(
  snippet: string,
  databaseUrl: string,
  dir: URL,
  name: string,
): Promise<string[]> {
  await mkdir(dir, { recursive: true });
  const file = new URL(`${name}.ts`, dir);
  const source = snippet.replaceAll('"graphile-worker-locks"', '"../../src/index.js"');
  await writeFile(file, `const connectionString = process.env.DATABASE_URL!;\n${source}`);
  try {
    const { stdout } = await promisify(execFile)(
      process.execPath,
      ["--import", "tsx", file.pathname],
      { env: { ...process.env, DATABASE_URL: databaseUrl }, timeout: 30_000 },
    );
    return stdout
      .split("\n")
      .map((line) => line.trim())
      .filter((line) => line && !line.startsWith("["));
  } finally {
    await rm(file, { force: true });
  }
}
