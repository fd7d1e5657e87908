/**
 * The lock session protects itself from the server's timeouts and from a silent network. Real PostgreSQL, real
 * runners; the timeouts are set on a role of their own that only the lock session connects as; a partition
 * is made by dropping the lock session's packets in the kernel (iptables, as root; skipped otherwise).
 */
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, inject, it } from "vitest";
import { InvalidArgumentError, makeLocks } from "../../src/index.js";
import { sessionSettings } from "../../src/session/keepalive.js";
import { withAdmin } from "../support/admin.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { countEvents, nextEvent, Timeline } from "../support/runner.js";

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

/** Whether this process may drop packets with iptables (root, and iptables installed). */
const iptablesMissing: string | null = (() => {
  if (process.getuid?.() !== 0) return "not root";
  const probe = spawnSync("iptables", ["-w", "-n", "-L", "INPUT"], { encoding: "utf8" });
  return probe.status === 0 ? null : `iptables unusable: ${probe.error?.message ?? probe.stderr}`;
})();

/**
 * Drops every packet between the loopback ports `client` and `server`, both ways, in the kernel: neither
 * end's packets (data, keepalive probes, acknowledgements, resets) reach the other, as in a partition.
 * Undone by the test's cleanups.
 */
function partition(client: number, server: number): void {
  const tag = `gwl-test-${randomBytes(4).toString("hex")}`;
  const rules = [
    ["--sport", String(client), "--dport", String(server)],
    ["--sport", String(server), "--dport", String(client)],
  ].map((ports) => [
    "INPUT",
    "-i",
    "lo",
    "-p",
    "tcp",
    ...ports,
    "-m",
    "comment",
    "--comment",
    tag,
    "-j",
    "DROP",
  ]);
  const iptables = (args: string[]) => {
    const r = spawnSync("iptables", ["-w", ...args], { encoding: "utf8" });
    if (r.status !== 0) throw new Error(`iptables ${args.join(" ")}: ${r.stderr}`);
  };
  cleanups.push(async () => {
    for (const rule of rules) spawnSync("iptables", ["-w", "-D", ...rule]);
  });
  for (const rule of rules) iptables(["-I", ...rule]);
}

describe.skipIf(iptablesMissing !== null)("a lock session cut off by the network", () => {
  for (const unacknowledged of [false, true]) {
    it(`loses its locks on the server within partitionTimeout, after its holder's abort signal fired (${
      unacknowledged ? "data sent to it unacknowledged" : "idle"
    })`, async () => {
      const partitionTimeout = 5000;
      const locks = newLocks({
        heartbeatInterval: 250,
        heartbeatTimeout: 1000,
        partitionTimeout,
        reconnectDelay: { min: 50, max: 200 },
      });
      const started = deferred<void>();
      let abortedAt: number | null = null;
      const task = locks.exclusive("partitioned", async (_p: { n: number }, helpers) => {
        started.resolve();
        await new Promise<void>((resolve) =>
          helpers.abortSignal?.addEventListener("abort", () => {
            abortedAt = Date.now();
            resolve();
          }),
        );
      });
      await runner({ connectionString: db.url, concurrency: 1, taskList: { partitioned: task } });
      await locks.connect();
      const n = unacknowledged ? 2 : 1;
      await h.utils.addJob("partitioned", { n });
      await started.promise;
      const pid = locks.status().pid!;
      const key = task.lockKey({ n }).toString();
      const held = async () =>
        (
          await h.q(
            `select 1 from pg_locks where locktype = 'advisory' and pid = $1
                and ((classid::int8 << 32) | objid::int8) = $2::int8`,
            [pid, key],
          )
        ).rowCount === 1;
      expect(await held()).toBe(true);
      const { rows } = await h.q<{ port: number }>(
        "select client_port as port from pg_stat_activity where pid = $1",
        [pid],
      );
      const lost = nextEvent(locks, "lock:lost", undefined, 30_000);

      partition(rows[0]!.port, Number(new URL(db.url).port));
      const cutAt = Date.now();
      if (unacknowledged) {
        // Notifications on the channel the session listens to: its backend sends them, and nothing comes
        // back, so TCP keepalive (which only probes a connection with nothing unacknowledged) does not apply.
        for (let i = 0; i < 5; i++)
          await h.q("select pg_notify('gwl_release', $1)", ["0".repeat(500)]);
      }
      await lost;
      const lostAt = Date.now();
      // Within the bound, with room for a loaded machine (the kernel's default would be hours).
      await waitFor(async () => !(await held()), {
        timeoutMs: partitionTimeout + 10_000,
        intervalMs: 100,
        message: "the server to free the key of the partitioned session",
      });
      const freedAfter = Date.now() - cutAt;
      // Freed by the server's own timers (nothing from the client reached it), and only once the holder had
      // been told: its abort signal fired, and `lock:lost`, before.
      expect(freedAfter).toBeGreaterThan(partitionTimeout - 2000);
      expect(abortedAt).not.toBeNull();
      expect(Math.max(abortedAt!, lostAt) - cutAt).toBeLessThan(freedAfter);
      const backend = await h.q("select 1 from pg_stat_activity where pid = $1", [pid]);
      expect(backend.rowCount).toBe(0);
    }, 60_000);
  }
});
