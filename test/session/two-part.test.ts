/**
 * Two statements of one transaction in one write (two-part.ts, the lock statement and its wakes): the first
 * is answered while the second still runs, the second sees and keeps the first's transaction-level locks,
 * an error in either is reported with whether the first was answered, and the named statements stay usable
 * on the pipelined connection afterwards. Real PostgreSQL; a second connection watches the first's backend.
 */
import pg from "pg";
import { describe, expect, it } from "vitest";
import { backendPid } from "../../src/session/backend.js";
import type { BatchRow } from "../../src/session/batch.js";
import { TwoPartQuery, type NamedQuery, type TwoPartEnd } from "../../src/session/two-part.js";
import { deferred, waitFor } from "../support/db.js";
import { useExclusiveHarness } from "../support/exclusive.js";

const h = useExclusiveHarness();

/** A pipelined client, as the lock session's. */
async function pipelined(): Promise<pg.Client> {
  const client = new pg.Client({ connectionString: h.db.url, pipeline: true } as pg.ClientConfig);
  await client.connect();
  h.cleanups.push(() => client.end());
  return client;
}

/** A pipelined client, its backend's pid, and a connection of its own to watch that backend's locks. */
async function watched(): Promise<{ client: pg.Client; observer: pg.Client; pid: number }> {
  const client = await pipelined();
  return { client, observer: await h.connect(), pid: await backendPid(client) };
}

/** Sends `first` and `second` as one two-part query: the first part's rows, and how it ended. */
function send(client: pg.Client, first: NamedQuery, second: NamedQuery, onFirst = () => {}) {
  const firstRows = deferred<BatchRow[]>();
  const ended = new Promise<TwoPartEnd>((resolve) => {
    client.query(
      new TwoPartQuery(
        first,
        second,
        (rows) => {
          firstRows.resolve(rows);
          onFirst();
        },
        resolve,
      ),
    );
  });
  return { firstRows: firstRows.promise, ended };
}

/** The advisory locks of two integers (transaction or session) that backend `pid` holds or waits for. */
async function pairLocks(observer: pg.Client, pid: number) {
  const { rows } = await observer.query<{ classid: number; objid: number; granted: boolean }>(
    `select classid::int, objid::int, granted from pg_locks
      where locktype = 'advisory' and objsubid = 2 and pid = $1 order by 1, 2`,
    [pid],
  );
  return rows;
}

