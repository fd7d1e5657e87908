/**
 * The npm package as a user gets it: `npm pack` of a clean copy of the project (the files git tracks or
 * would track, so nothing built earlier can stand in for a missing build), its contents checked against
 * `exports`, then installed into a scratch project with graphile-worker, pg and @types/node (the versions
 * this project uses), where the README's first example is compiled with `tsc --strict` (module nodenext)
 * and run against a fresh database.
 */
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { cp, mkdir, mkdtemp, readdir, readFile, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, inject, it } from "vitest";
import { databaseUrl } from "../scripts/postgres.js";
import { withAdmin } from "./support/admin.js";
import { expectedOutput, printedLines, readmeSnippets } from "./support/readme.js";

const run = promisify(execFile);
const root = fileURLToPath(new URL("..", import.meta.url));
const database = `gwl_pack_${randomBytes(6).toString("hex")}`;
let work: string;
let unpacked: string;
let tarball: string;

/** The version of a package installed in this project's node_modules. */
async function installedVersion(name: string): Promise<string> {
  const manifest = JSON.parse(
    await readFile(join(root, "node_modules", name, "package.json"), "utf8"),
  ) as { version: string };
  return manifest.version;
}

async function filesUnder(dir: string, prefix = ""): Promise<string[]> {
  const found: string[] = [];
  for (const entry of await readdir(dir, { withFileTypes: true })) {
    const path = prefix + entry.name;
    if (entry.isDirectory()) found.push(...(await filesUnder(join(dir, entry.name), `${path}/`)));
    else found.push(path);
  }
  return found.sort();
}

beforeAll(async () => {
  work = await mkdtemp(join(tmpdir(), "gwl-package-"));
  // A clean copy: what git tracks, plus new files it does not ignore (so that work in progress is packed
  // as a commit of it would be), and the project's node_modules for the build.
  const { stdout } = await run(
    "git",
    ["ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    {
      cwd: root,
      maxBuffer: 16 * 1024 * 1024,
    },
  );
  const clone = join(work, "clone");
  for (const file of stdout.split("\0").filter(Boolean)) {
    await cp(join(root, file), join(clone, file), { errorOnExist: false }).catch(
      (error: NodeJS.ErrnoException) => {
        if (error.code !== "ENOENT") throw error; // (a tracked file deleted in the work tree)
      },
    );
  }
  await symlink(join(root, "node_modules"), join(clone, "node_modules"), "dir");
  const packed = join(work, "packed");
  await mkdir(packed);
  await run("npm", ["pack", "--pack-destination", packed, "--no-audit", "--no-fund"], {
    cwd: clone,
    timeout: 180_000,
  });
  const [name, ...others] = await readdir(packed);
  expect(others, "npm pack makes one tarball").toEqual([]);
  tarball = join(packed, name!);
  unpacked = join(work, "unpacked");
  await mkdir(unpacked);
  await run("tar", ["-xzf", tarball, "-C", unpacked]);
}, 240_000);

afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
  await withAdmin(inject("baseUrl"), (admin) =>
    admin.query(`drop database if exists ${pg.escapeIdentifier(database)} with (force)`),
  );
});

