/**
 * The README's TypeScript snippets, run as written (with `connectionString` provided and the package
 * import pointed at the source), each in its own process; what they print must match their `// …`
 * comments.
 */
import { execFile } from "node:child_process";
import { mkdir, readFile, rm, writeFile } from "node:fs/promises";
import { promisify } from "node:util";
import { afterAll, describe, expect, it } from "vitest";
import { useTestDatabase } from "./support/db.js";

const db = useTestDatabase();
const dir = new URL("./.readme/", import.meta.url);
const readme = await readFile(new URL("../README.md", import.meta.url), "utf8");
const snippets = [...readme.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]!);

afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

describe("README snippets", () => {
  it("there are snippets to run", () => {
    expect(snippets.length).toBeGreaterThanOrEqual(2);
  });

  snippets.forEach((snippet, index) => {
    it(`snippet ${index + 1} runs and prints what its comments say`, async () => {
      await mkdir(dir, { recursive: true });
      const file = new URL(`snippet-${index + 1}.ts`, dir);
      const source = snippet.replaceAll('"graphile-worker-locks"', '"../../src/index.js"');
      await writeFile(file, `const connectionString = process.env.DATABASE_URL!;\n${source}`);
      const { stdout } = await promisify(execFile)(
        process.execPath,
        ["--import", "tsx", file.pathname],
        {
          env: { ...process.env, DATABASE_URL: db.url },
          timeout: 30_000,
        },
      );
      const expected = [...snippet.matchAll(/console\.log\(.*\); \/\/ (.*)$/gm)].map((m) =>
        m[1]!.trim(),
      );
      const printed = stdout
        .split("\n")
        .map((line) => line.trim())
        .filter((line) => line && !line.startsWith("["));
      expect(printed).toEqual(expected);
    });
  });
});
