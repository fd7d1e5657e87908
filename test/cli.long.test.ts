/**
 * The operator CLI, run as published: the `bin` of the built package, in a child process, against an
 * empty database and against this file's database with a held key and a parked job.
 */
import { execFile, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { hostname } from "node:os";
import { promisify } from "node:util";
import pg from "pg";
import { run, type JobHelpers } from "graphile-worker";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { inject } from "vitest";
import { databaseUrl } from "../scripts/postgres.js";
import { lockKey, makeLocks, PauseError } from "../src/index.js";
import { slotKeys } from "../src/key.js";
import { withAdmin } from "./support/admin.js";
import { buildPackage, type BuiltPackage } from "./support/build.js";
import { useTestDatabase } from "./support/db.js";
import { pgbouncerMissing, startPgBouncer } from "./support/pgbouncer.js";

const pgbouncer = pgbouncerMissing();
if (pgbouncer) console.warn(pgbouncer);

const db = useTestDatabase();
let built: BuiltPackage;
let bin: string;
const emptyName = `gwl_empty_${randomBytes(4).toString("hex")}`;
let emptyUrl: string;

beforeAll(async () => {
  built = await buildPackage("cli");
  const pkg = JSON.parse(await readFile(`${built.dir}package.json`, "utf8")) as {
    bin: Record<string, string>;
  };
  bin = `${built.dir}${pkg.bin["graphile-worker-locks"]!.replace(/^\.\//, "")}`;
  await withAdmin(inject("baseUrl"), (admin) =>
    admin.query(`create database ${pg.escapeIdentifier(emptyName)}`),
  );
  emptyUrl = databaseUrl(inject("baseUrl"), emptyName);
}, 120_000);

afterAll(async () => {
  await withAdmin(inject("baseUrl"), (admin) =>
    admin.query(`drop database if exists ${pg.escapeIdentifier(emptyName)} with (force)`),
  );
  await built?.remove();
});

interface Result {
  code: number;
  stdout: string;
  stderr: string;
}

async function cli(
  args: string[],
  env: Record<string, string> = {},
  cwd?: string,
): Promise<Result> {
  try {
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [bin, ...args], {
      env: { ...process.env, DATABASE_URL: "", ...env },
      timeout: 30_000,
      ...(cwd ? { cwd } : {}),
    });
    return { code: 0, stdout, stderr };
  } catch (error) {
    const e = error as { code: number; stdout: string; stderr: string };
    return { code: e.code, stdout: e.stdout, stderr: e.stderr };
  }
}

async function schemas(url: string): Promise<string[]> {
  return withAdmin(url, async (client) => {
    const { rows } = await client.query<{ nspname: string }>(
      "select nspname from pg_namespace where nspname like 'graphile%' order by 1",
    );
    return rows.map((r) => r.nspname);
  });
}

