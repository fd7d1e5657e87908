#!/usr/bin/env node
/**
 * `graphile-worker-locks`: the operator's command line. `status` (who holds what, who waits), `check` (a
 * doctor), `migrate` (the only command that writes). Reads the same config file as graphile-worker
 * (`-C`), or `--connection` / `DATABASE_URL`.
 */
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import pg from "pg";
import { slotKeys } from "./key.js";
import { migrate } from "./migrate.js";
import { payloadWithoutCron, resolveWorkerOptions } from "./preset.js";
import type { TaskLocksOptions } from "./preset/rules.js";
import {
  readOnlyClient,
  readStatus,
  runChecks,
  schemaLevel,
  type Status,
  type Target,
} from "./cli/inspect.js";

const USAGE = `Usage: graphile-worker-locks <command> [options]

Commands:
  status [task] [payload]  held locks, parked jobs, unique windows, lock sessions;
                           with a task and its JSON payload: who holds that job's key, and who waits
  check                    diagnoses the setup; exits 1 when something is wrong
  migrate                  installs or upgrades the library's schema (the only command that writes)

Options:
  -C, --config <file>      a graphile config file (graphile.config.mjs; .ts needs a loader such as tsx)
  -c, --connection <url>   the database (default: the config's, or DATABASE_URL)
  -s, --schema <name>      graphile-worker's schema (default: the config's, or graphile_worker)
      --json               machine-readable output (status, check)
      --watch              refresh status every 2 seconds
      --processes <n>      check: worker processes sharing the database (default 1)
      --max-skew <ms>      check: allowed clock difference (default 2000)
  -h, --help
`;

class UsageError extends Error {}

async function loadConfig(path: string | undefined): Promise<GraphileConfig.Preset | null> {
  if (!path) return null;
  const mod = (await import(pathToFileURL(resolve(path)).href)) as {
    default?: GraphileConfig.Preset;
  };
  if (!mod.default || typeof mod.default !== "object") {
    throw new UsageError(`${path} has no default export (a graphile config preset)`);
  }
  return mod.default;
}

function formatStatus(status: Status, focus: string | null): string {
  const out: string[] = [];
  if (focus) out.push(focus, "");
  out.push(`Held locks (${status.held.length}):`);
  for (const h of status.held) {
    out.push(
      `  key ${h.lockKey}  task ${h.taskIdentifier ?? "?"}  job ${h.jobId ?? "?"}  pid ${h.pid} (${h.applicationName})  since ${h.since ?? "?"}`,
    );
  }
  out.push(`Parked jobs (${status.lines.reduce((n, l) => n + l.waiting, 0)}):`);
  for (const l of status.lines) {
    out.push(
      `  key ${l.lockKey}  ${l.waiting} waiting  oldest since ${l.oldestSince}  next wake ${l.nextWake ?? "?"}`,
    );
  }
  out.push(`Unique windows alive: ${status.uniqueWindowsAlive}`);
  out.push(`Lock sessions connected (${status.sessions.length}):`);
  for (const s of status.sessions) {
    out.push(`  pid ${s.pid}  ${s.applicationName}  since ${s.connectedAt}`);
  }
  return out.join("\n");
}

