// Min/max downsampling: the point cap of the charts (charts.js) without losing a peak.

/**
 * Min/max downsampling of one series.
 *
 * Splits the points into `buckets` runs of consecutive indices and keeps, per run, the point
 * with the lowest y and the point with the highest y, in x order. The result has at most
 * 2 * buckets points; the global minimum and maximum are always kept. Null/NaN y values are
 * skipped (they are gaps, not extremes).
 *
 * @param {Array<number>} x
 * @param {Array<number>} y same length as x
 * @param {number} buckets > 0
 * @returns {{x: Array<number>, y: Array<number>, idx: Array<number>}} `idx`: the indices kept
 */
export function minMaxDownsample(x, y, buckets) {
  const n = y.length;
  if (n <= 2 * buckets) return { x: Array.from(x), y: Array.from(y), idx: Array.from(y, (_, i) => i) };
  const outX = [];
  const outY = [];
  const idx = [];
  const size = n / buckets;
  for (let b = 0; b < buckets; b++) {
    const start = Math.floor(b * size);
    const end = Math.min(n, Math.floor((b + 1) * size));
    let lo = -1;
    let hi = -1;
    for (let i = start; i < end; i++) {
      const v = y[i];
      if (v === null || v === undefined || Number.isNaN(v)) continue;
      if (lo < 0 || v < y[lo]) lo = i;
      if (hi < 0 || v > y[hi]) hi = i;
    }
    if (lo < 0) continue;
    const first = Math.min(lo, hi);
    const second = Math.max(lo, hi);
    for (const i of second !== first ? [first, second] : [first]) {
      outX.push(x[i]);
      outY.push(y[i]);
      idx.push(i);
    }
  }
  return { x: outX, y: outY, idx };
}

/**
 * A series of more than `cap` points brought to at most cap/2 (so that a live chart compresses
 * once per cap/2 new points, not at every draw): the newest cap/4 points as they are (a "last N
 * steps" window over a long run keeps block resolution), the older ones min/max downsampled
 * into cap/8 buckets. Compressing again keeps the guarantee (the max of bucket maxima is the
 * global max). `text`, when given, follows the points kept.
 *
 * @param {{x: Array<number>, y: Array<number>, text?: Array<string>}} series
 * @param {number} cap
 * @returns {{x: Array<number>, y: Array<number>, text?: Array<string>}}
 */
export function capSeries({ x, y, text }, cap) {
  if (x.length <= cap) return { x, y, text };
  const split = x.length - Math.floor(cap / 4);
  const old = minMaxDownsample(x.slice(0, split), y.slice(0, split), Math.floor(cap / 8));
  const out = { x: old.x.concat(x.slice(split)), y: old.y.concat(y.slice(split)) };
  if (text) out.text = old.idx.map((i) => text[i]).concat(text.slice(split));
  return out;
}
