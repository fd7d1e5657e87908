/**
 * A real PgBouncer in front of the test server, on a free loopback port, configured as docker-compose.yml's
 * (every database proxied, SCRAM authentication, transaction pooling unless told otherwise). PgBouncer does
 * not run as root: as root, it is started with `-u postgres` (the user the embedded server runs as).
 *
 * Two binaries can be at hand: the system's package (Debian 12's is 1.18, without prepared-statement
 * support) and the build of scripts/build-pgbouncer.sh (1.21+, with it). {@link pgbouncers} lists both, each
 * with its version, or with why it is missing.
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { homedir, tmpdir, userInfo } from "node:os";
import { join } from "node:path";
import pg from "pg";
import { freePort } from "../../scripts/postgres.js";

const CANDIDATES = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer"];

/** The first PgBouncer version that carries protocol-level prepared statements in transaction mode. */
const PREPARED_STATEMENTS_SINCE = "1.21.0";

export interface PgBouncerBinary {
  readonly path: string;
  /** e.g. "1.18.0" */
  readonly version: string;
}

export interface PgBouncerCandidate {
  /** "system": the installed package; "built": scripts/build-pgbouncer.sh's build. */
  readonly kind: "system" | "built";
  readonly binary: PgBouncerBinary | null;
  /** Why `binary` is null: a message for the skipped tests. */
  readonly missing: string | null;
}

/** The system's pgbouncer binary (PGBOUNCER, else the usual places), or null when there is none. */
export function pgbouncerBinary(): string | null {
  const given = process.env.PGBOUNCER;
  if (given) return existsSync(given) ? given : null;
  return CANDIDATES.find((path) => existsSync(path)) ?? null;
}

/** The version a pgbouncer binary reports, e.g. "1.18.0", or null. */
export function pgbouncerVersion(binary = pgbouncerBinary()): string | null {
  if (!binary) return null;
  const out = spawnSync(binary, ["--version"], { encoding: "utf8" }).stdout ?? "";
  const version = /PgBouncer (\d+\.\d+(?:\.\d+)?)/.exec(out)?.[1];
  if (!version) return null;
  return version.split(".").length === 2 ? `${version}.0` : version;
}

/** Why PgBouncer tests cannot run here on the system's binary, or null when they can. */
export function pgbouncerMissing(): string | null {
  return pgbouncerBinary()
    ? null
    : "pgbouncer is not installed (apt-get install pgbouncer, or set PGBOUNCER to its binary): PgBouncer tests skipped";
}

/** Where scripts/build-pgbouncer.sh builds: one directory per version, each with `bin/pgbouncer`. */
export function builtPgbouncerDir(): string {
  return join(process.env.XDG_CACHE_HOME || join(homedir(), ".cache"), "gwl-pgbouncer");
}

/**
 * The PgBouncer 1.21+ build: PGBOUNCER_BUILT, else the newest version of 1.21 or later that
 * scripts/build-pgbouncer.sh left in {@link builtPgbouncerDir}.
 */
export function builtPgbouncer(): PgBouncerBinary | null {
  const given = process.env.PGBOUNCER_BUILT;
  const paths = given
    ? [given]
    : safeReaddir(builtPgbouncerDir())
        // (a dot-directory is a build being moved into place)
        .filter((name) => !name.startsWith("."))
        .map((name) => join(builtPgbouncerDir(), name, "bin", "pgbouncer"));
  const found = paths
    .filter((path) => existsSync(path))
    .map((path) => ({ path, version: pgbouncerVersion(path) }))
    .filter((b): b is PgBouncerBinary => b.version !== null && carriesPreparedStatements(b.version))
    .sort((a, b) => compareVersions(b.version, a.version));
  return found[0] ?? null;
}

/** The system's binary and the 1.21+ build, each with its version or with why it is missing. */
export function pgbouncers(): PgBouncerCandidate[] {
  const system = pgbouncerBinary();
  const systemVersion = system ? pgbouncerVersion(system) : null;
  const built = builtPgbouncer();
  return [
    {
      kind: "system",
      binary: system && systemVersion ? { path: system, version: systemVersion } : null,
      missing: !system
        ? pgbouncerMissing()
        : systemVersion
          ? null
          : `${system} --version does not name a PgBouncer version: its PgBouncer tests skipped`,
    },
    {
      kind: "built",
      binary: built,
      missing: built
        ? null
        : process.env.PGBOUNCER_BUILT
          ? `PGBOUNCER_BUILT=${process.env.PGBOUNCER_BUILT} is not a PgBouncer ${PREPARED_STATEMENTS_SINCE} or later: the PgBouncer 1.21+ tests skipped`
          : `no PgBouncer 1.21+ build in ${builtPgbouncerDir()} (\`bash scripts/build-pgbouncer.sh\` builds one; ` +
            "PGBOUNCER_BUILT names another binary): the PgBouncer 1.21+ tests skipped",
    },
  ];
}

