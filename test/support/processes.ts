import { fork, type ChildProcess } from "node:child_process";
import { fileURLToPath } from "node:url";

const WORKER = fileURLToPath(new URL("../fixtures/worker.ts", import.meta.url));
/** Gives the worker processes the graphile-worker TEST_GRAPHILE_WORKER selects, as vitest does here. */
const GRAPHILE_WORKER_HOOK = fileURLToPath(new URL("./graphile-worker-hook.mjs", import.meta.url));

export interface WorkerProcessOptions {
  name: string;
  concurrency?: number;
  strategy?: "drop" | "reschedule" | "raise";
  limit?: number;
  localQueue?: boolean;
  /** Gives the runner to `locks.attach`. */
  attach?: boolean;
  /** Another worker script of test/fixtures/ (file name) than worker.ts. */
  script?: string;
  /** Adds the task `rated` with this rate (see test/fixtures/worker.ts). */
  rate?: { limit: number; period: number; lock?: boolean; ride?: boolean };
}

export interface WorkerProcess {
  readonly name: string;
  readonly pid: number;
  readonly child: ChildProcess;
  /** Where `graphile-worker` resolved to in that process (a file URL). */
  readonly graphileWorker: string;
  /** Graceful stop: the runner finishes its jobs, records are flushed, locks released. */
  stop(): Promise<void>;
  /** Resolves when the process has exited (after a kill). */
  exited: Promise<number | null>;
}

/** Starts test/fixtures/worker.ts in a separate Node process and waits until its runner is started. */
export async function startWorkerProcess(
  url: string,
  options: WorkerProcessOptions,
): Promise<WorkerProcess> {
  const script = options.script
    ? fileURLToPath(new URL(`../fixtures/${options.script}`, import.meta.url))
    : WORKER;
  const child = fork(script, [], {
    execArgv: ["--import", "tsx", "--import", GRAPHILE_WORKER_HOOK],
    env: {
      ...process.env,
      DATABASE_URL: url,
      WORKER_NAME: options.name,
      CONCURRENCY: String(options.concurrency ?? 4),
      STRATEGY: options.strategy ?? "drop",
      LIMIT: String(options.limit ?? 1),
      LOCAL_QUEUE: options.localQueue ? "1" : "0",
      ATTACH: options.attach ? "1" : "0",
      RATE: options.rate ? JSON.stringify(options.rate) : "",
    },
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const exited = new Promise<number | null>((resolve) =>
    child.once("exit", (code) => resolve(code)),
  );
  const ready = await new Promise<{ graphileWorker: string }>((resolve, reject) => {
    child.once("message", (message) => resolve(message as { graphileWorker: string }));
    child.once("exit", (code) =>
      reject(new Error(`worker ${options.name} exited early with ${code}`)),
    );
  });
  return {
    name: options.name,
    pid: child.pid!,
    child,
    graphileWorker: ready.graphileWorker,
    exited,
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return;
      child.send({ type: "stop" });
      await exited;
    },
  };
}
