#!/usr/bin/env node
/**
 * `graphile-worker-locks`: the operator's command line. `status` (who holds what, who waits), `check` (a
 * doctor), `migrate` (the only command that writes). Reads the config graphile-worker reads (`-C`, else a
 * `graphile.config.*` in the current folder, found by graphile-config as graphile-worker's CLI finds it),
 * resolved as graphile-worker resolves it; `--connection` and `DATABASE_URL` where there is none.
 */
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import { loadConfig } from "graphile-config/load";
import pg from "pg";
import { InvalidArgumentError } from "../errors.js";
import { lockKey } from "../key.js";
import { migrate } from "../migrate.js";
import { resolveWorkerOptions, validateLocksPresetOptions } from "../preset/preset.js";
import { findTaskFiles, pickTaskFile, readFileRules } from "../preset/files.js";
import {
  mergeRules,
  payloadWithoutCron,
  ruledLimitKeys,
  ruledRateKey,
  validateTaskRules,
  type TaskLocksOptions,
} from "../preset/rules.js";
import {
  readOnlyClient,
  readStatus,
  runChecks,
  schemaLevel,
  type Status,
  type Target,
} from "./inspect.js";

const USAGE = `Usage: graphile-worker-locks <command> [options]

Commands:
  status [task] [payload]  held locks, parked jobs, unique windows, lock sessions;
                           with a task and its JSON payload: who holds that job's key, and who waits
  check                    diagnoses the setup; exits 1 when something is wrong
  migrate                  installs or upgrades the library's schema (the only command that writes)

Options:
  -C, --config <file>      the graphile config file (default: graphile.config.* in the current folder,
                           as graphile-worker finds it; .ts needs a loader such as tsx)
  -c, --connection <url>   the database (default: the config's, or DATABASE_URL)
  -s, --schema <name>      graphile-worker's schema (default: the config's, or graphile_worker)
      --json               machine-readable output (status, check)
      --watch              refresh status every 2 seconds
      --processes <n>      check: worker processes sharing the database (default 1)
      --max-skew <ms>      check: allowed clock difference (default 2000)
  -h, --help
`;

class UsageError extends Error {}

/** A task's rules as its workers apply them: its task file's `locks` export under the config's entry. */
interface FocusRules {
  rules: TaskLocksOptions | undefined;
  /** Where they come from: the config, the task file, both, or nowhere. */
  from: string[];
}

async function rulesOf(worker: GraphileConfig.WorkerOptions, task: string): Promise<FocusRules> {
  const fromConfig = worker.locks?.tasks?.[task] as TaskLocksOptions | undefined;
  if (fromConfig !== undefined) validateTaskRules(task, fromConfig, "`worker.locks.tasks`");
  let fromFile: TaskLocksOptions | undefined;
  let file: string | undefined;
  // Only the task directory is read: the rules of a task list given to `run()` in code are in no file.
  if (worker.taskDirectory) {
    file = pickTaskFile(
      await findTaskFiles(worker.taskDirectory, task),
      worker.fileExtensions,
    )?.fullPath;
    if (file) {
      try {
        fromFile = await readFileRules(task, file);
      } catch (error) {
        // (wrong rules in a file that loads are reported as the workers report them)
        if (error instanceof InvalidArgumentError) throw error;
        throw new Error(
          `cannot tell the rules of task '${task}': its file ${file} could not be loaded (${(error as Error).message}). ` +
            `The workers apply the rules its \`locks\` export declares; run this command as the workers run (a TypeScript task file needs a loader, e.g. NODE_OPTIONS="--import tsx/esm")`,
          { cause: error },
        );
      }
    }
  }
  return {
    rules: mergeRules(fromFile, fromConfig),
    from: [
      ...(fromFile ? [`the \`locks\` export of ${file}`] : []),
      ...(fromConfig ? ["the config's `worker.locks.tasks`"] : []),
    ],
  };
}

