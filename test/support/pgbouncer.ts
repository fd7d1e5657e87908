/**
 * A real PgBouncer in front of the test server, on a free loopback port, configured as docker-compose.yml's
 * (every database proxied, SCRAM authentication, transaction pooling unless told otherwise). PgBouncer does
 * not run as root: as root, it is started with `-u postgres` (the user the embedded server runs as).
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { createServer, type AddressInfo } from "node:net";
import { tmpdir, userInfo } from "node:os";
import { join } from "node:path";
import pg from "pg";

const CANDIDATES = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer"];

/** The pgbouncer binary (PGBOUNCER, else the usual places), or null when there is none. */
export function pgbouncerBinary(): string | null {
  const given = process.env.PGBOUNCER;
  if (given) return existsSync(given) ? given : null;
  return CANDIDATES.find((path) => existsSync(path)) ?? null;
}

/** The version of the pgbouncer binary, e.g. "1.18.0", or null. */
export function pgbouncerVersion(): string | null {
  const binary = pgbouncerBinary();
  if (!binary) return null;
  const out = spawnSync(binary, ["--version"], { encoding: "utf8" }).stdout ?? "";
  return /PgBouncer (\d+\.\d+(?:\.\d+)?)/.exec(out)?.[1] ?? null;
}

/** Why PgBouncer tests cannot run here, or null when they can. */
export function pgbouncerMissing(): string | null {
  return pgbouncerBinary()
    ? null
    : "pgbouncer is not installed (apt-get install pgbouncer, or set PGBOUNCER to its binary): PgBouncer tests skipped";
}

export interface PgBouncerOptions {
  /** @defaultValue "transaction" */
  poolMode?: "transaction" | "session";
  /** PgBouncer 1.21+ only. */
  maxPreparedStatements?: number;
  /** More `[pgbouncer]` settings, written after the others (so they win). */
  settings?: Record<string, string | number>;
}

export interface PgBouncer {
  /** `url` with its host and port replaced by PgBouncer's. */
  via(url: string): string;
  readonly port: number;
  stop(): Promise<void>;
}

/** Starts PgBouncer in front of the server of `serverUrl` and waits until it accepts connections. */
export async function startPgBouncer(
  serverUrl: string,
  options: PgBouncerOptions = {},
): Promise<PgBouncer> {
  const binary = pgbouncerBinary();
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
  await writeFile(
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
      ...Object.entries(options.settings ?? {}).map(([name, value]) => `${name} = ${value}`),
      "",
    ].join("\n"),
    { mode: 0o644 },
  );
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
  try {
    await waitUntilAccepting(child, via(serverUrl), () => stderr);
  } catch (error) {
    await stop();
    throw error;
  }
  return { via, port, stop };
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

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
