// Plotly charts that grow while records arrive, with a point cap that never hides a peak.
//
// Every change (points, title, markers, the empty note) marks a chart dirty and schedules one
// redraw per FLUSH_MS, however many records came in; nothing is drawn before the first flush,
// so a chart filled from history is drawn once, with its data, not empty and then again full.
// Live points are paced besides: a chart redraws for them no sooner than PACE times its last
// draw's cost after that draw began (at most MAX_PACE_MS), so a live run's page stays light;
// out of view (inview.js), every OUT_OF_VIEW_MS, and in FLUSH_MS once it comes into view.
// When a trace passes its cap it is compressed in place (downsample.js): the newest points as
// they are, the older ones min/max downsampled, so a VRAM spike that lasted one block is still
// drawn after 100k blocks.
// What a user sets on a chart lives here too: the x range shown (a user's zoom, else a "last N
// steps" window, else everything), two charts whose x axes move together, a log y axis, and
// the chart's data as a CSV download (the controls and the file: chartcontrols.js). The layout and
// config every figure shares (title band, legend, toolbar) are chartlayout.js's.

/* global Plotly */

import { csvRow } from "./chartcontrols.js";
import {
  BASE_LAYOUT, MARGIN_TOP, PLOT_CONFIG, emptyNote, legendFit, markerShapes, plotText, titleFit, wholeTicks,
} from "./chartlayout.js";
import { capSeries, minMaxDownsample } from "./downsample.js";
import { IN_VIEW_MARGIN_PX, OUT_OF_VIEW_MS, watchInView } from "./inview.js";

// Figures elsewhere (plan, tune, calibration) take their layout from here too.
export { BASE_LAYOUT, IN_VIEW_MARGIN_PX, OUT_OF_VIEW_MS, PLOT_CONFIG, legendFit, minMaxDownsample, plotText };

export const DEFAULT_CAP = 4000;
export const FLUSH_MS = 150;
// Unpaced, a live run's nine charts took 10.4 chromium CPU-s per 10 s here (50-140 ms a redraw,
// each ~10 times in 10 s). Paced, each draws live points at most 1/PACE of the time (a 25 ms
// redraw every 1.5 s); a run's end draws what is left at once (`unpace`). A live page with five
// charts in view: 7.5-8.1 chromium CPU-s per 20 s at PACE 30, 5.1-5.3 at 60.
export const PACE = 60;
export const MAX_PACE_MS = 2500;
// Past this many points per trace, SVG bars and markers cost more than they tell (hundreds of
// ms per redraw for 1000 steps): bars become stacked areas, markers are dropped.
const DENSE_POINTS = 300;

/** Calls `fn` once the frame holding what was just drawn has been painted. */
export function afterPaint(fn) {
  requestAnimationFrame(() => setTimeout(fn, 0));
}

/** The note of an empty chart until something says why it is empty. */
export const WAITING = "waiting for records…";

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
 * `trace` carried on at its last value to `x`, when that is further right: a limit (a step line)
 * stays in force after its last record, up to the chart's newest point.
 */
function holdTo(trace, x) {
  const n = trace.x.length;
  const y = n ? trace.y[n - 1] : null;
  if (y === null || y === undefined || !(x > trace.x[n - 1])) return trace;
  const text = Array.isArray(trace.text) ? { text: [...trace.text, ""] } : {};
  return { ...trace, x: [...trace.x, x], y: [...trace.y, y], ...text };
}