export async function main(argv: string[]): Promise<number> {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      config: { type: "string", short: "C" },
      connection: { type: "string", short: "c" },
      schema: { type: "string", short: "s" },
      json: { type: "boolean" },
      watch: { type: "boolean" },
      processes: { type: "string" },
      "max-skew": { type: "string" },
      help: { type: "boolean", short: "h" },
    },
  });
  const [command, ...rest] = positionals;
  if (values.help || !command) {
    process.stdout.write(USAGE);
    return values.help ? 0 : 2;
  }
  const preset = await loadConfig(values.config);
  const worker = preset ? resolveWorkerOptions(preset) : {};
  const connectionString =
    values.connection ??
    worker.locks?.connectionString ??
    worker.connectionString ??
    process.env.DATABASE_URL;
  if (!connectionString) {
    throw new UsageError("no database: pass --connection, -C <config>, or set DATABASE_URL");
  }
  const target: Target = {
    connectionString,
    lockConnectionString: worker.locks?.lockConnectionString,
    schema: worker.locks?.schema ?? "graphile_worker_locks",
    workerSchema: values.schema ?? worker.schema ?? "graphile_worker",
  };

  switch (command) {
    case "migrate": {
      const pool = new pg.Pool({ connectionString, max: 1 });
      try {
        await migrate({ pgPool: pool, schema: target.schema, workerSchema: target.workerSchema });
        const client = await pool.connect();
        try {
          const level = await schemaLevel(client as unknown as pg.Client, target.schema);
          process.stdout.write(
            `graphile-worker-locks schema '${target.schema}' is at level ${level}\n`,
          );
        } finally {
          client.release();
        }
      } finally {
        await pool.end();
      }
      return 0;
    }
    case "check": {
      const findings = await runChecks(target, {
        processes: Number(values.processes ?? 1),
        maxPoolSize: worker.maxPoolSize ?? 10,
        maxSkewMs: Number(values["max-skew"] ?? 2000),
      });
      if (values.json) process.stdout.write(`${JSON.stringify(findings, null, 2)}\n`);
      else {
        for (const f of findings) {
          process.stdout.write(`${f.ok ? "ok  " : "FAIL"} ${f.check}: ${f.detail}\n`);
          if (!f.ok && f.fix) process.stdout.write(`     fix: ${f.fix}\n`);
        }
      }
      return findings.every((f) => f.ok) ? 0 : 1;
    }
    case "status": {
      let keys: bigint[] | null = null;
      let focus: string | null = null;
      if (rest.length > 0) {
        const [task, json] = rest as [string, string | undefined];
        let payload: unknown;
        try {
          payload = JSON.parse(json ?? "{}");
        } catch (error) {
          throw new UsageError(`the payload must be JSON: ${(error as Error).message}`);
        }
        const rules = worker.locks?.tasks?.[task] as TaskLocksOptions | undefined;
        const key = (rules?.key as ((p: unknown) => unknown) | undefined) ?? payloadWithoutCron;
        keys = slotKeys(
          task,
          key(payload),
          rules?.limit ?? 1,
          rules?.key ? "key(payload)" : "payload",
        );
        focus = `Task ${task}, payload ${JSON.stringify(payload)}: key ${keys.join(", ")}${rules ? "" : " (no rules for this task in the config: the whole payload is the key)"}`;
      }
      const client = readOnlyClient(connectionString);
      await client.connect();
      try {
        const level = await schemaLevel(client, target.schema);
        if (level === null) {
          process.stderr.write(
            `graphile-worker-locks's schema '${target.schema}' is not installed in this database: nothing is locked through it yet (workers install it on start, or run \`graphile-worker-locks migrate\`)\n`,
          );
          return 1;
        }
        for (;;) {
          const status = await readStatus(client, target, keys);
          const text = values.json
            ? JSON.stringify(
                focus ? { focus, keys: keys!.map(String), ...status } : status,
                null,
                2,
              )
            : formatStatus(status, focus);
          if (values.watch)
            process.stdout.write(`\x1b[H\x1b[2J${new Date().toISOString()}\n${text}\n`);
          else {
            process.stdout.write(`${text}\n`);
            return 0;
          }
          await new Promise((r) => setTimeout(r, 2000));
        }
      } finally {
        await client.end();
      }
    }
    default:
      throw new UsageError(`unknown command '${command}'`);
  }
}

// Run when executed (the package's `bin`), not when imported.
if (
  import.meta.url === pathToFileURL(process.argv[1] ?? "").href ||
  process.argv[1]?.endsWith("/graphile-worker-locks")
) {
  main(process.argv.slice(2)).then(
    (code) => (process.exitCode = code),
    (error: unknown) => {
      if (
        error instanceof UsageError ||
        (error as { code?: string }).code === "ERR_PARSE_ARGS_UNKNOWN_OPTION"
      ) {
        process.stderr.write(`graphile-worker-locks: ${(error as Error).message}\n\n${USAGE}`);
        process.exitCode = 2;
      } else {
        process.stderr.write(
          `graphile-worker-locks: ${(error as Error).message ?? String(error)}\n`,
        );
        process.exitCode = 1;
      }
    },
  );
}
