// Plotly charts that grow while records arrive, with a point cap that never hides a peak.
//
// Every change (points, title, markers, the empty note) marks a chart dirty and schedules one
// redraw per FLUSH_MS, however many records came in; nothing is drawn before the first flush,
// so a chart filled from history is drawn once, with its data, not empty and then again full.
// When a trace passes its cap it is compressed in place with min/max downsampling: each bucket
// keeps its lowest and its highest point, so a VRAM spike that lasted one block is still drawn
// after 100k blocks. Compressing already-compressed data keeps the same guarantee (the max of
// bucket maxima is the global max).

/* global Plotly */

/**
 * `text` as Plotly shows it literally. Plotly reads titles, legend names, hover text and
 * shape labels as pseudo-HTML (`<a href>` becomes a link, `<b>` bold) and decodes entities
 * after the tags: escaping &, < and > keeps run names, block names and record fields as text.
 * Every string given to Plotly goes through here (ChartPanel does it for titles, trace names
 * and marker labels).
 */
export function plotText(text) {
  return String(text ?? "").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

export const DEFAULT_CAP = 4000;
export const FLUSH_MS = 150;
// Past this many points per trace, SVG bars and markers cost more than they tell (hundreds of
// ms per redraw for 1000 steps): bars become stacked areas, markers are dropped.
const DENSE_POINTS = 300;

export const BASE_LAYOUT = {
  margin: { l: 58, r: 58, t: 36, b: 78 },
  height: 310,
  legend: { orientation: "h", x: 0, y: -0.3, yanchor: "top", traceorder: "normal", font: { size: 11 } },
  font: { family: "system-ui, -apple-system, Segoe UI, sans-serif", size: 12, color: "#1d2733" },
  paper_bgcolor: "#ffffff",
  plot_bgcolor: "#ffffff",
  xaxis: { gridcolor: "#e8ecf1", zeroline: false, automargin: true },
  yaxis: { gridcolor: "#e8ecf1", zeroline: false, automargin: true, rangemode: "tozero" },
  hovermode: "x unified",
  uirevision: "keep", // user zoom survives updates
};

/** Calls `fn` once the frame holding what was just drawn has been painted. */
export function afterPaint(fn) {
  requestAnimationFrame(() => setTimeout(fn, 0));
}

/** The note of an empty chart until something says why it is empty. */
export const WAITING = "waiting for records…";

export const PLOT_CONFIG = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] };

/** The cheap-to-draw form of a trace once it holds many points. */
function denseTrace(trace) {
  if (trace.type === "bar") {
    const { marker = {}, type, ...rest } = trace;
    return {
      ...rest, type: "scatter", mode: "lines", stackgroup: trace.yaxis === "y2" ? "y2" : "bars",
      line: { width: 0.5, color: marker.color }, fillcolor: marker.color,
    };
  }
  if (typeof trace.mode === "string" && trace.mode.includes("markers")) return { ...trace, mode: "lines" };
  return trace;
}

/**
 * Legend at the bottom of the figure, below the x-axis title, with room for as many rows as
 * a chart `width` px wide needs (a phone wraps 4 traces onto 2-4 rows).
 */
export function legendFit(width, count) {
  width = width || 600;
  const perRow = Math.max(1, Math.floor((width - 30) / 135));
  const rows = Math.ceil(count / perRow);
  return {
    legend: { ...BASE_LAYOUT.legend, yref: "container", y: 0, yanchor: "bottom" },
    margin: { ...BASE_LAYOUT.margin, b: 56 + rows * 20 },
    height: 250 + rows * 20,
  };
}

export function emptyNote(text) {
  return {
    text, xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
    font: { size: 13, color: "#8592a3" }, name: "empty-note",
  };
}

// Markers are shapes with their own label: an annotation in data coordinates would widen the
// autorange by the width of its text. A marker in the right third of `xRange` ([lo, hi], the
// data's x extent) puts its label on its left, where it is not cut by the plot's edge.
export function markerShapes(markers, xRange = null) {
  const [lo, hi] = xRange || [0, 0];
  return markers.map((m) => ({
    type: "line", xref: "x", yref: "paper", x0: m.x, x1: m.x, y0: 0, y1: 1,
    line: { color: m.color, width: 1.5, dash: m.dash || "dash" },
    label: {
      text: plotText(m.label), textangle: 0, textposition: "end",
      xanchor: hi > lo && m.x > lo + (2 / 3) * (hi - lo) ? "right" : "left",
      font: { size: 10, color: m.color },
    },
  }));
}

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
 * @returns {{x: Array<number>, y: Array<number>}}
 */
export function minMaxDownsample(x, y, buckets) {
  const n = y.length;
  if (n <= 2 * buckets) return { x: Array.from(x), y: Array.from(y) };
  const outX = [];
  const outY = [];
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
    outX.push(x[first]);
    outY.push(y[first]);
    if (second !== first) {
      outX.push(x[second]);
      outY.push(y[second]);
    }
  }
  return { x: outX, y: outY };
}

/**
 * What every chart panel shares: its layout (title, axes, legend, limit markers, the note of an
 * empty chart) and one draw path. Subclasses give `_traces()` (the data drawn), `empty`, and
 * may fold queued points into their model in `_fold()` before a draw.
 */
