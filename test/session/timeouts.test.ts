/**
 * The lock session protects itself from the server's timeouts, and `partitionTimeout` is checked. Real
 * PostgreSQL, real runners; the timeouts are set on a role of their own that only the lock session connects
 * as. The partition itself (a silent network) is in partition.long.test.ts.
 */
import { randomBytes } from "node:crypto";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, inject, it } from "vitest";
import { InvalidArgumentError, makeLocks } from "../../src/index.js";
import { sessionSettings } from "../../src/session/keepalive.js";
import { withAdmin } from "../support/admin.js";
import { waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { countEvents, Timeline } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const admin = (sql: string) => withAdmin(inject("baseUrl"), (client) => client.query(sql));

/** A login role of this file's own, for the lock session only, so that its settings reach nothing else. */
const role = `gwl_t_role_${randomBytes(4).toString("hex")}`;
const password = randomBytes(12).toString("hex");
let serverVersion = 0;

beforeAll(async () => {
  await admin(`create role ${role} login superuser password '${password}'`);
  const { rows } = await admin("select current_setting('server_version_num')::int as v");
  serverVersion = (rows[0] as { v: number }).v;
});

afterAll(async () => {
  await admin(`select pg_terminate_backend(pid) from pg_stat_activity where usename = '${role}'`);
  await admin(`drop role if exists ${role}`);
});

function roleUrl(): string {
  const url = new URL(db.url);
  url.username = role;
  url.password = password;
  return url.toString();
}

const ROLE_TIMEOUTS = [
  { setting: "idle_session_timeout", value: "500ms", since: 140000 },
  { setting: "idle_in_transaction_session_timeout", value: "500ms", since: 0 },
  { setting: "statement_timeout", value: "200ms", since: 0 },
  { setting: "lock_timeout", value: "200ms", since: 0 },
];

describe("timeouts set on the lock session's role", () => {
  for (const { setting, value, since } of ROLE_TIMEOUTS) {
    it(`${setting} = ${value}: long jobs and a lock statement that waits keep the session, and burn no attempt`, async (ctx) => {
      if (serverVersion < since) ctx.skip();
      await admin(`alter role ${role} set ${setting} = '${value}'`);
      cleanups.push(() => admin(`alter role ${role} reset all`));
      const locks = newLocks({ lockConnectionString: roleUrl() });
      let sessionClient: pg.Client | undefined;
      h.watchLockStatements((client) => (sessionClient ??= client));
      const counts = countEvents(locks, ["lock:lost", "session:connected"]);
      const timeline = new Timeline();
      type P = { k: string };
      const task = locks.exclusive(
        "timeouts",
        async (p: P, helpers) => {
          const end = timeline.begin(p.k, helpers.job.id, helpers.job.attempts);
          // Several times the role's timeouts, while the session sits idle between heartbeats.
          await sleep(2000);
          end();
        },
        { onConflict: "reschedule", key: (p: P) => p },
      );
      await runner({ connectionString: db.url, concurrency: 4, taskList: { timeouts: task } });
      await locks.connect();
      const pid = locks.status().pid;

      // A maintenance statement holds the waiters table, which the lock statement of a `reschedule` job reads:
      // the statement waits for it, longer than the role's timeouts allow.
      const maintenance = await h.connect();
      await maintenance.query("begin");
      await maintenance.query("lock table graphile_worker_locks.waiters in access exclusive mode");
      await h.utils.addJobs(
        ["a", "b", "c", "d"].map((k) => ({ identifier: "timeouts", payload: { k } })),
      );
      await waitFor(
        async () =>
          (
            await h.q(
              `select 1 from pg_locks where pid = $1 and not granted
                  and relation = 'graphile_worker_locks.waiters'::regclass`,
              [pid],
            )
          ).rowCount,
        { message: "the lock statement to wait for the waiters table" },
      );
      await sleep(1000);
      await maintenance.query("commit");

      await waitFor(
        async () =>
          timeline.executions.length === 4 &&
          timeline.executions.every((e) => e.end !== null) &&
          (await h.jobRows()).length === 0,
        { timeoutMs: 60_000, message: "every job to run and complete" },
      );
      expect(timeline.executions.map((e) => [e.key, e.attempts]).sort()).toEqual([
        ["a", 1],
        ["b", 1],
        ["c", 1],
        ["d", 1],
      ]);
      expect(counts).toEqual({ "lock:lost": 0, "session:connected": 1 });
      expect(locks.status()).toMatchObject({ state: "ready", pid });
      // The session's own setting, whatever the role says.
      const { rows } = await sessionClient!.query<Record<string, string>>(`show ${setting}`);
      expect(rows[0]![setting]).toBe("0");
    }, 90_000);
  }
});

describe("partitionTimeout", () => {
  it("sets keepalive probes from halfway, a tenth apart, the last on the bound, and tcp_user_timeout to it", () => {
    const timers = (ms: number) =>
      Object.fromEntries(sessionSettings(ms).server.filter(([name]) => name.startsWith("tcp_")));
    expect(timers(60_000)).toEqual({
      tcp_keepalives_idle: "30",
      tcp_keepalives_interval: "6",
      tcp_keepalives_count: "5",
      tcp_user_timeout: "60000",
    });
    expect(timers(5000)).toEqual({
      tcp_keepalives_idle: "1",
      tcp_keepalives_interval: "1",
      tcp_keepalives_count: "5",
      tcp_user_timeout: "5000",
    });
    expect(sessionSettings(60_000).keepAliveInitialDelayMillis).toBe(30_000);
  });

  it("is validated: a number of ms, longer than the heartbeat takes to find a dead connection", () => {
    const make = (options: Record<string, unknown>) =>
      makeLocks({ connectionString: db.url, ...options });
    expect(() => make({ partitionTimeout: "60s" })).toThrow(InvalidArgumentError);
    expect(() => make({ partitionTimeout: 500 })).toThrow(/`partitionTimeout` must be a number/);
    expect(() => make({ partitionTimeout: 25_000 })).toThrow(
      /`partitionTimeout` \(25000 ms\) must exceed `heartbeatInterval` \+ `heartbeatTimeout` \(25000 ms\)/,
    );
    expect(() =>
      make({ heartbeatInterval: 1000, heartbeatTimeout: 60_000, partitionTimeout: 60_000 }),
    ).toThrow(/must exceed/);
  });
});
