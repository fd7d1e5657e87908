/**
 * The library under test. By default its build (dist/, which `npm run bench` builds first), which is what
 * users run; with BENCH_LIB=src its TypeScript source, compiled on the fly by tsx. The difference matters
 * for a no-op benchmark: tsx compiles with esbuild's `keepNames`, which wraps every function created at run
 * time (closures included) in a `__name(...)` call.
 */
import { existsSync, readdirSync, statSync } from "node:fs";
import type * as Library from "../src/index.js";

/**
 * `dist` (default), `src`, or the directory (relative to the repository) of another build, e.g. an earlier
 * commit's built with `npx tsc -p tsconfig.build.json --outDir dist-base`, for a before/after comparison.
 */
export const libraryBuild: string = process.env.BENCH_LIB || "dist";

/** The newest modification time of the files under `dir` (0 if it does not exist). */
function newestMtime(dir: URL): number {
  if (!existsSync(dir)) return 0;
  let newest = 0;
  for (const entry of readdirSync(dir, { recursive: true, withFileTypes: true })) {
    if (entry.isFile())
      newest = Math.max(newest, statSync(`${entry.parentPath}/${entry.name}`).mtimeMs);
  }
  return newest;
}

// A build older than the source would measure code that no longer exists.
if (libraryBuild === "dist") {
  const built = newestMtime(new URL("../dist/", import.meta.url));
  if (built === 0 || built < newestMtime(new URL("../src/", import.meta.url))) {
    throw new Error(
      "dist/ is missing or older than src/: run `npm run build` first (`npm run bench` does), or set BENCH_LIB=src",
    );
  }
}

/** Imports a module of the library (`index`, `exclusive`, ...) from the chosen build. */
async function load<T>(module: string): Promise<T> {
  const specifier = `../${libraryBuild}/${module}.js`;
  try {
    return (await import(specifier)) as T;
  } catch (error) {
    throw new Error(`could not import ${specifier}`, { cause: error });
  }
}

export const library = await load<typeof Library>("index");

/** The lock session's module, for its timing probe (`setSessionProbe`), from the same build. */
export const sessionModule = await load<typeof import("../src/session.js")>("session");
