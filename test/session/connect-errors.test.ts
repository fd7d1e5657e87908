/**
 * `locks.connect()` says what failed when the lock session cannot connect, with the driver's error as `cause`.
 */
import { afterEach, describe, expect, it } from "vitest";
import { makeLocks, type Locks } from "../../src/index.js";
import { useTestDatabase } from "../support/db.js";
import { quietLogger } from "../support/runner.js";

const db = useTestDatabase();
let locks: Locks | undefined;

afterEach(async () => {
  await locks?.release();
  locks = undefined;
});

/** The error `locks.connect()` rejects with, for a lock session connecting to `lockConnectionString`. */
async function connectError(lockConnectionString: string): Promise<Error & { code?: string }> {
  locks = makeLocks({
    connectionString: db.url,
    lockConnectionString,
    logger: quietLogger,
    reconnectDelay: { min: 60_000, max: 60_000 },
  });
  const error = await locks.connect().then(
    () => null,
    (e: unknown) => e as Error & { code?: string },
  );
  expect(error, "connect() should have failed").not.toBeNull();
  return error!;
}

function withUrl(change: (url: URL) => void): string {
  const url = new URL(db.url);
  change(url);
  return url.toString();
}

describe("connect() failures", () => {
  it("names a refused port", async () => {
    const error = await connectError(withUrl((u) => ((u.hostname = "127.0.0.1"), (u.port = "1"))));
    expect(error.code).toBe("GWL_LOCK_SESSION_UNAVAILABLE");
    expect(error.message).toBe(
      "The lock session could not connect to 127.0.0.1:1 (connection refused)",
    );
    expect((error.cause as { code?: string }).code).toBe("ECONNREFUSED");
  });

  it("names a failed authentication", async () => {
    const error = await connectError(withUrl((u) => (u.password = "not-the-password")));
    const { hostname, port } = new URL(db.url);
    expect(error.code).toBe("GWL_LOCK_SESSION_UNAVAILABLE");
    expect(error.message).toContain(
      `could not connect to ${hostname}:${port} (authentication failed:`,
    );
    expect((error.cause as { code?: string }).code).toBe("28P01");
  });

  it("names a missing database", async () => {
    const error = await connectError(withUrl((u) => (u.pathname = "/gwl_no_such_database")));
    expect(error.code).toBe("GWL_LOCK_SESSION_UNAVAILABLE");
    expect(error.message).toMatch(/\(database missing: .*gwl_no_such_database.* does not exist\)$/);
    expect((error.cause as { code?: string }).code).toBe("3D000");
  });

  it("names a host name that does not resolve", async () => {
    // An empty label: the resolver refuses the name without sending a query anywhere.
    const error = await connectError(withUrl((u) => (u.hostname = "gwl-test..invalid")));
    expect(error.code).toBe("GWL_LOCK_SESSION_UNAVAILABLE");
    expect(error.message).toMatch(
      /could not connect to gwl-test\.\.invalid:\d+ \(host name not resolved \(DNS\)\)$/,
    );
    expect((error.cause as { code?: string }).code).toBe("ENOTFOUND");
  });

  it("gives the same error to an acquisition while the session cannot connect", async () => {
    const first = await connectError(withUrl((u) => ((u.hostname = "127.0.0.1"), (u.port = "1"))));
    const again = await locks!.connect().then(
      () => null,
      (e: unknown) => e as Error,
    );
    expect(again?.message).toBe(first.message);
    expect(again?.cause).toBeDefined();
  });
});
