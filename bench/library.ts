/**
 * The library under test. By default its TypeScript source (src/, compiled on the fly by tsx); with
 * BENCH_LIB=dist its build (dist/, run `npm run build` first), which is what users run. The difference
 * matters for a no-op benchmark: tsx compiles with esbuild's `keepNames`, which wraps every function
 * created at run time (closures included) in a `__name(...)` call.
 */
import type * as Library from "../src/index.js";
import type * as Exclusive from "../src/exclusive.js";
import type * as Options from "../src/options.js";

export const libraryBuild: "src" | "dist" = process.env.BENCH_LIB === "dist" ? "dist" : "src";

/** Imports a module of the library (`index`, `exclusive`, ...) from the chosen build. */
async function load<T>(module: string): Promise<T> {
  const specifier = `../${libraryBuild}/${module}.js`;
  try {
    return (await import(specifier)) as T;
  } catch (error) {
    if (libraryBuild === "dist") {
      throw new Error(
        `BENCH_LIB=dist: could not import ${specifier}; run \`npm run build\` first`,
        {
          cause: error,
        },
      );
    }
    throw error;
  }
}

export const library = await load<typeof Library>("index");

/** Internals, for bench/profile.ts only. */
export const internals = async () => ({
  exclusive: await load<typeof Exclusive>("exclusive"),
  options: await load<typeof Options>("options"),
});
