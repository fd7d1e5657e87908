/**
 * Builds the package as it is published (`tsc -p tsconfig.build.json`, with `sql/` and `package.json`
 * beside it) into a folder of its own, so that tests run the JavaScript a user installs: its entry points,
 * its `bin`, its migrations.
 */
import { execFile } from "node:child_process";
import { cp, mkdir, rm } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const ROOT = fileURLToPath(new URL("../../", import.meta.url));

export interface BuiltPackage {
  /** The package's folder (with `dist/`, `sql/`, `package.json`). */
  dir: string;
  /** `dist/index.js`. */
  entry: string;
  remove(): Promise<void>;
}

export async function buildPackage(name: string): Promise<BuiltPackage> {
  const dir = `${ROOT}test/.preset/build-${name}/`;
  await rm(dir, { recursive: true, force: true });
  await mkdir(dir, { recursive: true });
  await promisify(execFile)(
    process.execPath,
    [
      `${ROOT}node_modules/typescript/bin/tsc`,
      "-p",
      `${ROOT}tsconfig.build.json`,
      "--outDir",
      `${dir}dist`,
    ],
    { cwd: ROOT },
  );
  await cp(`${ROOT}sql`, `${dir}sql`, { recursive: true });
  await cp(`${ROOT}package.json`, `${dir}package.json`);
  return {
    dir,
    entry: `${dir}dist/index.js`,
    remove: () => rm(dir, { recursive: true, force: true }),
  };
}