/** A session as `status` names it: its worker process and host (when it is a lock session), and its backend. */
function holder(s: {
  pid: number;
  processId: number | null;
  host: string | null;
  applicationName: string;
}): string {
  const worker = s.processId === null ? "process ?" : `process ${s.processId} on ${s.host}`;
  return `${worker}  backend pid ${s.pid} (${s.applicationName})`;
}

function formatStatus(status: Status, focus: string | null): string {
  const out: string[] = [];
  if (focus) out.push(focus, "");
  out.push(`Held locks (${status.held.length}):`);
  for (const h of status.held) {
    out.push(
      `  key ${h.lockKey}  task ${h.taskIdentifier ?? "?"}  job ${h.jobId ?? "?"}  ${holder(h)}  since ${h.since ?? "?"}`,
    );
  }
  out.push(`Parked jobs (${status.lines.reduce((n, l) => n + l.waiting, 0)}):`);
  for (const l of status.lines) {
    out.push(
      `  key ${l.lockKey}  ${l.waiting} waiting  oldest since ${l.oldestSince}  next wake ${l.nextWake ?? "?"}`,
    );
  }
  out.push(`Unique windows alive: ${status.uniqueWindowsAlive}`);
  out.push(`Throttled keys (${status.throttled.length}):`);
  for (const t of status.throttled) {
    out.push(
      `  ${t.label}  ${t.used}/${t.limit} in the last ${t.period} ms  ${t.waiting} waiting  next slot ${t.nextAt}`,
    );
  }
  out.push(`Paused keys (${status.paused.length}):`);
  for (const p of status.paused) out.push(`  ${p.label}  until ${p.until}`);
  out.push(`Lock sessions connected (${status.sessions.length}):`);
  for (const s of status.sessions) {
    out.push(`  ${holder(s)}  since ${s.connectedAt}`);
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
  const worker = resolveWorkerOptions(preset ?? {});
  validateLocksPresetOptions(worker.locks);
  const connectionString =
    values.connection ??
    worker.locks?.connectionString ??
    worker.connectionString ??
    process.env.DATABASE_URL;
  if (!connectionString) {
    throw new UsageError(
      `no database: pass --connection, -C <config>, or set DATABASE_URL (${preset ? `the config sets no \`worker.connectionString\`` : `no -C, and no graphile.config.* in ${process.cwd()}`})`,
    );
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
      let rateKeys: bigint[] | null = null;
      let focus: string | null = null;
      if (rest.length > 0) {
        const [task, json] = rest as [string, string | undefined];
        let payload: unknown;
        try {
          payload = JSON.parse(json ?? "{}");
        } catch (error) {
          throw new UsageError(`the payload must be JSON: ${(error as Error).message}`);
        }
        const { rules, from } = await rulesOf(worker, task);
        const limits = rules && ruledLimitKeys(task, rules, payload, worker.locks?.defaults);
        const ruled = limits ? limits.flatMap((l) => l.slots) : null;
        // Without rules (or with unique-only rules) its jobs take no lock: the key shown is the one an
        // empty entry would give them.
        keys = ruled ?? [lockKey(task, payloadWithoutCron(payload))];
        // The group of each limit whose keys other tasks may share.
        const grouped =
          limits && (limits.length > 1 || limits[0]!.group !== task)
            ? `; ${limits.map((l, i) => `${limits.length > 1 ? `limit ${i}: ` : ""}group ${l.group}, key ${l.slots.join(", ")}`).join("; ")}`
            : "";
        const rateKey = rules && ruledRateKey(task, rules, payload, worker.locks?.defaults);
        rateKeys = rateKey ? [rateKey, keys[0]!] : [keys[0]!];
        const why = !rules
          ? "no rules for this task in the config or its task file, so its jobs take no lock; the key of the whole payload"
          : !ruled
            ? `its rules (${from.join(" and ")}) are unique only, so its jobs take no lock; the key of the whole payload`
            : `rules from ${from.join(" and ")}`;
        focus = `Task ${task}, payload ${JSON.stringify(payload)}: key ${keys.join(", ")} (${why}${grouped})`;
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
          const status = await readStatus(client, target, keys, rateKeys);
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
