// Loaded with `node --import` into the worker processes the tests fork: when TEST_GRAPHILE_WORKER=0.17,
// registers a resolve hook that sends `import "graphile-worker"` (the library's too) to the devDependency
// alias graphile-worker-0.17. See test/support/graphile-worker.ts.
import { register } from "node:module";

const value = process.env.TEST_GRAPHILE_WORKER;
if (value === "0.17") {
  register(
    "data:text/javascript," +
      encodeURIComponent(
        `export async function resolve(specifier, context, next) {
          return next(specifier === "graphile-worker" ? "graphile-worker-0.17" : specifier, context);
        }`,
      ),
    import.meta.url,
  );
} else if (value !== undefined && value !== "" && value !== "0.18") {
  throw new TypeError(`TEST_GRAPHILE_WORKER must be one of 0.17, 0.18, got "${value}"`);
}