/**
 * What every chart panel shares: its layout (title, axes, legend, limit markers, the note of an
 * empty chart), one draw path, and what a user sets on it (x range, log y, CSV). Subclasses give
 * `_traces()` (the data drawn), `empty`, `csv()`, and may fold queued points into their model in
 * `_fold()` before a draw.
 *
 * The x range drawn is, first to last that applies: the range a user zoomed to (`view`; a
 * double-click drops it), the `xWindow()` of a "last N steps" window (it follows the newest
 * records), everything (Plotly's autorange).
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
   * @param {boolean} [opts.wholeX] x values are whole numbers (steps): ticks on them only
   */
  constructor(el, { title, legendItems, layout = {}, width, emptyText = WAITING, flushMs = FLUSH_MS, wholeX = false }) {
    this.el = el;
    this.wholeX = wholeX;
    this.title = title;
    this.emptyText = emptyText;
    this.flushMs = flushMs;
    this.markers = [];
    this.dirty = true;
    this.timer = null;
    this.due = 0; // performance.now() ms the scheduled redraw is due at
    this.paced = true; // live points wait on the last draw's cost (PACE); unpace() ends it
    this.inView = true; // near the window (inview.js), as last observed
    this.viewObserver = watchInView(el, (inView) => {
      this.inView = inView;
      if (inView && this.timer !== null) this.invalidate(); // a held redraw: in FLUSH_MS
    });
    this.cost = 0; // ms of script the last draw took
    this.drawnAt = -Infinity; // performance.now() ms the last draw began
    this.revision = 0;
    this.view = null; // [lo, hi] a user zoomed to
    this.xWindow = null; // () => [lo, hi] | null: the "last N steps" window
    this.linked = []; // charts whose x axis follows this one's
    this.listening = false;
    this.width = width ?? el.clientWidth;
    const fit = legendFit(this.width, legendItems);
    // As tall a plot as with the base margin: the title's band is added above it.
    this.titledHeight = fit.height + MARGIN_TOP - BASE_LAYOUT.margin.t;
    this.layout = {
      ...BASE_LAYOUT,
      ...fit,
      ...layout,
      xaxis: { ...BASE_LAYOUT.xaxis, ...(layout.xaxis || {}) },
      yaxis: { ...BASE_LAYOUT.yaxis, ...(layout.yaxis || {}) },
    };
    this._titled(title);
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

  /** The chart's data as CSV text (header line first). */
  csv() {
    return "";
  }

  /**
   * Schedules a redraw: in `flushMs`, or for live points (`live`) on a paced chart no sooner
   * than min(PACE x the last draw's cost, MAX_PACE_MS) after that draw began. A redraw already
   * due sooner is kept; a later one is brought forward (a zoom is not held by the pacing).
   */
  invalidate(live = false) {
    this.dirty = true;
    const now = performance.now();
    const wait = this.inView ? Math.min(this.cost * PACE, MAX_PACE_MS) : OUT_OF_VIEW_MS;
    const paced = live && this.paced ? this.drawnAt + wait : 0;
    const due = Math.max(now + this.flushMs, paced);
    if (this.timer !== null && this.due <= due) return;
    this.unschedule();
    this.due = due;
    this.timer = setTimeout(() => this.flush(), due - now);
  }

  /** Ends the pacing (the run is over): a redraw waiting on it is drawn now. */
  unpace() {
    this.paced = false;
    if (this.timer !== null) this.flush();
  }

  /** Drops the scheduled redraw: the owner calls flush() itself. */
  unschedule() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** The x range to draw: a user's zoom, else the window's, else null (everything). */
  shownRange() {
    return this.view || (this.xWindow && this.xWindow()) || null;
  }

  /** Draws now whatever changed (tests and history loads call it to avoid waiting). */
  flush() {
    this.unschedule();
    this._fold();
    if (!this.dirty) return;
    const began = performance.now();
    this.dirty = false;
    this.revision += 1;
    const notes = this.empty && this.emptyText ? [emptyNote(this.emptyText)] : [];
    const data = this._traces();
    const { range, autorange, ...xaxis } = this.layout.xaxis;
    const shown = this.shownRange();
    xaxis.autorange = !shown;
    if (shown) xaxis.range = [...shown];
    const [lo, hi] = shown || this._xRange() || [0, 0];
    const area = this._plotArea(lo, hi);
    const { shapes, top } = markerShapes(this.markers, this.markers.length ? this._xRange() : null, area);
    this._markerRoom(top);
    if (this.wholeX) Object.assign(xaxis, { tick0: 0, dtick: wholeTicks(hi - lo, this.el.clientWidth || 600) });
    this.layout = { ...this.layout, xaxis, shapes, annotations: notes, datarevision: this.revision };
    Plotly.react(this.el, data, this.layout, PLOT_CONFIG);
    // The plot's size is known once drawn (automargin makes room for the legend and ticks):
    // marker labels laid out on a guess of it are laid out again on the size drawn.
    const drawn = this._plotArea(lo, hi);
    if (this.markers.length && (drawn.width !== area.width || drawn.height !== area.height)) {
      const again = markerShapes(this.markers, this._xRange(), drawn);
      this._markerRoom(again.top);
      this.layout = { ...this.layout, shapes: again.shapes };
      Plotly.react(this.el, data, this.layout, PLOT_CONFIG);
    }
    if (!this.listening && this.el.on) {
      this.listening = true;
      this.el.on("plotly_relayout", (ev) => this._userRange(ev));
    }
    this.drawnAt = began;
    this.cost = performance.now() - began;
  }

  /** The x range `lo`..`hi` shown on the plot's area, {lo, hi, width, height} (px, from the
   * figure's size less its margins): where marker labels are laid out. */
  _plotArea(lo, hi) {
    const size = this.el._fullLayout?._size; // Plotly's own, once it has drawn
    if (size) return { lo, hi, width: size.w, height: size.h };
    const { margin, height } = this.layout;
    const width = (this.el.clientWidth || this.width || 600) - margin.l - margin.r;
    return { lo, hi, width, height: height - margin.t - margin.b };
  }

  /** A zoom, pan or double-click on the chart: kept as `view`, and given to linked charts. */
  _userRange(ev) {
    let view;
    if (ev["xaxis.autorange"]) view = null;
    else if (ev["xaxis.range[0]"] !== undefined) view = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
    else if (Array.isArray(ev["xaxis.range"])) view = [...ev["xaxis.range"]];
    else return;
    // Drawn once Plotly has finished its own relayout (it writes into the layout it was given).
    for (const chart of [this, ...this.linked]) chart._setView(view);
  }

  /** Draws x range `view` (null: the window or everything), over whatever the user did. */
  _setView(view) {
    this.view = view;
    // A new uirevision: Plotly would otherwise keep the user's last zoom over the range given.
    this.uirev = (this.uirev || 0) + 1;
    this.layout = { ...this.layout, uirevision: `keep-${this.uirev}` };
    this.invalidate();
  }

  /** `other`'s x axis follows this one's and the other way round (same x unit, e.g. seconds). */
  link(other) {
    this.linked.push(other);
    other.linked.push(this);
  }

  /** A "last N steps" window: `fn()` gives the [lo, hi] x range of it now (null: everything). */
  setWindow(fn) {
    this.xWindow = fn;
    this._setView(null);
  }

  /** A log (true) or linear y axis. */
  setLogY(on) {
    this.layout = { ...this.layout, yaxis: { ...this.layout.yaxis, type: on ? "log" : "linear" } };
    this.invalidate();
  }

  setTitle(title) {
    if (title === this.title) return;
    this.title = title;
    this._titled(title);
    this.invalidate();
  }

  /** The layout's title, top margin and height for `title` (chartlayout.js titleFit). */
  _titled(title) {
    const { title: text, extra } = titleFit(title, this.width);
    this.titleExtra = extra;
    const top = this.markerTop || 0;
    const margin = { ...this.layout.margin, t: MARGIN_TOP + extra + top };
    this.layout = { ...this.layout, title: text, margin, height: this.titledHeight + extra + top };
  }

  /** `top` px more above the plot, for marker labels in lanes (chartlayout.js markerShapes):
   * the figure grows by it, the plot keeps its height. */
  _markerRoom(top) {
    if (top === (this.markerTop || 0)) return;
    this.markerTop = top;
    const margin = { ...this.layout.margin, t: MARGIN_TOP + this.titleExtra + top };
    this.layout = { ...this.layout, margin, height: this.titledHeight + this.titleExtra + top };
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
    if (this.viewObserver) this.viewObserver.disconnect();
    Plotly.purge(this.el);
  }
}