describe("graphile-worker-locks CLI on an empty database", () => {
  it("status and check say what is missing, exit non-zero, and write nothing; migrate names what it needs", async () => {
    const status = await cli(["status", "-c", emptyUrl]);
    expect(status.code).toBe(1);
    expect(status.stderr).toMatch(/schema 'graphile_worker_locks' is not installed/);

    const check = await cli(["check"], { DATABASE_URL: emptyUrl });
    expect(check.code).toBe(1);
    expect(check.stdout).toMatch(/FAIL graphile-worker schema: .*not installed/);
    expect(check.stdout).toMatch(/FAIL graphile-worker-locks schema: .*not installed/);
    expect(check.stdout).toMatch(/fix: run `graphile-worker-locks migrate`/);
    expect(check.stdout).toMatch(/ok {3}lock session connection: direct/);
    expect(await schemas(emptyUrl)).toEqual([]);

    const migrate = await cli(["migrate", "-c", emptyUrl]);
    expect(migrate.code).toBe(1);
    expect(migrate.stderr).toMatch(/graphile-worker's schema 'graphile_worker' is not installed/);

    const usage = await cli(["frobnicate", "-c", emptyUrl]);
    expect(usage.code).toBe(2);
    expect(usage.stderr).toMatch(/unknown command 'frobnicate'/);
    expect(await cli([])).toMatchObject({ code: 2 });
  }, 60_000);

  it("without -C, reads the graphile.config.* of the current folder, as graphile-worker does", async () => {
    const dir = `${built.dir}found-config/`;
    await mkdir(dir, { recursive: true });
    await writeFile(
      `${dir}graphile.config.mjs`,
      `export default { worker: { connectionString: ${JSON.stringify(emptyUrl)} } };\n`,
    );
    // The database comes from that file alone (DATABASE_URL is empty).
    const status = await cli(["status"], {}, dir);
    expect(status.stderr).toMatch(/schema 'graphile_worker_locks' is not installed/);
    expect(status.code).toBe(1);
  }, 60_000);
});

describe("graphile-worker-locks CLI on a database in use", () => {
  it("migrate, then status answers who holds a job's key (by the config's rules or a task file's), in which process on which host, and who waits; check passes", async () => {
    // A fresh library schema name, so that migrate has something to install.
    const configPath = `${built.dir}graphile.config.mjs`;
    await writeFile(
      configPath,
      `export default {
  worker: {
    connectionString: ${JSON.stringify(db.url)},
    locks: {
      schema: "gwl_cli",
      tasks: { charge_card: { onConflict: "reschedule", key: (p) => ({ userId: p.userId }) } },
    },
  },
};
`,
    );
    const migrate = await cli(["migrate", "-C", configPath]);
    expect(migrate.stderr).toBe("");
    expect(migrate.stdout).toMatch(/schema 'gwl_cli' is at level \d+/);

    const locks = makeLocks({ connectionString: db.url, schema: "gwl_cli" });
    let started!: () => void;
    const running = new Promise<void>((resolve) => (started = resolve));
    let finish!: () => void;
    const finished = new Promise<void>((resolve) => (finish = resolve));
    const chargeCard = locks.exclusive(
      "charge_card",
      async (_payload: { userId: number }, _helpers: JobHelpers) => {
        started();
        await finished;
      },
      { onConflict: "reschedule", key: (p) => ({ userId: p.userId }) },
    );
    const runner = await run({
      connectionString: db.url,
      concurrency: 2,
      pollInterval: 100,
      taskList: { charge_card: chargeCard },
      noHandleSignals: true,
    });
    try {
      const first = await chargeCard.addJob({ userId: 1 });
      await running;
      await chargeCard.addJob({ userId: 1 });
      // wait until the second job met the held key and parked
      for (let i = 0; ; i++) {
        const { rows } = await db.pool().query("select 1 from gwl_cli.waiters");
        const holders = await db.pool().query("select 1 from gwl_cli.lock_holders");
        if (rows.length === 1 && holders.rows.length === 1) break;
        if (i > 300) throw new Error("the second job never parked");
        await new Promise((r) => setTimeout(r, 50));
      }

      const status = await cli([
        "status",
        "charge_card",
        '{"userId":1}',
        "-C",
        configPath,
        "--json",
      ]);
      expect(status.stderr).toBe("");
      const parsed = JSON.parse(status.stdout) as {
        keys: string[];
        held: Array<{
          lockKey: string;
          taskIdentifier: string;
          jobId: string;
          applicationName: string;
        }>;
        lines: Array<{ lockKey: string; waiting: number }>;
        sessions: Array<{ pid: number }>;
      };
      expect(parsed.keys).toEqual([chargeCard.lockKey({ userId: 1 }).toString()]);
      expect(parsed.held).toHaveLength(1);
      expect(parsed.held[0]).toMatchObject({
        lockKey: parsed.keys[0],
        taskIdentifier: "charge_card",
        jobId: first.job!.id,
      });
      expect(parsed.held[0]!.applicationName).toMatch(/^graphile-worker-locks\//);
      // The holder's worker process and host, beside its backend.
      expect(parsed.held[0]).toMatchObject({ processId: process.pid, host: hostname() });
      expect(parsed.sessions[0]).toMatchObject({ processId: process.pid, host: hostname() });
      expect(parsed.lines).toEqual([
        expect.objectContaining({ lockKey: parsed.keys[0], waiting: 1 }),
      ]);
      expect(parsed.sessions).toHaveLength(1);

      // Another key: nothing held, nobody waiting.
      const other = await cli([
        "status",
        "charge_card",
        '{"userId":2}',
        "-C",
        configPath,
        "--json",
      ]);
      expect(JSON.parse(other.stdout)).toMatchObject({ held: [], lines: [] });

      const text = await cli(["status", "-C", configPath]);
      expect(text.stdout).toMatch(
        /Held locks \(1\):\n {2}key -?\d+ {2}task charge_card {2}job \d+/,
      );
      expect(text.stdout).toMatch(/Parked jobs \(1\):/);
      expect(text.stdout).toContain(
        `task charge_card  job ${first.job!.id}  process ${process.pid} on ${hostname()}  backend pid `,
      );

      // Rules a task file declares, in the task directory the config names (found without -C).
      const dir = `${built.dir}file-rules/`;
      await mkdir(`${dir}tasks`, { recursive: true });
      await writeFile(
        `${dir}tasks/charge_card.js`,
        'export const locks = { onConflict: "reschedule", key: (p) => ({ userId: p.userId }) };\nexport default async () => {};\n',
      );
      // (an enum: TypeScript that no loader-less Node.js runs, type stripping included)
      await writeFile(
        `${dir}tasks/typed.ts`,
        "enum Kind { A }\nexport const locks = { key: (p: { userId: number }) => ({ userId: p.userId, k: Kind.A }) };\nexport default async () => {};\n",
      );
      await writeFile(
        `${dir}graphile.config.mjs`,
        `export default { worker: { connectionString: ${JSON.stringify(db.url)}, taskDirectory: ${JSON.stringify(`${dir}tasks`)}, fileExtensions: [".js", ".ts"], locks: { schema: "gwl_cli" } } };\n`,
      );
      const fromFile = await cli(
        ["status", "charge_card", '{"userId":1,"amount":5}', "--json"],
        {},
        dir,
      );
      expect(fromFile.stderr).toBe("");
      const focused = JSON.parse(fromFile.stdout) as typeof parsed & { focus: string };
      expect(focused.keys).toEqual(parsed.keys);
      expect(focused.focus).toMatch(/rules from the `locks` export of .*charge_card\.js/);
      expect(focused.held).toEqual([
        expect.objectContaining({ jobId: first.job!.id, processId: process.pid }),
      ]);
      const typed = await cli(["status", "typed", '{"userId":1}'], {}, dir);
      expect(typed.stderr).toMatch(
        /cannot tell the rules of task 'typed': its file .*typed\.ts could not be loaded/,
      );
      expect(typed.code).toBe(1);

      const check = await cli(["check", "-C", configPath]);
      expect(check.stdout).toMatch(/ok {3}graphile-worker-locks schema/);
      expect(check.code, check.stdout).toBe(0);
      const crowded = await cli(["check", "-C", configPath, "--processes", "1000", "--json"]);
      expect(crowded.code).toBe(1);
      const findings = JSON.parse(crowded.stdout) as Array<{ check: string; ok: boolean }>;
      expect(findings.filter((f) => !f.ok).map((f) => f.check)).toEqual(["max_connections"]);
    } finally {
      finish();
      await runner.stop();
      await locks.release();
    }
  }, 90_000);

  it("status of a task with a lock group and several limits shows each limit's group and keys", async () => {
    const configPath = `${built.dir}graphile.limits.config.mjs`;
    await writeFile(
      configPath,
      `export default {
  worker: {
    connectionString: ${JSON.stringify(db.url)},
    locks: {
      tasks: {
        refund_card: { lockGroup: "card", key: (p) => p.userId },
        send_email: { limits: [{ key: (p) => p.tenant, limit: 2 }, { key: () => "all", limit: 3, group: "mail" }] },
      },
    },
  },
};
`,
    );
    const grouped = await cli([
      "status",
      "refund_card",
      '{"userId":1}',
      "-C",
      configPath,
      "--json",
    ]);
    expect(grouped.stderr).toBe("");
    const g = JSON.parse(grouped.stdout) as { focus: string; keys: string[] };
    expect(g.keys).toEqual([lockKey("card", 1).toString()]);
    expect(g.focus).toContain(`group card, key ${lockKey("card", 1)}`);
    const stacked = await cli([
      "status",
      "send_email",
      '{"tenant":"t"}',
      "-C",
      configPath,
      "--json",
    ]);
    expect(stacked.stderr).toBe("");
    const s = JSON.parse(stacked.stdout) as { focus: string; keys: string[] };
    const tenant = slotKeys("send_email", "t", 2);
    const mail = slotKeys("mail", "all", 3);
    expect(s.keys).toEqual([...tenant, ...mail].map(String));
    expect(s.focus).toContain(`limit 0: group send_email, key ${tenant.join(", ")}`);
    expect(s.focus).toContain(`limit 1: group mail, key ${mail.join(", ")}`);
  });

  it("status shows each throttled key's use of its period and next slot, and each paused key with its end", async () => {
    const configPath = `${built.dir}rates.config.mjs`;
    await writeFile(
      configPath,
      `export default {
  worker: {
    connectionString: ${JSON.stringify(db.url)},
    locks: {
      tasks: { api_call: { lock: false, rate: { limit: 2, period: 60000, key: (p) => p.account } } },
    },
  },
};
`,
    );
    const locks = makeLocks({ connectionString: db.url });
    const apiCall = locks.exclusive(
      "api_call",
      async (payload: { account: string; n: number }) => {
        if (payload.n === 9) throw new PauseError(60_000);
      },
      { lock: false, rate: { limit: 2, period: 60_000, key: (p) => p.account } },
    );
    let throttled = 0;
    let paused = 0;
    locks.events.on("job:throttled", () => throttled++);
    locks.events.on("job:paused", () => paused++);
    const runner = await run({
      connectionString: db.url,
      concurrency: 2,
      pollInterval: 100,
      taskList: { api_call: apiCall },
      noHandleSignals: true,
    });
    try {
      for (const n of [1, 2, 3]) await apiCall.addJob({ account: "a", n });
      await apiCall.addJob({ account: "b", n: 9 });
      for (let i = 0; throttled < 1 || paused < 1; i++) {
        if (i > 400) throw new Error("no job met the rate or paused");
        await new Promise((r) => setTimeout(r, 50));
      }
      const status = await cli([
        "status",
        "api_call",
        '{"account":"a","n":0}',
        "-C",
        configPath,
        "--json",
      ]);
      expect(status.stderr).toBe("");
      const parsed = JSON.parse(status.stdout) as {
        throttled: Array<Record<string, unknown>>;
        paused: Array<Record<string, unknown>>;
      };
      expect(parsed.throttled).toEqual([
        expect.objectContaining({
          label: 'gwl:v1:rate:api_call:"a"',
          used: 2,
          limit: 2,
          waiting: 1,
        }),
      ]);
      // (a pause of another key is not this payload's)
      expect(parsed.paused).toEqual([]);
      const text = await cli(["status", "-C", configPath]);
      expect(text.stdout).toMatch(
        /Throttled keys \(2\):\n {2}gwl:v1:rate:api_call:"a" {2}2\/2 in the last 60000 ms {2}1 waiting {2}next slot \d{4}-/,
      );
      expect(text.stdout).toMatch(
        /Paused keys \(1\):\n {2}gwl:v1:rate:api_call:"b" {2}until \d{4}-/,
      );
    } finally {
      await runner.stop();
      await locks.release();
    }
  }, 90_000);
});

describe.skipIf(pgbouncer !== null)("graphile-worker-locks check through PgBouncer", () => {
  it("a transaction-mode pooler fails the lock session check with its fix; session mode and direct pass", async () => {
    const transaction = await startPgBouncer(db.url, { poolMode: "transaction" });
    const session = await startPgBouncer(db.url, { poolMode: "session" });
    try {
      const pooled = await cli(["check", "--connection", transaction.via(db.url)]);
      expect(pooled.code, pooled.stdout + pooled.stderr).toBe(1);
      expect(pooled.stdout).toMatch(
        /FAIL lock session connection: the lock session's connection goes through a transaction-mode pooler \(.+\): session advisory locks would not hold/,
      );
      expect(pooled.stdout).toMatch(/ {5}fix: set `lockConnectionString`/);

      // A pool for the jobs behind the transaction-mode pooler, the lock session direct: the check passes.
      const configPath = `${built.dir}pooled.config.mjs`;
      await writeFile(
        configPath,
        `export default { worker: { connectionString: ${JSON.stringify(transaction.via(db.url))}, locks: { lockConnectionString: ${JSON.stringify(db.url)} } } };\n`,
      );
      const split = await cli(["check", "-C", configPath, "--json"]);
      const splitFindings = JSON.parse(split.stdout) as Array<{ check: string; ok: boolean }>;
      expect(splitFindings.find((f) => f.check === "lock session connection")).toMatchObject({
        ok: true,
      });

      for (const url of [session.via(db.url), db.url]) {
        const result = await cli(["check", "--connection", url, "--json"]);
        const findings = JSON.parse(result.stdout) as Array<{
          check: string;
          ok: boolean;
          detail: string;
        }>;
        expect(
          findings.find((f) => f.check === "lock session connection"),
          url,
        ).toMatchObject({ ok: true });
        expect(result.code, result.stdout).toBe(0);
      }
    } finally {
      await transaction.stop();
      await session.stop();
    }
  }, 60_000);

  it("a session-mode pooler that does not reset a backend between clients fails the reset check", async () => {
    type Finding = { check: string; ok: boolean; detail: string; fix?: string };
    const resetFinding = async (resetQuery: string | null) => {
      const bouncer = await startPgBouncer(db.url, {
        poolMode: "session",
        settings: resetQuery === null ? {} : { server_reset_query: resetQuery },
      });
      try {
        const result = await cli(["check", "--connection", bouncer.via(db.url), "--json"]);
        const findings = JSON.parse(result.stdout) as Finding[];
        return {
          code: result.code,
          finding: findings.find((f) => f.check === "lock session backend reset"),
        };
      } finally {
        await bouncer.stop();
      }
    };

    // PgBouncer's default, DISCARD ALL: the lock and the setting end with their client. (A busy PgBouncer may
    // give the next client another backend, whose settings then say nothing: the lock's end still counts.)
    const byDefault = await resetFinding(null);
    expect(byDefault.finding).toMatchObject({
      ok: true,
      detail: expect.stringMatching(
        /advisory lock and settings ended with the client|advisory lock ended with the client \(backend \d+\); its settings were not checked/,
      ),
    });
    expect(byDefault.code).toBe(0);

    // No reset at all: both stay.
    const none = await resetFinding("");
    expect(none.code).toBe(1);
    expect(none.finding).toMatchObject({ ok: false, fix: expect.stringMatching(/DISCARD ALL/) });
    expect(none.finding!.detail).toMatch(/an advisory lock outlived the client that took it/);
    expect(none.finding!.detail).toMatch(/with the settings of the one before/);

    // Settings reset, locks kept: a dead process's locks would stay held.
    const settingsOnly = await resetFinding("RESET ALL");
    expect(settingsOnly.finding).toMatchObject({ ok: false });
    expect(settingsOnly.finding!.detail).toMatch(/an advisory lock outlived the client/);
    expect(settingsOnly.finding!.detail).not.toMatch(/settings of the one before/);

    // Locks released, settings kept: the next lock session on that backend would be refused.
    const locksOnly = await resetFinding("select pg_advisory_unlock_all()");
    expect(locksOnly.finding).toMatchObject({ ok: false });
    expect(locksOnly.finding!.detail).toMatch(
      /^backend \d+ was handed to the next client with the settings/,
    );
  }, 90_000);
});

describe("graphile-worker-locks status --watch", () => {
  it("refreshes: two frames in about 3 seconds, until it is killed", async () => {
    const child = spawn(process.execPath, [bin, "status", "--watch", "-c", db.url], {
      env: { ...process.env, DATABASE_URL: "" },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (chunk: Buffer) => (stdout += chunk.toString()));
    child.stderr.on("data", (chunk: Buffer) => (stderr += chunk.toString()));
    const exited = new Promise<NodeJS.Signals | number | null>((resolve) =>
      child.once("exit", (code, signal) => resolve(signal ?? code)),
    );
    const frames = () => stdout.split("\x1b[H\x1b[2J").slice(1);
    try {
      const deadline = Date.now() + 20_000;
      while (frames().length < 2 && child.exitCode === null && Date.now() < deadline) {
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      // still running: --watch does not stop after a frame
      expect(child.exitCode, stderr).toBeNull();
    } finally {
      child.kill("SIGTERM");
    }
    expect(await exited).toBe("SIGTERM");
    expect(stderr).toBe("");
    const shown = frames();
    expect(shown.length).toBeGreaterThanOrEqual(2);
    const times = shown.map((frame) => {
      expect(frame).toMatch(
        /^\d{4}-\d\d-\d\dT[\d:.]+Z\nHeld locks \(\d+\):[\s\S]*Lock sessions connected/,
      );
      return Date.parse(frame.slice(0, 24));
    });
    // each frame is a new reading, taken after the 2-second pause
    expect(times[1]! - times[0]!).toBeGreaterThanOrEqual(2000);
  }, 60_000);
});
