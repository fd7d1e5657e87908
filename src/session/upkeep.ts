/**
 * The lock session connection's upkeep, beside its lock statements: a heartbeat while something is held (a
 * silently dead connection matters then), the holder registry written when the holds changed, and a sweep of
 * waiters whose job ran on its safety-net delay. Each runs on a timer while the connection exists; close()
 * waits for what is in flight (`settled`).
 */
import type pg from "pg";
import type { HoldImpl } from "./holds.js";
import type { Sql } from "../sql.js";

/** Waiters whose job ran on its safety-net delay instead of being woken are swept this often. */
const SWEEP_WAITERS_INTERVAL_MS = 60_000;

/** What the upkeep reads and tells of the connection it keeps. */
export interface UpkeptConnection {
  /** The connection's state (connection.ts). */
  readonly state: string;
  readonly client: pg.Client | null;
  readonly claimToken: string | null;
  /** Set when the holds changed since the holder registry was last written. */
  registryDirty: boolean;
  /** Statements sent on the connection. */
  statements: number;
  lost(client: pg.Client | null, error: Error): void;
  checkBackend(
    client: pg.Client,
    pid: number | undefined,
    what: string,
    marked: boolean | undefined,
  ): boolean;
}

export interface UpkeepOptions {
  sql: Sql;
  onWarning(message: string, error?: unknown): void;
  heartbeatIntervalMs: number;
  heartbeatTimeoutMs: number;
  registryIntervalMs: number;
}

export class Upkeep {
  private heartbeatPending = false;
  private readonly timers: NodeJS.Timeout[] = [];
  /** Heartbeats, registry writes and sweeps in flight, so that close() can wait for them. */
  private readonly sideQueries = new Set<Promise<unknown>>();

  constructor(
    private readonly options: UpkeepOptions,
    private readonly connection: UpkeptConnection,
    private readonly host: {
      holds(): HoldImpl[];
      inFlightSince(): number | null;
    },
  ) {}

  /** Starts the timers, once (they run until `stop`). */
  start(): void {
    if (this.timers.length > 0) return;
    const heartbeat = setInterval(() => this.heartbeat(), this.options.heartbeatIntervalMs);
    const registry = setInterval(
      () => this.side(this.writeRegistry()),
      this.options.registryIntervalMs,
    );
    const sweep = setInterval(() => {
      if (this.connection.state !== "ready" || !this.connection.client) return;
      this.side(
        this.connection.client.query(this.options.sql.sweepWaiters).catch((error: unknown) => {
          this.options.onWarning("Could not sweep waiters", error);
        }),
      );
    }, SWEEP_WAITERS_INTERVAL_MS);
    for (const timer of [heartbeat, registry, sweep]) timer.unref();
    this.timers.push(heartbeat, registry, sweep);
  }

  /**
   * Checks the connection while something is held: that is when a silently dead connection matters (a
   * network that drops packets without a reset leaves a query waiting for many minutes). A heartbeat, or a
   * lock statement, unanswered for `heartbeatTimeoutMs` counts as a lost connection: the holders' signals
   * abort, as they would if the connection had failed outright.
   */
  private heartbeat(): void {
    const client = this.connection.client;
    if (this.connection.state !== "ready" || !client) return;
    const timeout = this.options.heartbeatTimeoutMs;
    const inFlightSince = this.host.inFlightSince();
    if (inFlightSince !== null) {
      if (performance.now() - inFlightSince > timeout) {
        this.connection.lost(
          client,
          new Error(`A lock statement went unanswered for ${timeout} ms`),
        );
      }
      return;
    }
    if (this.host.holds().length === 0 || this.heartbeatPending) return;
    this.heartbeatPending = true;
    const timer = setTimeout(() => {
      this.connection.lost(
        client,
        new Error(`The lock session did not answer a heartbeat in ${timeout} ms`),
      );
    }, timeout);
    this.side(
      client
        .query<{ pid: number; marked: boolean }>(this.options.sql.heartbeat, [
          this.connection.claimToken,
        ])
        .then(
          ({ rows }) => {
            clearTimeout(timer);
            this.heartbeatPending = false;
            this.connection.checkBackend(client, rows[0]?.pid, "a heartbeat", rows[0]?.marked);
          },
          (error: Error) => {
            clearTimeout(timer);
            this.heartbeatPending = false;
            this.connection.lost(client, error);
          },
        ),
    );
  }

  /** Runs a statement beside the lock batches (heartbeat, registry, sweep), counted and awaited by close(). */
  side(promise: Promise<unknown> | undefined): void {
    if (!promise) return;
    this.connection.statements++;
    this.sideQueries.add(promise);
    void promise.finally(() => this.sideQueries.delete(promise));
  }

  private async writeRegistry(): Promise<void> {
    if (
      !this.connection.registryDirty ||
      this.connection.state !== "ready" ||
      !this.connection.client
    )
      return;
    this.connection.registryDirty = false;
    const holds = this.host.holds();
    try {
      // (a hold of several limits has a row per key)
      const rows = holds.flatMap((h) => h.keyTexts.map((key) => ({ key, h })));
      await this.connection.client.query(this.options.sql.writeHolders, [
        rows.map((r) => r.key),
        rows.map((r) => r.h.info.taskIdentifier),
        rows.map((r) => r.h.info.jobId),
        rows.map((r) => r.h.since.toISOString()),
      ]);
    } catch (error) {
      this.connection.registryDirty = true;
      if (this.connection.state === "ready")
        this.options.onWarning("Could not update the lock holder registry", error);
    }
  }

  /** The connection was lost: a heartbeat of it no longer waits. */
  connectionLost(): void {
    this.heartbeatPending = false;
  }

  /** Stops the timers. */
  stop(): void {
    for (const timer of this.timers.splice(0)) clearInterval(timer);
  }

  /** Resolves when the side statements in flight have settled. */
  async settled(): Promise<void> {
    await Promise.allSettled([...this.sideQueries]);
  }
}
