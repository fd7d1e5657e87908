/**
 * The library under test: its build in dist/ by default (what users run; `npm run bench` builds it first),
 * refused when older than src/; with BENCH_LIB=src its TypeScript source, compiled on the fly by tsx, whose
 * esbuild `keepNames` wraps every closure in a `__name(...)` call, which a no-op benchmark notices; with
 * BENCH_LIB=<directory> another build, e.g. an earlier commit's built with
 * `npx tsc -p tsconfig.build.json --outDir dist-base`, for a before/after comparison.
 */
import { existsSync, readdirSync, statSync } from "node:fs";
import type * as Library from "../src/index.js";

export const libraryBuild: string = process.env.BENCH_LIB || "dist";

/** The newest modification time of the files under `dir` (0 if it does not exist). */
const newestMtime = (dir: URL): number =>
  !existsSync(dir)
    ? 0
    : Math.max(
        0,
        ...readdirSync(dir, { recursive: true, withFileTypes: true })
          .filter((entry) => entry.isFile())
          .map((entry) => statSync(`${entry.parentPath}/${entry.name}`).mtimeMs),
      );

if (libraryBuild === "dist") {
  const built = newestMtime(new URL("../dist/", import.meta.url));
  if (built === 0 || built < newestMtime(new URL("../src/", import.meta.url))) {
    throw new Error(
      "dist/ is missing or older than src/: run `npm run build` first (`npm run bench` does), or set BENCH_LIB=src",
    );
  }
}

/** Imports a module of the library (`index`, `session`, ...) from the chosen build. */
export async function load<T>(module: string): Promise<T> {
  const specifier = `../${libraryBuild}/${module}.js`;
  try {
    return (await import(specifier)) as T;
  } catch (error) {
    throw new Error(`could not import ${specifier}`, { cause: error });
  }
}

export const library = await load<typeof Library>("index");

/** The lock session's timing probe (`setTimingProbe`), from the same build; null for a build without one. */
export const timingProbe = await load<typeof import("../src/session/timing-probe.js")>(
  "session/timing-probe",
).catch(() => null);
