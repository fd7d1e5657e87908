/**
 * Rules a task file declares beside its function (its `locks` export): which of a task's files is read, as
 * graphile-worker's own loader picks it, and reading it. The plugin reads them as graphile-worker loads the
 * task directory; the CLI reads the file of the one task it is asked about.
 */
import { readdir } from "node:fs/promises";
import { dirname, join, sep } from "node:path";
import { pathToFileURL } from "node:url";
import { validateTaskRules, type TaskLocksOptions } from "./rules.js";

/** graphile-worker's `worker.fileExtensions` default. */
const DEFAULT_EXTENSIONS = [".js", ".cjs", ".mjs", ".ts", ".mts"];
/** The extensions of files that JavaScript can import (others are executables, with no `locks` export). */
const JS_EXTENSIONS = new Set([".js", ".cjs", ".mjs", ".ts", ".mts", ".cts"]);
/** How graphile-worker splits a file name of the task directory into the task's name and the extension. */
const FILE_REGEXP = /^([A-Za-z0-9_-]+)((?:\.[A-Za-z0-9_-]+)*)$/;

export interface TaskFile {
  fullPath: string;
  extension: string;
}

/**
 * The file of a task that graphile-worker loads its function from: the first of `extensions`, in that
 * order, that one of its files has.
 */
export function pickTaskFile(
  files: readonly TaskFile[],
  extensions: readonly string[] = DEFAULT_EXTENSIONS,
): TaskFile | undefined {
  for (const extension of extensions) {
    if (!JS_EXTENSIONS.has(extension)) continue;
    const file = files.find((f) => f.extension === extension);
    if (file) return file;
  }
  return undefined;
}

/** A task file's `locks` export, validated; undefined when it has none. */
export async function readFileRules(
  taskIdentifier: string,
  fullPath: string,
): Promise<TaskLocksOptions | undefined> {
  const mod = (await import(pathToFileURL(fullPath).href)) as Record<string, unknown>;
  let rules = mod.locks;
  if (rules === undefined) {
    // A CommonJS task file: its exports are under `default`.
    const inner = mod.default as Record<string, unknown> | undefined;
    rules = inner && typeof inner === "object" ? inner.locks : undefined;
  }
  if (rules === undefined) return undefined;
  validateTaskRules(taskIdentifier, rules, `the \`locks\` export of ${fullPath}`);
  return rules;
}

/**
 * The files of one task in a task directory (`a/b` is `a/b.js`, `a/b.ts`...), as graphile-worker collects
 * them; none when the directory or the task's folder does not exist.
 */
export async function findTaskFiles(
  taskDirectory: string,
  taskIdentifier: string,
): Promise<TaskFile[]> {
  const path = join(taskDirectory, ...taskIdentifier.split("/"));
  const folder = dirname(path);
  const baseName = path.slice(folder.length + sep.length);
  let entries: string[];
  try {
    entries = await readdir(folder);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return [];
    throw error;
  }
  const files: TaskFile[] = [];
  for (const entry of entries) {
    const match = FILE_REGEXP.exec(entry);
    if (match && match[1] === baseName) {
      files.push({ fullPath: join(folder, entry), extension: match[2] ?? "" });
    }
  }
  return files;
}
