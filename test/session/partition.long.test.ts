/**
 * The lock session protects itself from a silent network: a partition is made by dropping the lock
 * session's packets in the kernel (iptables, as root; skipped otherwise), and the server must free its locks
 * within `partitionTimeout`, after the holder was told. Real PostgreSQL, a real runner. In the long step
 * (TEST_LONG=1): each run waits out the timeout. The server's own timeouts are in timeouts.test.ts.
 */
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { describe, expect, it } from "vitest";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";
import { nextEvent } from "../support/runner.js";

const h = useExclusiveHarness();
const { db, cleanups, newLocks, runner } = h;

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
