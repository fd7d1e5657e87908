/**
 * The README's TypeScript snippets, and what each prints according to its `console.log(...); // …`
 * comments.
 */
import { readFileSync } from "node:fs";

/** The ```ts blocks of README.md, in order. */
export function readmeSnippets(): string[] {
  const readme = readFileSync(new URL("../../README.md", import.meta.url), "utf8");
  return [...readme.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]!);
}

/** The lines a snippet's comments say it prints. */
export function expectedOutput(snippet: string): string[] {
  return [...snippet.matchAll(/console\.log\(.*\); \/\/ (.*)$/gm)].map((m) => m[1]!.trim());
}

/** What a snippet printed: its non-empty lines, without log lines (`[worker] …`). */
export function printedLines(stdout: string): string[] {
  return stdout
    .split("\n")
    .map((line) => line.trim())
    .filter((line) => line && !line.startsWith("["));
}