describe("npm pack", () => {
  it("ships what `exports`, `main`, `types` and `bin` name, the migrations and the README, and nothing else", async () => {
    const dir = join(unpacked, "package");
    const manifest = JSON.parse(await readFile(join(dir, "package.json"), "utf8")) as {
      main: string;
      types: string;
      bin: Record<string, string>;
      exports: Record<string, string | Record<string, string>>;
    };
    const files = await filesUnder(dir);
    const named = [
      manifest.main,
      manifest.types,
      ...Object.values(manifest.bin),
      ...Object.values(manifest.exports).flatMap((target) =>
        typeof target === "string" ? [target] : Object.values(target),
      ),
    ].map((path) => path.replace(/^\.\//, ""));
    for (const path of named) expect(files, `${path} is named by package.json`).toContain(path);

    const sources = (await filesUnder(join(root, "src"))).filter((f) => f.endsWith(".ts"));
    const migrations = (await readdir(join(root, "sql"))).filter((f) => f.endsWith(".sql")).sort();
    expect(files).toEqual(
      [
        "README.md",
        "package.json",
        ...migrations.map((f) => `sql/${f}`),
        ...sources.flatMap((f) => {
          const base = `dist/${f.replace(/\.ts$/, "")}`;
          return [`${base}.d.ts`, `${base}.js`, `${base}.js.map`];
        }),
      ].sort(),
    );
  });

  it("ships source maps that carry their sources (the TypeScript files are not shipped)", async () => {
    const dist = join(unpacked, "package", "dist");
    const maps = (await readdir(dist)).filter((f) => f.endsWith(".js.map"));
    expect(maps.length).toBeGreaterThan(0);
    for (const map of maps) {
      const { sources, sourcesContent } = JSON.parse(await readFile(join(dist, map), "utf8")) as {
        sources: string[];
        sourcesContent?: Array<string | null>;
      };
      expect(sources, map).toEqual([`../src/${map.replace(/\.js\.map$/, ".ts")}`]);
      expect(sourcesContent, `${map} inlines its source`).toEqual([
        await readFile(join(root, "src", map.replace(/\.js\.map$/, ".ts")), "utf8"),
      ]);
    }
  });

  it("installs into a new project where the README's first example compiles with tsc --strict and runs", async () => {
    const app = join(work, "app");
    await mkdir(app);
    await writeFile(
      join(app, "package.json"),
      JSON.stringify({ name: "scratch-app", private: true, type: "module" }),
    );
    const versions = {
      "graphile-worker": await installedVersion("graphile-worker"),
      pg: await installedVersion("pg"),
      "@types/node": await installedVersion("@types/node"),
    };
    // npm's cache already holds these versions (the project's own install put them there).
    await run(
      "npm",
      [
        "install",
        "--prefer-offline",
        "--no-audit",
        "--no-fund",
        "--loglevel=error",
        tarball,
        ...Object.entries(versions).map(([name, version]) => `${name}@${version}`),
      ],
      { cwd: app, timeout: 120_000 },
    );

    const snippet = readmeSnippets[0]!;
    await writeFile(
      join(app, "example.ts"),
      `const connectionString = process.env.DATABASE_URL!;\n${snippet}`,
    );
    // skipLibCheck as most projects set it (checking every declaration of @types/node takes several seconds).
    // Under it, a shipped declaration whose import does not resolve would silently give `any`: types.ts
    // proves that the types the library takes from graphile-worker and pg are there, since assigning a
    // number to any of them is an error only while they resolve (an unused @ts-expect-error fails tsc).
    await writeFile(
      join(app, "types.ts"),
      [
        'import type { AddJobResult, Locks } from "graphile-worker-locks";',
        'type Helpers = Parameters<Parameters<Locks["exclusive"]>[1]>[1];',
        'type AddJobsOptions = NonNullable<Parameters<Locks["addJobs"]>[1]>;',
        "// @ts-expect-error: graphile-worker's Job",
        'export const job: AddJobResult["job"] = 5;',
        "// @ts-expect-error: graphile-worker's Logger",
        'export const logger: Helpers["logger"] = 5;',
        "// @ts-expect-error: a pg client",
        'export const pgClient: AddJobsOptions["pgClient"] = 5;',
        "",
      ].join("\n"),
    );
    await writeFile(
      join(app, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: {
          strict: true,
          module: "nodenext",
          moduleResolution: "nodenext",
          target: "es2022",
          types: ["node"],
          skipLibCheck: true,
        },
        files: ["example.ts", "types.ts"],
      }),
    );
    const tsc = join(root, "node_modules", "typescript", "bin", "tsc");
    await run(process.execPath, [tsc, "-p", app], { cwd: app, timeout: 120_000 }).catch(
      (error: Error & { stdout?: string; stderr?: string }) => {
        throw new Error(
          `tsc failed on the README's first example (${error.message}):\n${error.stdout ?? ""}${error.stderr ?? ""}`,
        );
      },
    );

    // A fresh, empty database: graphile-worker's run() in the example installs graphile-worker's schema, and
    // the library installs its own on first use.
    await withAdmin(inject("baseUrl"), (admin) =>
      admin.query(`create database ${pg.escapeIdentifier(database)}`),
    );
    const url = databaseUrl(inject("baseUrl"), database);
    const { stdout } = await run(process.execPath, [join(app, "example.js")], {
      cwd: app,
      env: { ...process.env, DATABASE_URL: url },
      timeout: 30_000,
    });
    expect(printedLines(stdout)).toEqual(expectedOutput(snippet));
  }, 240_000);
});
