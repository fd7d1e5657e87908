/**
 * The overlap check shared by the tests, the demo and the benchmark: the highest number of intervals open
 * at the same instant, by a sweep over start (+1) and end (-1) instants. An end at the same instant as a
 * start counts first, so back-to-back executions do not overlap.
 */
export function highestConcurrency<T extends number | bigint>(
  intervals: Iterable<{ readonly start: T; readonly end: T }>,
): number {
  const points: Array<[T, number]> = [];
  for (const { start, end } of intervals) points.push([start, 1], [end, -1]);
  points.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] - b[1]));
  let open = 0;
  let highest = 0;
  for (const [, delta] of points) {
    open += delta;
    highest = Math.max(highest, open);
  }
  return highest;
}
