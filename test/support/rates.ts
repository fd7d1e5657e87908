/**
 * Checks of recorded starts against a rate: the most starts any window [s, s + period) holds, each start
 * taken as a window's left edge (the window that holds the most starts begins at one), and the fewest a
 * window of a backlog holds.
 */

/** The most starts (ms on the database's clock, any order) any half-open window of `periodMs` holds. */
export function maxStartsInWindow(starts: readonly number[], periodMs: number): number {
  const sorted = [...starts].sort((a, b) => a - b);
  let most = 0;
  let end = 0;
  for (let i = 0; i < sorted.length; i++) {
    while (end < sorted.length && sorted[end]! < sorted[i]! + periodMs) end++;
    most = Math.max(most, end - i);
  }
  return most;
}

/**
 * The fewest starts a window [s, s + period) holds, s a start, over the windows that end by the last start
 * (while a backlog exists, each of them should be nearly full), and start no sooner than `fromMs` after the
 * first start.
 */
export function minStartsInWindow(starts: readonly number[], periodMs: number, fromMs = 0): number {
  const sorted = [...starts].sort((a, b) => a - b);
  const last = sorted[sorted.length - 1]!;
  let fewest = Number.POSITIVE_INFINITY;
  let end = 0;
  for (let i = 0; i < sorted.length && sorted[i]! + periodMs <= last; i++) {
    if (sorted[i]! < sorted[0]! + fromMs) continue;
    while (end < sorted.length && sorted[end]! < sorted[i]! + periodMs) end++;
    fewest = Math.min(fewest, end - i);
  }
  return fewest;
}