describe("a two-part query", () => {
  it("answers its first statement while its second still runs, in one transaction", async () => {
    const { client, observer, pid } = await watched();
    // The observer holds (9, 2): the second statement waits for it, so it cannot have run when the first's
    // rows arrive.
    await observer.query("select pg_advisory_lock(9, 2)");
    const first: NamedQuery = {
      name: "two_part_test_first",
      text: `select 1 as op, cardinality($1::text[]) as i, array_to_string($1::text[], '|') as key
        from (select pg_advisory_xact_lock(9, 1)) x`,
      values: [["a,b", 'quote " and \\ slash', null]],
    };
    const second: NamedQuery = {
      name: "two_part_test_second",
      text: `select 2 as op, $1::int as i, 'second' as key from (select pg_advisory_xact_lock(9, 2)) x`,
      values: [7],
    };
    const before = client.query<{ n: number }>("select 41 + 1 as n");
    const { firstRows, ended } = send(client, first, second);
    const after = client.query<{ n: number }>("select 43 as n");
    expect(await firstRows).toEqual([{ op: 1, i: 3, key: 'a,b|quote " and \\ slash' }]);
    expect((await before).rows).toEqual([{ n: 42 }]);
    // The second waits for (9, 2), still holding (9, 1), which the first took in the same transaction.
    await waitFor(
      async () =>
        JSON.stringify(await pairLocks(observer, pid)) ===
        JSON.stringify([
          { classid: 9, objid: 1, granted: true },
          { classid: 9, objid: 2, granted: false },
        ]),
      { message: "the second statement to wait, the first's lock held" },
    );
    await observer.query("select pg_advisory_unlock(9, 2)");
    expect(await ended).toEqual({
      error: null,
      firstAnswered: true,
      rows: [{ op: 2, i: 7, key: "second" }],
    });
    expect((await after).rows).toEqual([{ n: 43 }]);
    // The transaction ended with the second statement: its locks are gone.
    expect(await pairLocks(observer, pid)).toEqual([]);
    // Both statements are prepared now, and run again as such.
    const again = send(client, first, { ...second, values: [8] });
    expect((await again.ended).rows).toEqual([{ op: 2, i: 8, key: "second" }]);
  });

  it("a failed second statement: the first was answered, its transaction rolled back, the connection goes on", async () => {
    const { client, observer, pid } = await watched();
    const first: NamedQuery = {
      name: "two_part_fail_first",
      text: `select 1 as op, 0 as i, null::text as key from (select pg_advisory_xact_lock(9, 3)) x`,
      values: [],
    };
    const second: NamedQuery = {
      name: "two_part_fail_second",
      text: `select 2 as op, 10 / $1::int as i, null::text as key`,
      values: [0],
    };
    let answeredFirst = false;
    const { ended } = send(client, first, second, () => (answeredFirst = true));
    const end = await ended;
    expect(answeredFirst).toBe(true);
    expect(end.firstAnswered).toBe(true);
    expect((end.error as pg.DatabaseError).code).toBe("22012");
    expect(await pairLocks(observer, pid)).toEqual([]);
    // The second statement was prepared before it failed: it is bound again, not parsed again.
    const again = send(client, first, { ...second, values: [5] });
    expect(await again.ended).toEqual({
      error: null,
      firstAnswered: true,
      rows: [{ op: 2, i: 2, key: null }],
    });
    expect((await client.query<{ n: number }>("select 1 as n")).rows).toEqual([{ n: 1 }]);
  });

  it("a second statement that does not parse is parsed again next time, not taken as prepared", async () => {
    const client = await pipelined();
    const first: NamedQuery = {
      name: "two_part_parse_first",
      text: "select 1 as op, 0 as i, null::text as key",
      values: [],
    };
    const second: NamedQuery = {
      name: "two_part_parse_second",
      text: "select 2 as op, no_such_column as i, null::text as key",
      values: [],
    };
    for (let round = 0; round < 2; round++) {
      const end = await send(client, first, second).ended;
      expect(end.firstAnswered).toBe(true);
      // (a statement taken as prepared would fail with 26000, "prepared statement does not exist")
      expect((end.error as pg.DatabaseError).code).toBe("42703");
    }
  });

  it("a failed first statement: the second never runs, and the first is reported unanswered", async () => {
    const { client, observer, pid } = await watched();
    const first: NamedQuery = {
      name: "two_part_first_fails",
      text: "select 1 as op, 10 / $1::int as i, null::text as key",
      values: [0],
    };
    // (a session lock: it would outlive the transaction, had the statement run)
    const second: NamedQuery = {
      name: "two_part_never_runs",
      text: "select 2 as op, 0 as i, pg_advisory_lock(9, 4)::text as key",
      values: [],
    };
    let answeredFirst = false;
    const end = await send(client, first, second, () => (answeredFirst = true)).ended;
    expect(answeredFirst).toBe(false);
    expect(end.firstAnswered).toBe(false);
    expect((end.error as pg.DatabaseError).code).toBe("22012");
    expect(await pairLocks(observer, pid)).toEqual([]);
    const again = await send(client, { ...first, values: [2] }, second).ended;
    expect(again).toEqual({ error: null, firstAnswered: true, rows: [{ op: 2, i: 0, key: "" }] });
    expect(await pairLocks(observer, pid)).toEqual([{ classid: 9, objid: 4, granted: true }]);
  });
});