/** A line/bar chart fed point by point (`push`) or whole series at a time (`setSeries`). */
export class LiveChart extends ChartPanel {
  /**
   * @param {HTMLElement} el
   * @param {object} opts as ChartPanel's, plus:
   * @param {Array<object>} opts.traces Plotly trace specs without x/y; `text: []` keeps a hover
   *   text per point (`push`'s `text`); `holdToEnd: true` draws the trace's last value on to the
   *   newest x of the chart (a limit in force), a point that is drawn only, not kept
   * @param {number} [opts.cap] most points per trace before compression
   * @param {string} [opts.xName] the x column's name in the CSV (the x axis title otherwise)
   */
  constructor(el, { traces, cap = DEFAULT_CAP, xName, ...opts }) {
    super(el, { ...opts, legendItems: traces.length });
    this.cap = cap;
    this.pending = new Map();
    this.hasPoints = false;
    this.xName = xName || opts.layout?.xaxis?.title?.text || "x";
    this.names = traces.map((t) => t.name);
    this.held = new Set(traces.flatMap((t, i) => (t.holdToEnd ? [i] : [])));
    this.data = traces.map(({ holdToEnd, ...t }) => ({ type: "scatter", mode: "lines", ...t, name: plotText(t.name), x: [], y: [] }));
  }

