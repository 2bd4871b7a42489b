// Block residency chart: which blocks are on the device over time (stagehand/block records).

import { csvRow } from "./chartcontrols.js";
import { ChartPanel, FLUSH_MS, plotText } from "./charts.js";

/**
 * Block residency over time: a heatmap of blocks (rows) x time (columns), 0 = off the device,
 * 1 = resident, 2 = executing (between enter and exit), with scatter overlays for prefetch
 * loads, on-demand loads and stalls. Columns are merged pairwise (max) when they pass
 * `maxColumns`, so memory stays bounded and a block that was resident for one event in a
 * merged column still shows.
 */
export class ResidencyMap extends ChartPanel {
  /**
   * @param {HTMLElement} el
   * @param {object} opts as ChartPanel's (without `legendItems`), plus:
   * @param {number} [opts.maxColumns] time columns kept before merging pairs
   * @param {number} [opts.maxMarks] load/stall marks kept per kind before thinning the oldest
   */
  constructor(el, { maxColumns = 600, maxMarks = 3000, ...opts }) {
    const width = opts.width ?? el.clientWidth;
    super(el, {
      flushMs: FLUSH_MS * 2,
      ...opts,
      width,
      legendItems: 3,
      layout: {
        hovermode: "closest",
        // A fixed bottom margin: with automargin the heatmap is drawn twice (~130 ms, not ~65).
        // A phone needs it, or the axis title sits on the tick labels.
        xaxis: { title: { text: "time since start (s)" }, automargin: width < 500 },
        yaxis: { title: { text: "block" }, rangemode: "normal" },
      },
    });
    this.maxColumns = maxColumns;
    this.maxMarks = maxMarks;
    this.state = new Map(); // block -> 0/1/2 right now
    this.names = new Map(); // block -> block_name, as Plotly shows it literally
    this.rawNames = new Map(); // block -> block_name
    this.columns = []; // {t, z: Map(block -> value), ev: Map(block -> the events folded in)}
    this.perColumn = 1; // events folded into one column
    this.inColumn = 0;
    this.marks = { prefetch: { x: [], y: [] }, demand: { x: [], y: [] }, stall: { x: [], y: [] } };
  }

  /** One row per column and block: `time (s), block, block name, state, events`. */
  csv() {
    const blocks = [...this.state.keys()].sort((a, b) => a - b);
    const rows = [csvRow(["time (s)", "block", "block name", "state (0 off, 1 resident, 2 executing)", "events"])];
    for (const c of this.columns) {
      for (const b of blocks) rows.push(csvRow([c.t, b, this.rawNames.get(b) ?? "", c.z.get(b) ?? 0, [...(c.ev.get(b) || [])].join(" ")]));
    }
    return `${rows.join("\n")}\n`;
  }

  get empty() {
    return this.columns.length === 0;
  }

  _xRange() {
    const cols = this.columns;
    return cols.length ? [cols[0].t, cols[cols.length - 1].t] : null;
  }

  /** One stagehand/block record with its elapsed time `t` (s). */
  add(t, rec) {
    const block = rec.block;
    if (typeof block !== "number") return;
    if (rec.block_name && !this.rawNames.has(block)) {
      this.rawNames.set(block, rec.block_name);
      this.names.set(block, plotText(rec.block_name));
    }
    const current = this.state.get(block) ?? 0;
    switch (rec.event) {
      case "load":
      case "prefetch":
        this.state.set(block, Math.max(current, 1));
        this._mark(rec.event === "prefetch" || rec.prefetch ? "prefetch" : "demand", t, block);
        break;
      case "enter":
        this.state.set(block, 2);
        break;
      case "exit":
        this.state.set(block, 1);
        break;
      case "evict":
        this.state.set(block, 0);
        break;
      case "stall":
        this._mark("stall", t, block);
        break;
      default:
        if (!this.state.has(block)) this.state.set(block, 0);
    }
    this._snapshot(t, block, rec.event);
    this.invalidate(true);
  }

  _mark(kind, t, block) {
    const m = this.marks[kind];
    m.x.push(t);
    m.y.push(block);
    if (m.x.length > this.maxMarks) {
      // Thin the oldest half; recent marks keep full resolution.
      const half = Math.floor(m.x.length / 2);
      m.x = m.x.slice(0, half).filter((_, i) => i % 2 === 0).concat(m.x.slice(half));
      m.y = m.y.slice(0, half).filter((_, i) => i % 2 === 0).concat(m.y.slice(half));
    }
  }

  _snapshot(t, block, event) {
    const last = this.columns[this.columns.length - 1];
    if (last && this.inColumn < this.perColumn) {
      for (const [b, v] of this.state) last.z.set(b, Math.max(last.z.get(b) ?? 0, v));
      addEvent(last.ev, block, event);
      this.inColumn += 1;
      return;
    }
    this.columns.push({ t, z: new Map(this.state), ev: addEvent(new Map(), block, event) });
    this.inColumn = 1;
    if (this.columns.length > this.maxColumns) {
      const merged = [];
      for (let i = 0; i < this.columns.length; i += 2) {
        const a = this.columns[i];
        const b = this.columns[i + 1];
        if (b) for (const [k, v] of b.z) a.z.set(k, Math.max(a.z.get(k) ?? 0, v));
        if (b) for (const [k, evs] of b.ev) for (const e of evs) addEvent(a.ev, k, e);
        merged.push(a);
      }
      this.columns = merged;
      this.perColumn *= 2;
      this.inColumn = this.perColumn; // the merged last column is full
    }
  }

  _traces() {
    const blocks = [...this.state.keys()].sort((a, b) => a - b);
    const z = blocks.map((b) => this.columns.map((c) => c.z.get(b) ?? 0));
    const nameOf = (b) => this.names.get(b) ?? `block ${b}`;
    const text = blocks.map((b) => this.columns.map((c) => {
      const evs = c.ev.get(b);
      return `${nameOf(b)} (block ${b})${evs ? `<br>event: ${[...evs].join(", ")}` : ""}`;
    }));
    const scatter = (name, m, symbol, color, size) => ({
      type: "scatter", mode: "markers", name, x: m.x, y: m.y, text: m.y.map(nameOf),
      hovertemplate: `%{text} (block %{y})<br>t=%{x:.3f} s<br>event: ${name}<extra></extra>`,
      marker: { symbol, color, size, opacity: 0.85, line: { width: 0.5, color: "#ffffff" } },
    });
    return [
      {
        type: "heatmap", name: "on device", x: this.columns.map((c) => c.t), y: blocks, z, text,
        zmin: 0, zmax: 2, showscale: false, hoverongaps: false,
        colorscale: [[0, "#eef1f5"], [0.5, "#7fb3e6"], [1, "#1f5fa8"]],
        hovertemplate: "%{text}<br>t=%{x:.3f} s<br>state %{z} (0 off, 1 resident, 2 executing)<extra></extra>",
      },
      scatter("prefetch load", this.marks.prefetch, "triangle-up", "#2e9e5b", 5),
      scatter("on-demand load", this.marks.demand, "circle", "#e08a1e", 5),
      scatter("stall", this.marks.stall, "x", "#d3262f", 7),
    ];
  }
}

/** Adds `event` to the events of `block` in a column's `ev` map (a Set keeps each once). */
function addEvent(ev, block, event) {
  if (typeof block === "number" && event) {
    if (!ev.has(block)) ev.set(block, new Set());
    ev.get(block).add(plotText(event));
  }
  return ev;
}