export class ChartPanel {
  /**
   * @param {HTMLElement} el container (its id is what tests read `.data` from)
   * @param {object} opts
   * @param {string} opts.title
   * @param {number} opts.legendItems entries in the legend (sizes the bottom margin)
   * @param {object} [opts.layout] merged over the base layout (axes titles with units)
   * @param {number} [opts.width] px; read from `el` when not given (a forced layout per chart)
   * @param {string} [opts.emptyText] note shown while the chart has no data
   * @param {number} [opts.flushMs] delay between a change and its redraw
   */
  constructor(el, { title, legendItems, layout = {}, width, emptyText = WAITING, flushMs = FLUSH_MS }) {
    this.el = el;
    this.title = title;
    this.emptyText = emptyText;
    this.flushMs = flushMs;
    this.markers = [];
    this.dirty = true;
    this.timer = null;
    this.revision = 0;
    this.layout = {
      ...BASE_LAYOUT,
      ...legendFit(width ?? el.clientWidth, legendItems),
      ...layout,
      title: { text: plotText(title), font: { size: 14 }, x: 0.01, xanchor: "left" },
      xaxis: { ...BASE_LAYOUT.xaxis, ...(layout.xaxis || {}) },
      yaxis: { ...BASE_LAYOUT.yaxis, ...(layout.yaxis || {}) },
    };
    if (layout.yaxis2) {
      this.layout.yaxis2 = {
        gridcolor: "#f3f5f8", zeroline: false, overlaying: "y", side: "right", automargin: true, rangemode: "tozero",
        ...layout.yaxis2,
      };
    }
  }

  /** True while there is nothing to draw but the empty note. */
  get empty() {
    return true;
  }

  _traces() {
    return [];
  }

  _fold() {}

  /** [lowest, highest] x of the data, or null (places marker labels). */
  _xRange() {
    return null;
  }

  /** Schedules a redraw (at most one per `flushMs`). */
  invalidate() {
    this.dirty = true;
    if (this.timer === null) this.timer = setTimeout(() => this.flush(), this.flushMs);
  }

  /** Drops the scheduled redraw: the owner calls flush() itself. */
  unschedule() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** Draws now whatever changed (tests and history loads call it to avoid waiting). */
  flush() {
    this.unschedule();
    this._fold();
    if (!this.dirty) return;
    this.dirty = false;
    this.revision += 1;
    const notes = this.empty && this.emptyText ? [emptyNote(this.emptyText)] : [];
    const data = this._traces();
    const shapes = markerShapes(this.markers, this.markers.length ? this._xRange() : null);
    this.layout = { ...this.layout, shapes, annotations: notes, datarevision: this.revision };
    Plotly.react(this.el, data, this.layout, PLOT_CONFIG);
  }

  setTitle(title) {
    if (title === this.title) return;
    this.title = title;
    this.layout = { ...this.layout, title: { ...this.layout.title, text: plotText(title) } };
    this.invalidate();
  }

  /** Changes the note shown while the chart has no points (e.g. why a source is silent). */
  setEmptyText(text) {
    this.emptyText = text;
    if (this.empty) this.invalidate();
  }

  /** Vertical dashed line at `x` with a short label (e.g. "limits applied"). */
  addMarker(x, label, color = "#b4235a", dash = "dash") {
    this.markers.push({ x, label, color, dash });
    this.invalidate();
  }

  purge() {
    this.unschedule();
    Plotly.purge(this.el);
  }
}

/** A line/bar chart fed point by point (`push`) or whole series at a time (`setSeries`). */
export class LiveChart extends ChartPanel {
  /**
   * @param {HTMLElement} el
   * @param {object} opts as ChartPanel's, plus:
   * @param {Array<object>} opts.traces Plotly trace specs without x/y
   * @param {number} [opts.cap] most points per trace before compression
   */
  constructor(el, { traces, cap = DEFAULT_CAP, ...opts }) {
    super(el, { ...opts, legendItems: traces.length });
    this.cap = cap;
    this.pending = new Map();
    this.hasPoints = false;
    this.data = traces.map((t) => ({ type: "scatter", mode: "lines", ...t, name: plotText(t.name), x: [], y: [] }));
  }

  get empty() {
    return !this.hasPoints;
  }

  _traces() {
    if (this.data.some((t) => t.x.length > DENSE_POINTS)) this.data = this.data.map(denseTrace);
    return this.data;
  }

  _xRange() {
    const xs = this.data.filter((t) => t.x.length).flatMap((t) => [t.x[0], t.x[t.x.length - 1]]);
    return xs.length ? [Math.min(...xs), Math.max(...xs)] : null;
  }

  /** Queues points for trace `index`; drawn at the next flush. */
  push(index, x, y) {
    let entry = this.pending.get(index);
    if (!entry) {
      entry = { x: [], y: [] };
      this.pending.set(index, entry);
    }
    entry.x.push(x);
    entry.y.push(y);
    this.invalidate();
  }

  /** Replaces all points of trace `index` (history load); compressed when over the cap. */
  setSeries(index, x, y) {
    this.pending.delete(index);
    const ds = minMaxDownsample(x, y, Math.floor(this.cap / 2));
    this._set(index, ds.x, ds.y);
    this.invalidate();
  }

  /** Puts `x`/`y` before the points trace `index` already has (history arriving late). */
  prependSeries(index, x, y) {
    this._fold();
    const trace = this.data[index];
    this.setSeries(index, x.concat(trace.x), y.concat(trace.y));
  }

  _set(index, x, y) {
    this.data[index] = { ...this.data[index], x, y };
    if (!this.hasPoints && y.some((v) => v !== undefined && v !== null)) this.hasPoints = true;
  }

  /** Appends the queued points; a trace over its cap keeps half of it (min/max per bucket). */
  _fold() {
    if (!this.pending.size) return;
    for (const [i, p] of this.pending) {
      let x = this.data[i].x.concat(p.x);
      let y = this.data[i].y.concat(p.y);
      if (x.length > this.cap) ({ x, y } = minMaxDownsample(x, y, Math.floor(this.cap / 4)));
      this._set(i, x, y);
    }
    this.pending = new Map();
  }
}