  get empty() {
    return !this.hasPoints;
  }

  _traces() {
    if (this.data.some((t) => t.x.length > DENSE_POINTS)) this.data = this.data.map(denseTrace);
    if (!this.held.size) return this.data;
    const end = this._xRange()?.[1];
    return this.data.map((t, i) => (this.held.has(i) && end !== undefined ? holdTo(t, end) : t));
  }

  _xRange() {
    const xs = this.data.filter((t) => t.x.length).flatMap((t) => [t.x[0], t.x[t.x.length - 1]]);
    return xs.length ? [Math.min(...xs), Math.max(...xs)] : null;
  }

  /** Every x of any trace, one row each in x order: `x, trace 1, trace 2…` (empty where a
   * trace has no point at that x). */
  csv() {
    this._fold();
    const rows = new Map();
    this.data.forEach((t, i) => t.x.forEach((x, j) => {
      if (!rows.has(x)) rows.set(x, new Array(this.data.length).fill(null));
      rows.get(x)[i] = t.y[j];
    }));
    const xs = [...rows.keys()].sort((a, b) => a - b);
    return [csvRow([this.xName, ...this.names]), ...xs.map((x) => csvRow([x, ...rows.get(x)]))].join("\n") + "\n";
  }

  /** Renames trace `index` (legend and CSV). */
  setName(index, name) {
    this.names[index] = name;
    this.data[index] = { ...this.data[index], name: plotText(name) };
    this.invalidate();
  }

  /** Merges `props` (Plotly trace attributes: line, marker...) into trace `index`. */
  restyle(index, props) {
    this.data[index] = { ...this.data[index], ...props };
    this.invalidate();
  }

  /** Queues points for trace `index`; drawn at the next flush. */
  push(index, x, y, text) {
    let entry = this.pending.get(index);
    if (!entry) {
      entry = { x: [], y: [], text: [] };
      this.pending.set(index, entry);
    }
    entry.x.push(x);
    entry.y.push(y);
    entry.text.push(text ?? "");
    this.invalidate(true);
  }

  /** Replaces all points of trace `index` (history load); compressed when over the cap. */
  setSeries(index, x, y, text) {
    this.pending.delete(index);
    const withText = Array.isArray(this.data[index].text);
    this._set(index, capSeries({ x, y, text: withText ? text || x.map(() => "") : undefined }, this.cap));
    this.invalidate();
  }

  /** Puts `x`/`y` (and hover `text`) before the points trace `index` already has (history
   * arriving late). */
  prependSeries(index, x, y, text0) {
    this._fold();
    const trace = this.data[index];
    const text = Array.isArray(trace.text) ? (text0 || x.map(() => "")).concat(trace.text) : undefined;
    this.setSeries(index, x.concat(trace.x), y.concat(trace.y), text);
  }

  /**
   * Keeps the points of every trace at x <= `x`, in x order (a stable sort: points of one x keep
   * their order), and drops the others, queued ones included. A step chart of a resumed run
   * calls it with the checkpoint's step: the discarded run's later steps are trained again.
   */
  dropAfter(x) {
    this._fold();
    this.data.forEach((t, i) => {
      const keep = t.x.map((_, j) => j).filter((j) => t.x[j] <= x).sort((a, b) => t.x[a] - t.x[b] || a - b);
      if (keep.length === t.x.length && keep.every((j, k) => j === k)) return;
      const text = Array.isArray(t.text) ? keep.map((j) => t.text[j]) : undefined;
      this._set(i, { x: keep.map((j) => t.x[j]), y: keep.map((j) => t.y[j]), text });
      this.invalidate();
    });
  }

  _set(index, { x, y, text }) {
    this.data[index] = { ...this.data[index], x, y, ...(text ? { text } : {}) };
    if (!this.hasPoints && y.some((v) => v !== undefined && v !== null)) this.hasPoints = true;
  }

  /** Appends the queued points; a trace over its cap is compressed (`capSeries`). */
  _fold() {
    if (!this.pending.size) return;
    for (const [i, p] of this.pending) {
      const t = this.data[i];
      const text = Array.isArray(t.text) ? t.text.concat(p.text) : undefined;
      this._set(i, capSeries({ x: t.x.concat(p.x), y: t.y.concat(p.y), text }, this.cap));
    }
    this.pending = new Map();
  }
}
