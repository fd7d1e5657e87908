/** Ending node-postgres clients without waiting on a server that may never answer. */
import type pg from "pg";

/** Ends `client` without waiting for it to answer, and ignores what it says from now on. */
export function discard(client: pg.Client): Promise<void> {
  client.removeAllListeners("end");
  client.on("error", () => undefined);
  return client.end().catch(() => undefined);
}

/** Cuts the socket of `client`, so that whatever waits on it (a connect, a query) fails now. */
export function destroySocket(client: pg.Client | null | undefined): void {
  (
    client as { connection?: { stream?: { destroy(): void } } } | null | undefined
  )?.connection?.stream?.destroy();
}
