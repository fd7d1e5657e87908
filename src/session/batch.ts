/**
 * One lock statement: the requests that queued up while the previous statement was in flight, the query
 * that carries them (the lock statement of the branches they use: `LockShape`, sql.ts), and the decoding
 * of its answer rows (`BatchOp`).
 */
import { linesOf, type HoldImpl, type LockRequest } from "./holds.js";
import { BatchOp, type LockShape, type Sql } from "../sql.js";
import type { NamedQuery } from "./two-part.js";

export interface Batch {
  unlocks: HoldImpl[];
  /** Requests for one key. */
  singles: LockRequest[];
  /** Semaphore requests (several slots, the first free one taken). */
  multis: LockRequest[];
  /** Requests of jobs with several limits (one slot of each, all or nothing). */
  stacked: LockRequest[];
  /** Single keys asked with their job's rate (`LockRequest.ride`). */
  rated: LockRequest[];
  /** Early wakes of the next job in line of these holds' keys. */
  prewakes: HoldImpl[];
  /** Whether idle workers of this process fetch the jobs woken early (they are not announced). */
  wakeHere: boolean;
}

export function makeBatch(
  unlocks: HoldImpl[],
  locks: LockRequest[],
  prewakes: HoldImpl[],
  wakeHere: boolean,
): Batch {
  const singles: LockRequest[] = [];
  const multis: LockRequest[] = [];
  const stacked: LockRequest[] = [];
  const rated: LockRequest[] = [];
  for (const request of locks) {
    const list = request.limits
      ? stacked
      : request.ride
        ? rated
        : request.slots.length === 1
          ? singles
          : multis;
    list.push(request);
  }
  return { unlocks, singles, multis, stacked, rated, prewakes, wakeHere };
}

/**
 * The keys a batch unlocks, in order: each hold's key, or every key of a hold of several limits. `holdAt`,
 * when some hold has several keys: the unlock's index (from 0) of each key.
 */
export function unlockKeys(unlocks: readonly HoldImpl[]): {
  keys: string[];
  holdAt: number[] | null;
} {
  if (unlocks.every((hold) => !hold.stacked))
    return { keys: unlocks.map((hold) => hold.keyText), holdAt: null };
  const keys: string[] = [];
  const holdAt: number[] = [];
  unlocks.forEach((hold, index) => {
    for (const key of hold.keyTexts) {
      keys.push(key);
      holdAt.push(index);
    }
  });
  return { keys, holdAt };
}

/** The lines the unlocks wake: each line key, with the job that released it. */
export function unlockLines(unlocks: readonly HoldImpl[]): {
  keys: Array<bigint | null>;
  jobIds: Array<string | null>;
} {
  const keys: Array<bigint | null> = [];
  const jobIds: Array<string | null> = [];
  for (const hold of unlocks) {
    for (const key of linesOf(hold.info)) {
      keys.push(key);
      jobIds.push(hold.info.jobId);
    }
  }
  return { keys, jobIds };
}

/**
 * A PostgreSQL array literal of integers (keys, job ids; null as NULL). node-postgres would quote every
 * element and run two regular expressions over it, which costs Node.js CPU per key (see bench/README.md,
 * section "Integer array literals"). Every element is an integer by construction (a bigint, or
 * the decimal text of one: graphile-worker's job ids, a key's text).
 */
function integerArray(values: ReadonlyArray<bigint | string | null>): string {
  let literal = "{";
  for (let i = 0; i < values.length; i++) {
    if (i > 0) literal += ",";
    const value = values[i];
    literal += value === null ? "NULL" : String(value);
  }
  return literal + "}";
}

/** The parameters of a batch's `rated` requests (sql.ts, `ratedBranch`). */
function ratedValues(rated: readonly LockRequest[]): unknown[] {
  const rides = rated.map((r) => r.ride!);
  return [
    integerArray(rated.map((r) => r.slots[0]!)),
    integerArray(rated.map((r) => (r.info.reschedule ? r.info.jobId : null))),
    integerArray(rides.map((ride) => ride.rateKey)),
    rides.map((ride) => ride.label),
    integerArray(rides.map((ride) => String(ride.limit))),
    rides.map((ride) => ride.periodMs),
    integerArray(rides.map((ride) => String(ride.burst))),
    rides.map((ride) => ride.pauseKeys.join(",")),
  ];
}

/**
 * Whether a request of several limits can take them all by one expression (`fastLimits`, sql.ts): each
 * limit one key, and no line to keep its place in.
 */
const fastStacked = (r: LockRequest) =>
  !r.info.reschedule && r.limits!.every((l) => l.length === 1);

/**
 * The query of a batch: the lock statement with the branches it uses (`LockShape`, sql.ts). `pid` is the
 * session's backend, marked with `mark`: the only one the statement takes or releases anything on.
 */
export function batchQuery(sql: Sql, batch: Batch, pid: number, mark: string): NamedQuery {
  return batchQueries(sql, batch, pid, mark, false).lock;
}

/**
 * The queries of a batch: the lock statement and, when `answerFirst` and the batch wakes lines or wakes
 * jobs early, its wakes in a second statement of its transaction (`LockShape.split`; sent together by
 * two-part.ts), so that the lock statement's answer does not wait for the wakes. A batch of requests with
 * their rate stays one statement: lock_rated writes the rate's starts, which a failed wake would roll back
 * after their jobs had been told they may start.
 */
