/**
 * What a refused lock session left on its own backend, released through the pooler that refused it.
 *
 * A session refused because a statement reached another backend (a transaction pooler its connect-time
 * probe missed) leaves the locks it took on its own backend, held until the pooler closes that backend. The
 * release statement (`releaseLeftovers`, sql.ts) releases them when it runs on that backend, still carrying
 * the session's mark, and does nothing anywhere else, so it is sent through the pooler until it lands there:
 * every LEFTOVERS_RETRY_MS, for up to LEFTOVERS_TRY_MS, or until `stop()`.
 *
 * A pooler hands out the idle backend released last first (PgBouncer's default), so a try usually lands on
 * the session's backend as soon as whoever holds it lets go. But a try that was running when that happened
 * releases its own backend later, on top of the session's: with no other traffic, every later try lands
 * there again. So when a try finds the session's backend idle and was not given it, the round walks down:
 * it sends the statement again inside a transaction, which keeps that try's backend, from one more client
 * at a time (up to LEFTOVERS_WALK_MAX), each being given the next idle backend, until one lands on the
 * session's. The walk's transactions end before the round does.
 */
import pg from "pg";
import type { ClientConfig } from "pg";
import { destroySocket, discard } from "./pgclient.js";
import type { Sql } from "../sql.js";

const LEFTOVERS_TRY_MS = 60_000;
const LEFTOVERS_RETRY_MS = 200;
/** The most backends one round keeps in a transaction at once, walking down to the session's. */
const LEFTOVERS_WALK_MAX = 16;
/** How long one statement of a try may wait (for a pooler slot or a backend) before the round gives up. */
const STATEMENT_WAIT_MS = 5_000;

export interface LeftoverReleaseOptions {
  sql: Sql;
  /** The pooler the refused session connected through. */
  client: ClientConfig;
  onWarning(message: string): void;
}

interface TryAnswer {
  released: boolean;
  ended: boolean;
  idle: boolean;
}

export class LeftoverRelease {
  /** The clients of the walk: the first sends each round's try, the others join when a round walks down. */
  private readonly clients: pg.Client[] = [];
  private stopped = false;
  private readonly done: Promise<void>;

  /** Starts trying to release what the session marked `token` took on backend `pid`. */
  constructor(
    private readonly options: LeftoverReleaseOptions,
    private readonly pid: number,
    private readonly token: string,
  ) {
    this.done = this.run();
  }

  /** Stops trying (cutting a try in flight) and waits until the tries are over. */
  async stop(): Promise<void> {
    this.stopped = true;
    for (const client of this.clients) destroySocket(client);
    await this.done;
  }

  private async run(): Promise<void> {
    const deadline = performance.now() + LEFTOVERS_TRY_MS;
    try {
      while (!this.stopped && performance.now() < deadline) {
        const result = await this.round().catch(() => null);
        if (result) {
          this.options.onWarning(
            result === "released"
              ? `Released the locks the refused lock session had taken on its backend ${this.pid}`
              : `The refused lock session's backend ${this.pid} has ended, and the locks it took there with it`,
          );
          return;
        }
        if (!this.stopped) await new Promise((resolve) => setTimeout(resolve, LEFTOVERS_RETRY_MS));
      }
      if (!this.stopped) {
        this.options.onWarning(
          `Could not reach the refused lock session's backend ${this.pid} again in ${LEFTOVERS_TRY_MS / 1000} s: ` +
            "the locks it took there stay held until the pooler closes that backend",
        );
      }
    } finally {
      for (const client of this.clients.splice(0)) void discard(client);
    }
  }

  /**
   * One try, and the walk down when it found the session's backend idle beneath others. Resolves with the
   * outcome, or null to try again later. A client that fails is dropped (the pooler may have had no room
   * for it yet).
   */
  private async round(): Promise<"released" | "ended" | null> {
    let answer = await this.send(0, false);
    if (!answer?.idle || answer.released || answer.ended) return outcome(answer);
    const walking: pg.Client[] = [];
    try {
      for (let depth = 0; depth < LEFTOVERS_WALK_MAX && !this.stopped; depth++) {
        answer = await this.send(depth, true);
        if (!answer) return null;
        const client = this.clients[depth]!;
        if (answer.released) {
          // (the locks are released already; the commit keeps the registry rows' deletion)
          await this.finish(client, "commit");
          return "released";
        }
        walking.push(client);
        if (answer.ended || !answer.idle) return outcome(answer);
      }
      return null;
    } finally {
      await Promise.all(walking.map((client) => this.finish(client, "rollback")));
    }
  }

  /**
   * Sends the release statement from the walk's client `depth` (connecting it first if needed), inside a
   * transaction when `keep`, whose backend it then keeps. Resolves with the answer, or null when the client
   * failed (and was dropped).
   */
  private async send(depth: number, keep: boolean): Promise<TryAnswer | null> {
    let client = this.clients[depth];
    try {
      if (!client) {
        client = new pg.Client(this.options.client);
        client.on("error", () => undefined);
        this.clients.push(client);
        await this.waited(client, (c) => c.connect());
      }
      if (keep) await this.waited(client, (c) => c.query("begin"));
      const { rows } = await this.waited(client, (c) =>
        c.query<TryAnswer>(this.options.sql.releaseLeftovers, [this.pid, this.token]),
      );
      return rows[0] ?? null;
    } catch {
      if (client) this.drop(client);
      return null;
    }
  }

  /** Ends the transaction of `client` in the walk (dropping the client if that fails). */
  private async finish(client: pg.Client, statement: "commit" | "rollback"): Promise<void> {
    try {
      await this.waited(client, (c) => c.query(statement));
    } catch {
      this.drop(client);
    }
  }

  /** `work` on `client`, which fails (its socket cut) once stopped or after STATEMENT_WAIT_MS. */
  private async waited<T>(client: pg.Client, work: (client: pg.Client) => Promise<T>): Promise<T> {
    if (this.stopped) throw new Error("stopped");
    const timer = setTimeout(() => destroySocket(client), STATEMENT_WAIT_MS);
    try {
      return await work(client);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Ends `client` and takes it out of the walk (a walk of fewer clients connects a new one). */
  private drop(client: pg.Client): void {
    const i = this.clients.indexOf(client);
    if (i >= 0) this.clients.splice(i, 1);
    void discard(client);
  }
}

function outcome(answer: TryAnswer | null): "released" | "ended" | null {
  return answer?.released ? "released" : answer?.ended ? "ended" : null;
}
