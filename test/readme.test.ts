/**
 * The TypeScript snippets of docs/*.md, run as written (with `connectionString` provided and the package
 * import pointed at the source), each in its own process on a database of its own, as a reader's first run
 * would be; what they print must match their `// …` comments. The README's snippets run the same way in
 * test/preset/first-use.test.ts, on a database with graphile-worker's schema only (a reader's first run of
 * the library).
 */
import { readdir, readFile, rm } from "node:fs/promises";
import { afterAll, describe, expect, it } from "vitest";
import { freshDatabase } from "./support/db.js";
import { expectedOutput, readmeSnippets, runSnippet } from "./support/readme.js";

const root = new URL("../", import.meta.url);
const dir = new URL("./.readme/", import.meta.url);

/** The Markdown files whose snippets run: docs/*.md in name order. */
const files = (await readdir(new URL("docs/", root)))
  .filter((name) => name.endsWith(".md"))
  .sort()
  .map((name) => `docs/${name}`);
const snippets: Array<{ file: string; index: number; source: string }> = [];
for (const file of files) {
  const text = await readFile(new URL(file, root), "utf8");
  [...text.matchAll(/```ts\n([\s\S]*?)```/g)].forEach((m, index) =>
    snippets.push({ file, index: index + 1, source: m[1]! }),
  );
}

afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

describe("documentation snippets", () => {
  it("there are snippets to run in the README and in docs/", () => {
    expect(readmeSnippets.length).toBeGreaterThanOrEqual(2);
    expect(snippets.length).toBeGreaterThanOrEqual(1);
  });

  for (const { file, index, source } of snippets) {
    it(`${file} snippet ${index} runs and prints what its comments say`, async () => {
      const name = `${file.replace(/\W/g, "-")}-${index}`;
      const db = await freshDatabase();
      try {
        const printed = await runSnippet(source, db.url, dir, name);
        expect(printed).toEqual(expectedOutput(source));
      } finally {
        await db.drop();
      }
    });
  }
});