export function batchQueries(
  sql: Sql,
  batch: Batch,
  pid: number,
  mark: string,
  answerFirst: boolean,
): { lock: NamedQuery; wake: NamedQuery | null } {
  const { unlocks, singles, multis, stacked, rated, prewakes, wakeHere } = batch;
  const waking = unlockLines(unlocks);
  // (the requests of several limits go one way or the other, all of them: their answers share one list)
  const fast = stacked.length > 0 && stacked.every(fastStacked);
  const shape: LockShape = {
    lines: singles.some((r) => r.info.reschedule),
    slots: multis.length > 0,
    stacked: stacked.length > 0 && !fast,
    fastLimits: fast ? Math.max(...stacked.map((r) => r.limits!.length)) : 0,
    rated: rated.length > 0,
    wakes: waking.keys.length > 0,
    prewakes: prewakes.length > 0,
  };
  shape.split = answerFirst && !shape.rated && (shape.wakes || shape.prewakes);
  const values: unknown[] = [
    integerArray(unlockKeys(unlocks).keys),
    integerArray(singles.map((r) => r.slots[0]!)),
    pid,
    mark,
  ];
  // (in the order of lockStatementParams)
  if (shape.lines)
    values.push(integerArray(singles.map((r) => (r.info.reschedule ? r.info.jobId : null))));
  if (shape.slots) values.push(multis.map((r) => r.slots.join(",")));
  if (shape.stacked) {
    values.push(
      stacked.map((r) =>
        r.limits!.map((slots, i) => `${r.lines![i]}:${slots.join(",")}`).join(";"),
      ),
      integerArray(stacked.map((r) => (r.info.reschedule ? r.info.jobId : null))),
    );
  }
  for (let n = 0; n < shape.fastLimits; n++)
    values.push(integerArray(stacked.map((r) => r.limits![n]?.[0] ?? null)));
  if (shape.rated) values.push(...ratedValues(rated));
  const wakeValues: unknown[] = [];
  if (shape.wakes) wakeValues.push(integerArray(waking.keys), integerArray(waking.jobIds));
  if (shape.prewakes)
    wakeValues.push(
      integerArray(prewakes.map((hold) => hold.keyText)),
      !wakeHere,
      integerArray(prewakes.map((hold) => hold.info.jobId)),
    );
  if (!shape.split) {
    values.push(...wakeValues);
    return { lock: { ...sql.lockStatement(shape), values }, wake: null };
  }
  // (the lock statement keeps the keys to wake, whose lines it locks before its unlocks)
  if (shape.wakes) values.push(wakeValues[0]);
  return {
    lock: { ...sql.lockStatement(shape), values },
    wake: { ...sql.wakeStatement(shape), values: [pid, mark, ...wakeValues] },
  };
}

export interface BatchRow {
  op: number;
  i: number;
  key: string | null;
}

/** What a lock statement answered, by each request's place (from 1) in its list of the batch. */
export interface BatchAnswer {
  /** The pid of the backend that ran the statement. */
  backendPid: number | undefined;
  /** Whether that backend still carried the session's mark. */
  marked: boolean;
  /** Unlocks that PostgreSQL answered false. */
  failedUnlocks: Set<number>;
  /** Single keys with a row: LOCK_FAILED, WAIT_FOR_RELEASE or LOCKED_WITH_LINE (no row: taken). */
  singles: Map<number, number>;
  /** The slot each semaphore request took (null: none). */
  slots: Map<number, string | null>;
  /** The job each early wake woke. */
  prewoken: Map<number, string>;
  /** What each request of several limits took (see BatchOp.STACKED). */
  stacked: Map<number, string>;
  /** What each request with its rate answered (see BatchOp.RATED; null: its key was not taken). */
  rated: Map<number, string | null>;
}

export function decodeBatch(rows: readonly BatchRow[]): BatchAnswer {
  const answer: BatchAnswer = {
    backendPid: undefined,
    marked: false,
    failedUnlocks: new Set(),
    singles: new Map(),
    slots: new Map(),
    prewoken: new Map(),
    stacked: new Map(),
    rated: new Map(),
  };
  for (const row of rows) {
    switch (row.op) {
      case BatchOp.BACKEND:
        answer.backendPid = row.i;
        answer.marked = row.key === null;
        break;
      case BatchOp.UNLOCK_FAILED:
        answer.failedUnlocks.add(row.i);
        break;
      case BatchOp.LOCK_FAILED:
      case BatchOp.WAIT_FOR_RELEASE:
      case BatchOp.LOCKED_WITH_LINE:
        answer.singles.set(row.i, row.op);
        break;
      case BatchOp.SLOT:
        answer.slots.set(row.i, row.key);
        break;
      case BatchOp.PREWOKEN:
        answer.prewoken.set(row.i, row.key!);
        break;
      case BatchOp.STACKED:
        answer.stacked.set(row.i, row.key!);
        break;
      case BatchOp.RATED:
        answer.rated.set(row.i, row.key);
        break;
    }
  }
  return answer;
}