/** Whether PgBouncer `version` carries protocol-level prepared statements (`max_prepared_statements`). */
export function carriesPreparedStatements(version: string): boolean {
  return compareVersions(version, PREPARED_STATEMENTS_SINCE) >= 0;
}

/** Compares dotted versions numerically: negative, zero or positive. */
export function compareVersions(a: string, b: string): number {
  const x = a.split(".").map(Number);
  const y = b.split(".").map(Number);
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    const diff = (x[i] ?? 0) - (y[i] ?? 0);
    if (diff !== 0) return diff;
  }
  return 0;
}

function safeReaddir(dir: string): string[] {
  try {
    return readdirSync(dir);
  } catch {
    return [];
  }
}

export interface PgBouncerOptions {
  /** The pgbouncer binary. @defaultValue the system's ({@link pgbouncerBinary}) */
  binary?: string;
  /** @defaultValue "transaction" */
  poolMode?: "transaction" | "session";
  /** `max_prepared_statements`, PgBouncer 1.21+ only (unset: PgBouncer's default, 0 before 1.24, 200 since). */
  maxPreparedStatements?: number;
  /** More `[pgbouncer]` settings, written after the others (so they win). */
  settings?: Record<string, string | number>;
}

export interface PgBouncer {
  /** `url` with its host and port replaced by PgBouncer's. */
  via(url: string): string;
  readonly port: number;
  /** Rewrites the configuration with `settings` over the started ones and has PgBouncer reload it. */
  reload(settings: Record<string, string | number>): Promise<void>;
  stop(): Promise<void>;
}

/** Starts PgBouncer in front of the server of `serverUrl` and waits until it accepts connections. */
export async function startPgBouncer(
  serverUrl: string,
  options: PgBouncerOptions = {},
): Promise<PgBouncer> {
  const binary = options.binary ?? pgbouncerBinary();
  if (!binary) throw new Error(pgbouncerMissing()!);
  const server = new URL(serverUrl);
  const user = decodeURIComponent(server.username);
  const password = decodeURIComponent(server.password);
  const dir = await mkdtemp(join(tmpdir(), "gwl-pgbouncer-"));
  await chmod(dir, 0o755);
  const port = await freePort();
  const config = join(dir, "pgbouncer.ini");
  const userlist = join(dir, "userlist.txt");
  await writeFile(userlist, `"${user}" "${password}"\n`, { mode: 0o644 });
  let settings = options.settings ?? {};
  const writeConfig = () =>
    writeFile(
      config,
      [
        "[databases]",
        `* = host=${server.hostname} port=${server.port}`,
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        `listen_port = ${port}`,
        "unix_socket_dir =",
        "auth_type = scram-sha-256",
        `auth_file = ${userlist}`,
        `pool_mode = ${options.poolMode ?? "transaction"}`,
        "max_client_conn = 500",
        "default_pool_size = 20",
        "ignore_startup_parameters = extra_float_digits,options",
        ...(options.maxPreparedStatements !== undefined
          ? [`max_prepared_statements = ${options.maxPreparedStatements}`]
          : []),
        ...Object.entries(settings).map(([name, value]) => `${name} = ${value}`),
        "",
      ].join("\n"),
      { mode: 0o644 },
    );
  await writeConfig();
  const args = userInfo().uid === 0 ? ["-u", "postgres", config] : [config];
  const child = spawn(binary, args, { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr?.on("data", (chunk: Buffer) => (stderr += chunk.toString()));
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));

  const via = (url: string): string => {
    const u = new URL(url);
    u.hostname = "127.0.0.1";
    u.port = String(port);
    return u.toString();
  };
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill("SIGINT");
      await Promise.race([exited, sleep(5_000)]);
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
      await exited;
    }
    await rm(dir, { recursive: true, force: true });
  };
  const reload = async (more: Record<string, string | number>) => {
    settings = { ...settings, ...more };
    await writeConfig();
    const reloads = () => stderr.split("SIGHUP").length;
    const before = reloads();
    child.kill("SIGHUP");
    const deadline = Date.now() + 5_000;
    while (reloads() === before) {
      if (Date.now() > deadline)
        throw new Error(`pgbouncer did not reload its configuration: ${stderr}`);
      await sleep(20);
    }
  };
  try {
    await waitUntilAccepting(child, via(serverUrl), () => stderr);
  } catch (error) {
    await stop();
    throw error;
  }
  return { via, port, reload, stop };
}

async function waitUntilAccepting(
  child: ChildProcess,
  url: string,
  stderr: () => string,
): Promise<void> {
  const deadline = Date.now() + 15_000;
  for (;;) {
    if (child.exitCode !== null)
      throw new Error(`pgbouncer exited with ${child.exitCode}: ${stderr()}`);
    const client = new pg.Client({ connectionString: url });
    client.on("error", () => undefined);
    try {
      await client.connect();
      await client.query("select 1");
      return;
    } catch (error) {
      if (Date.now() > deadline)
        throw new Error(`pgbouncer did not accept connections: ${String(error)}\n${stderr()}`);
      await sleep(100);
    } finally {
      await client.end().catch(() => undefined);
    }
  }
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
