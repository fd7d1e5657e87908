/**
 * The links between the project's Markdown files work: every relative link in the README, CONTRIBUTING.md,
 * docs/*.md and bench/README.md names a file that exists, and every `#anchor` in such a link (or a link
 * within the same file) is a heading of its target, under GitHub's slug rules.
 */
import { existsSync } from "node:fs";
import { readdir, readFile } from "node:fs/promises";
import { posix } from "node:path";
import { describe, expect, it } from "vitest";

const root = new URL("../", import.meta.url);

/**
 * GitHub's anchor for a heading: its text lowercased, Markdown's inline code marks and punctuation other
 * than hyphens and underscores removed, spaces turned into hyphens; a repeated heading gets `-1`, `-2`, …
 */
function headingSlugs(markdown: string): Set<string> {
  const slugs = new Set<string>();
  const seen = new Map<string, number>();
  for (const line of proseLines(markdown)) {
    const heading = /^#{1,6}\s+(.*?)\s*#*\s*$/.exec(line);
    if (!heading) continue;
    const base = heading[1]!
      .toLowerCase()
      .replace(/[^\p{L}\p{N}\p{M} _-]/gu, "")
      .replace(/ /g, "-");
    const count = seen.get(base) ?? 0;
    seen.set(base, count + 1);
    slugs.add(count === 0 ? base : `${base}-${count}`);
  }
  return slugs;
}

/** The lines of a Markdown text outside fenced code blocks. */
function proseLines(markdown: string): string[] {
  const lines: string[] = [];
  let fenced = false;
  for (const line of markdown.split("\n")) {
    if (/^\s*(```|~~~)/.test(line)) fenced = !fenced;
    else if (!fenced) lines.push(line);
  }
  return lines;
}

/** The targets of the inline links `[text](target)` of a Markdown text, outside code. */
function linkTargets(markdown: string): string[] {
  const prose = proseLines(markdown)
    .join("\n")
    .replace(/`[^`\n]*`/g, "");
  return [...prose.matchAll(/\]\(([^)\s]+)(?:\s+"[^"]*")?\)/g)].map((m) => m[1]!);
}

/**
 * What is wrong with the relative links of `files` (paths from the project's root): a target that does not
 * exist, or an anchor that is not a heading of its Markdown target. `read` gives a Markdown file's text.
 */
async function linkProblems(
  files: string[],
  read: (path: string) => Promise<string>,
  exists: (path: string) => boolean,
): Promise<string[]> {
  const problems: string[] = [];
  for (const file of files) {
    for (const target of linkTargets(await read(file))) {
      if (/^[a-z][a-z0-9+.-]*:/i.test(target)) continue; // https:, mailto:, …
      const [path = "", anchor] = target.split("#", 2) as [string, string | undefined];
      const resolved = path ? posix.normalize(posix.join(posix.dirname(file), path)) : file;
      if (resolved.startsWith("..") || !exists(resolved)) {
        problems.push(`${file}: link to ${target}: ${resolved} does not exist`);
        continue;
      }
      if (anchor === undefined) continue;
      if (!resolved.endsWith(".md")) {
        problems.push(`${file}: link to ${target}: an anchor into a file that is not Markdown`);
      } else if (!headingSlugs(await read(resolved)).has(anchor)) {
        problems.push(`${file}: link to ${target}: no heading '#${anchor}' in ${resolved}`);
      }
    }
  }
  return problems;
}

describe("links between the Markdown files", () => {
  it("GitHub's slugs for headings of the kinds these files use", () => {
    const slugs = headingSlugs(
      [
        "# graphile-worker-locks",
        "## Usage with graphile-worker's config: `LocksPreset`",
        "### `locks.unique` and `locks.define`",
        "## Node.js and graphile-worker versions",
        "## `reschedule`: the line",
        "## At most `limit` at once",
        "## held_locks view",
        "## Notes",
        "## Notes",
        "```sh",
        "# a comment in a code block",
        "```",
      ].join("\n"),
    );
    expect([...slugs]).toEqual([
      "graphile-worker-locks",
      "usage-with-graphile-workers-config-lockspreset",
      "locksunique-and-locksdefine",
      "nodejs-and-graphile-worker-versions",
      "reschedule-the-line",
      "at-most-limit-at-once",
      "held_locks-view",
      "notes",
      "notes-1",
    ]);
  });

  it("finds a missing file, a missing anchor, and an anchor in the same file", async () => {
    const texts: Record<string, string> = {
      "README.md": [
        "# Title",
        "## Present",
        "[ok](docs/a.md#section) [ok](#present) [ok](https://example.org/x#y)",
        "[gone](docs/missing.md) [bad anchor](docs/a.md#nowhere) [bad here](#absent)",
        "`[not a link](nowhere.md)`",
        "```md",
        "[not a link either](nowhere.md)",
        "```",
      ].join("\n"),
      "docs/a.md": "# A\n## Section\n[up](../README.md#present) [up, wrong](../README.md#title-1)",
    };
    const problems = await linkProblems(
      Object.keys(texts),
      async (path) => texts[path]!,
      (path) => path in texts,
    );
    expect(problems).toEqual([
      "README.md: link to docs/missing.md: docs/missing.md does not exist",
      "README.md: link to docs/a.md#nowhere: no heading '#nowhere' in docs/a.md",
      "README.md: link to #absent: no heading '#absent' in README.md",
      "docs/a.md: link to ../README.md#title-1: no heading '#title-1' in README.md",
    ]);
  });

  it("every relative link and anchor in README.md, CONTRIBUTING.md, docs/*.md and bench/README.md resolves", async () => {
    const docs = (await readdir(new URL("docs/", root))).filter((name) => name.endsWith(".md"));
    expect(docs.length).toBeGreaterThan(0);
    const files = [
      "README.md",
      "CONTRIBUTING.md",
      ...docs.map((d) => `docs/${d}`),
      "bench/README.md",
    ];
    const read = (path: string) => readFile(new URL(path, root), "utf8");
    const problems = await linkProblems(files, read, (path) => existsSync(new URL(path, root)));
    expect(problems).toEqual([]);
    const links = await Promise.all(files.map(async (file) => linkTargets(await read(file))));
    expect(links.flat().length, "links checked").toBeGreaterThan(20);
  });
});
