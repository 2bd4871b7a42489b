// The live view's charts and how each telemetry record (docs/contracts.md) feeds them.
//
// Time-based charts (VRAM at block resolution, block residency) use seconds since the run's
// first record on x; per-step charts use the step number. A `strategy/limits_applied` record
// becomes a marker on every chart, at its time or its step (the resolution of "auto" limits at
// build is none: runwatermarks.js names their figures); a limits request the worker refused
// (`trainer/event` `control_rejected`) one of another colour; an out-of-memory recovery
// (`trainer/oom_recovery`) a third, at the step that failed, saying the run lowered its limits
// (its rerun's `limits_applied`, request "oom", moves the watermark lines only). A resumed run's
// `trainer/resumed` record drops from the step charts what the discarded run drew past the
// checkpoint's step: the resumed worker trains those steps again, and each is drawn once.
// A "last N steps" window shows the same steps on every chart: the step charts from step
// last-N+1, the time charts from the time step last-N ended (its `trainer/step` record); the
// two time charts (VRAM, residency) zoom and pan together. What each chart draws (traces,
// colours, axes) is runchartspecs.js's; the watermark lines runwatermarks.js's.

import { chartTools } from "./chartcontrols.js";
import { WAITING, afterPaint, plotText } from "./charts.js";
import { CHART_IDS, EMA, buildRunCharts } from "./runchartspecs.js";
import { SHORT, WatermarkLines, drawnWatermark } from "./runwatermarks.js";
import { h } from "./ui.js";

export { CHART_IDS, drawnWatermark };

const APPLIED = { color: "#b4235a", dash: "dash" };
const REFUSED = { color: "#d9480f", dash: "dot" };
const RESUMED = { color: "#2e9e5b", dash: "dashdot" };
const OOM = { color: "#c92a2a", dash: "longdash" };
const REFUSED_LABEL_CHARS = 70;

/** Exponential moving average of `ys` with weight `w` on the past (the first value as is). */
export function ema(ys, w) {
  let s = null;
  return ys.map((y) => (s = s === null ? y : w * s + (1 - w) * y));
}

export class RunCharts {
  /**
   * @param {HTMLElement} container grid the chart panels are appended to
   * @param {object} [config] the run's config: says which sources will stay silent, and why
   * @param {string} [filePrefix] start of the CSV files' names ("run-3" -> "run-3-loss.csv")
   */
  constructor(container, config = {}, filePrefix = "run") {
    const divs = Object.fromEntries(CHART_IDS.map((id) => [id, h("div", { id, class: "chart" })]));
    const panels = Object.fromEntries(CHART_IDS.map((id) => [id, h("div", { class: "chart-panel" }, divs[id])]));
    container.append(...Object.values(panels));
    const width = divs.vram.clientWidth; // the grid's panels are all as wide: one layout read
    this.t0 = null;
    this.tLast = null; // s, the newest record drawn on the time charts
    this.vramSource = null;
    this.blockRecords = 0;
    this.stagehandSteps = 0;
    this.emaWeight = EMA;
    this.smoothed = null;
    this.losses = { x: [], y: [] }; // every loss, unsmoothed: the EMA is redrawn from them
    this.stepEnds = new Map(); // step -> s its trainer/step record was written at
    this.firstStep = null;
    this.lastStep = null;
    this.windowSteps = null;
    this.charts = buildRunCharts(divs, width);
    this.watermarks = new WatermarkLines(this.charts, config || {});
    this.charts.vram.link(this.charts.residency);
    this._explainSilence(config || {});
    this._tools(panels, filePrefix);
  }

  /** The controls: the "last N steps" window (`controls`, placed by the page above the grid);
   * log y and CSV on every chart; the loss chart's smoothing. */
  _tools(panels, filePrefix) {
    const win = h("input", {
      type: "number", id: "chart-window", min: "1", step: "1", placeholder: "all", class: "window-input",
      onchange: () => this.setWindow(win.value ? Number(win.value) : null),
    });
    this.controls = h("div", { class: "toolbar chart-controls", id: "chart-controls" },
      h("label", { class: "inline", for: "chart-window" }, "show the last", win, "steps"),
      h("span", { class: "muted" }, "(empty: the whole run; drag on a chart to zoom, double-click to return)"));
    const emaLabel = h("span", { id: "loss-ema-value", class: "muted" }, EMA.toFixed(2));
    const emaInput = h("input", {
      type: "range", id: "loss-ema", min: "0", max: "0.99", step: "0.01", value: String(EMA),
      oninput: () => {
        emaLabel.textContent = Number(emaInput.value).toFixed(2);
        this.setEma(Number(emaInput.value));
      },
    });
    for (const [id, panel] of Object.entries(panels)) {
      const extra = id === "loss" ? [h("label", { class: "inline", for: "loss-ema" }, "smoothing", emaInput, emaLabel)] : [];
      panel.prepend(chartTools(this.charts[id], `${filePrefix}-${id}.csv`, ...extra));
    }
  }

  /** Every chart shows the last `n` steps (null: the whole run), following new records. */
  setWindow(n) {
    this.windowSteps = n && n > 0 ? Math.floor(n) : null;
    for (const [id, chart] of Object.entries(this.charts)) {
      const timeBased = id === "vram" || id === "residency";
      chart.setWindow(this.windowSteps ? () => (timeBased ? this._timeWindow() : this._stepWindow()) : null);
    }
  }

  _stepWindow() {
    if (this.lastStep === null) return null;
    return [Math.max(this.lastStep - this.windowSteps, this.firstStep - 1) + 0.5, this.lastStep + 0.5];
  }

  /** From the end of step last-N (the run's start when it has fewer steps) to the newest record. */
  _timeWindow() {
    if (this.lastStep === null) return null;
    return [this.stepEnds.get(this.lastStep - this.windowSteps) ?? 0, this.tLast];
  }

  /** Loss smoothing: the EMA line redrawn with weight `w` (0: none, 0.99: heavy). */
  setEma(w) {
    this.emaWeight = w;
    const smooth = ema(this.losses.y, w);
    this.smoothed = smooth.length ? smooth[smooth.length - 1] : null;
    this.charts.loss.setName(1, `loss (EMA ${w})`);
    this.charts.loss.setSeries(1, [...this.losses.x], smooth);
  }

  /** Empty-chart notes that say why a source will not report in this run. */
  _explainSilence(config) {
    const memory = config.memory || {};
    const sh = memory.stagehand || null;
    const streaming = memory.strategy === "stagehand";
    if (memory.strategy && !streaming) {
      this.charts.residency.setEmptyText(`no block records: memory.strategy is "${memory.strategy}" (no weight streaming)`);
    } else if (sh && sh.block_events === false) {
      this.charts.residency.setEmptyText("no block records: memory.stagehand.block_events is off");
    }
    const act = sh && sh.activation_stagehand;
    if (!streaming || !act || act.enabled === false) {
      const why = "no activation_stagehand records: activation spill is off in this run";
      this.charts.spill.setEmptyText(why);
      this.charts["spill-pool"].setEmptyText(why);
    }
    const cond = sh && sh.conductor_config;
    if (!streaming || !cond || !cond.enabled) {
      this.charts.conductor.setEmptyText("no conductor records: the Conductor is off in this run");
    }
  }

  _t(rec) {
    if (this.t0 === null) this.t0 = rec.time;
    return Math.round((rec.time - this.t0) * 1000) / 1000;
  }

  /**
   * A run without CUDA: nothing is page-locked and the weight pool fills only as blocks use it,
   * so the worker's "pinned" figure (the pools' and host cache's sizes) and the pool's total are
   * budgets, drawn dotted as limits are, beside the measured RSS and pool use.
   */
  _hostBudgets() {
    const host = this.charts.host;
    host.setName(1, "pools (budget)");
    host.restyle(1, { line: { ...host.data[1].line, dash: "dot", width: 1.5 } });
    host.setName(3, "pool size (budget)");
    host.setTitle("Host memory (MB; on CPU the pools are budgets, not pinned)");
  }

  _setSource(source) {
    if (!source || source === this.vramSource) return;
    this.vramSource = source;
    this._vramTitle();
  }

  _vramTitle() {
    const what = this.blockRecords ? "VRAM at block resolution (MB)" : "VRAM (MB)";
    this.charts.vram.setTitle(`${what} — source: ${this.vramSource || "?"}`);
  }

  /** Feeds one record to the charts it belongs to. */
  ingest(rec) {
    // A sampling step's records carry a training step's number: they would draw a second point
    // at that step (the trainer tags them sampling: true).
    if (rec.sampling && rec.kind === "step") return;
    // An attempt that ran out of memory (`aborted: true`) is run again: its rerun draws the step.
    if (rec.aborted && rec.kind === "step") return;
    const t = this._t(rec);
    const step = rec.step ?? rec.step_id;
    const c = this.charts;
    const key = `${rec.source}/${rec.kind}`;
    if (key === "stagehand/block" || key === "stagehand/step" || key === "trainer/step") {
      if (this.tLast === null || t > this.tLast) this.tLast = t;
    }
    switch (key) {
      case "trainer/run_started":
        this._setSource(rec.vram_source);
        if (rec.device === "cpu" || rec.vram_source === "tracked") this._hostBudgets();
        break;
      case "stagehand/block":
        if (rec.residencyOnly) {
          c.residency.setTitle("Block residency (the newest records)");
          c.residency.add(t, rec);
          break;
        }
        this.blockRecords += 1;
        if (this.blockRecords === 1) this._vramTitle();
        this._setSource(rec.vram_source);
        // Hover text is read as Plotly's pseudo-HTML: the record's strings as text.
        this._vramPoint(t, rec, `<br>${plotText(rec.block_name ?? "block")} (block ${plotText(rec.block)})<br>event: ${plotText(rec.event ?? "?")}`);
        c.residency.add(t, rec);
        break;
      case "stagehand/step":
        this.stagehandSteps += 1;
        this._setSource(rec.vram_source);
        this.watermarks.step(t, rec);
        if (this.blockRecords === 0) this._vramPoint(t, rec, `<br>step ${step}`);
        if (rec.h2d_bytes !== undefined) c.transfers.push(0, step, rec.h2d_bytes / 1e9);
        c.transfers.push(1, step, rec.blocks_loaded);
        c.transfers.push(2, step, rec.resident_blocks);
        c.transfers.push(3, step, rec.prefetch_misses);
        c.transfers.push(4, step, rec.host_waits);
        c.transfers.push(5, step, rec.copy_waits);
        c.host.push(2, step, rec.pool_used_mb);
        c.host.push(3, step, rec.pool_total_mb);
        c["spill-pool"].push(2, step, rec.stall_time_ms);
        break;
      case "trainer/step": {
        this._setSource(rec.vram_source);
        // Without block records (block_events off, or no weight streaming) the step figures
        // are the best VRAM timeline there is.
        if (this.blockRecords === 0 && this.stagehandSteps === 0) this._vramPoint(t, rec, `<br>step ${step}`);
        if (typeof step === "number") {
          this.stepEnds.set(step, t);
          if (this.firstStep === null) this.firstStep = step;
          if (this.lastStep === null || step > this.lastStep) this.lastStep = step;
        }
        const ph = rec.phase_ms || {};
        c.phases.push(0, step, ph.forward);
        c.phases.push(1, step, ph.backward);
        c.phases.push(2, step, ph.optimizer);
        c.phases.push(3, step, rec.step_time_ms);
        if (typeof rec.loss === "number") {
          const w = this.emaWeight;
          this.smoothed = this.smoothed === null ? rec.loss : w * this.smoothed + (1 - w) * rec.loss;
          this.losses.x.push(step);
          this.losses.y.push(rec.loss);
          c.loss.push(0, step, rec.loss);
          c.loss.push(1, step, this.smoothed);
        }
        c.loss.push(2, step, rec.grad_norm);
        c.host.push(0, step, rec.rss_mb);
        c.host.push(1, step, rec.pinned_mb);
        break;
      }
      case "activation_stagehand/step": {
        c.spill.push(0, step, rec.activations_kept);
        c.spill.push(1, step, rec.activations_spilled);
        c.spill.push(2, step, (rec.spill_bytes ?? 0) / 2 ** 20);
        c.spill.push(3, step, (rec.restore_bytes ?? 0) / 2 ** 20);
        const lookups = (rec.pool_hits ?? 0) + (rec.pool_misses ?? 0);
        c["spill-pool"].push(0, step, lookups ? (100 * rec.pool_hits) / lookups : null);
        c["spill-pool"].push(1, step, rec.stall_time_ms);
        break;
      }
      case "conductor/step":
        c.conductor.push(0, step, rec.grant_count);
        c.conductor.push(1, step, rec.partial_count);
        c.conductor.push(2, step, rec.deny_count);
        c.conductor.push(3, step, rec.h2d_inflight);
        c.conductor.push(4, step, rec.d2h_inflight);
        break;
      case "trainer/resumed":
        this.resumedAt(t, step);
        break;
      case "strategy/limits_applied":
        this.markLimits(t, step, rec);
        break;
      case "trainer/oom_recovery":
        this.markRecovery(t, step, rec);
        break;
      case "trainer/event":
        if (rec.event === "control_rejected") this.markRefused(t, step, rec);
        break;
      default:
        break;
    }
  }

  /**
   * Downsampled block records (`buckets=` answer: {time, min, max} per bucket) drawn under
   * whatever the stream already added: each bucket's min and max, so the post-eviction valleys
   * and the block-loaded peaks both stay on the chart.
   */
  ingestBuckets(buckets) {
    if (!buckets.length) return;
    this.blockRecords += buckets.length;
    this._vramTitle();
    const x = [];
    const alloc = [];
    const reserved = [];
    const text = [];
    this.watermarks.start(this._t(buckets[0]));
    buckets.forEach((b, i) => {
      const t = this._t(b);
      const next = buckets[i + 1] ? this._t(buckets[i + 1]) : t;
      const mid = t + (next - t) / 2; // the bucket's max drawn inside its own span
      x.push(t, mid);
      text.push(`<br>lowest of ${b.count ?? "its"} block records`, `<br>highest of ${b.count ?? "its"} block records`);
      alloc.push(b.min?.vram_allocated_mb, b.max?.vram_allocated_mb);
      reserved.push(b.min?.vram_reserved_mb, b.max?.vram_reserved_mb);
    });
    this.charts.vram.prependSeries(0, x, alloc, text);
    // Tracked memory reports reserved = allocated (see _vramPoint).
    if (reserved.some((v, i) => v !== alloc[i])) this.charts.vram.prependSeries(1, x, reserved, text);
  }

  /**
   * Allocated and reserved VRAM of one record. Tracked memory (no CUDA) has no allocator cache:
   * its reserved figure is the allocated one, and drawing it would only hide that line.
   */
  _vramPoint(t, rec, text) {
    this.watermarks.start(t);
    if (rec.vram_allocated_mb !== undefined) this.charts.vram.push(0, t, rec.vram_allocated_mb, text);
    if (rec.vram_reserved_mb !== undefined && rec.vram_source !== "tracked") {
      this.charts.vram.push(1, t, rec.vram_reserved_mb, text);
    }
  }

  /**
   * A resumed worker trains the steps after `step` (its checkpoint's) again: what the discarded
   * run drew past it leaves every step chart, so each step is drawn once, from its newest
   * records (the records themselves all arrive, once each). A marker says where it resumed.
   */
  resumedAt(t, step) {
    if (typeof step !== "number") return;
    for (const [id, chart] of Object.entries(this.charts)) {
      if (id !== "vram" && id !== "residency") chart.dropAfter(step);
    }
    const kept = this.losses.x.flatMap((x, i) => (x <= step ? [i] : []));
    this.losses = { x: kept.map((i) => this.losses.x[i]), y: kept.map((i) => this.losses.y[i]) };
    this.setEma(this.emaWeight);
    for (const s of [...this.stepEnds.keys()]) if (s > step) this.stepEnds.delete(s);
    if (this.lastStep !== null && this.lastStep > step) this.lastStep = step;
    this._mark(t, step, `resumed after step ${step}`, RESUMED);
  }

  /** Vertical marker on every chart where limits took effect. */
  markLimits(t, step, rec) {
    if (rec.request_id === "auto") {
      const label = this.watermarks.resolved(t, rec);
      if (label) this._mark(t, step, label, APPLIED);
      return;
    }
    const wm = rec.changed || {};
    if (rec.request_id === "oom") { // the recovery's own marker says so (markRecovery)
      this.watermarks.draw(t, wm.vram_high_watermark_mb?.[1], wm.vram_low_watermark_mb?.[1]);
      return;
    }
    const changed = Object.entries(wm)
      .map(([field, [, now]]) => `${SHORT[field] || field}=${drawnWatermark(now) ?? "no limit"}`)
      .join(", ");
    this._mark(t, step, `limits: ${changed || "no change"}`, APPLIED);
    this.watermarks.draw(t, wm.vram_high_watermark_mb?.[1], wm.vram_low_watermark_mb?.[1]);
  }

  /** Marker where the worker refused a request (before any step: on the time charts only). */
  markRefused(t, step, rec) {
    let label = `refused: ${rec.message || "no reason given"}`;
    if (label.length > REFUSED_LABEL_CHARS) label = `${label.slice(0, REFUSED_LABEL_CHARS - 1)}…`;
    this._mark(t, step, label, REFUSED);
  }

  /** Marker where the card ran out of memory and the run lowered its limits to go on. */
  markRecovery(t, step, rec) {
    const phase = rec.phase ? ` (${rec.phase})` : "";
    this._mark(t, step, `out of memory at step ${step ?? "?"}${phase}: limits lowered`, OOM);
  }

  _mark(t, step, label, { color, dash }) {
    for (const [id, chart] of Object.entries(this.charts)) {
      const timeBased = id === "vram" || id === "residency";
      if (timeBased) chart.addMarker(t, label, color, dash);
      else if (step !== null && step !== undefined) chart.addMarker(step, label, color, dash);
    }
  }

  /** The run is over: what the pacing held back is drawn now (charts.js PACE), and charts
   * still waiting will not get records. */
  finished() {
    for (const chart of Object.values(this.charts)) {
      chart.unpace();
      if (chart.empty && chart.emptyText === WAITING) chart.setEmptyText("no records of this kind in this run");
    }
  }

  flush() {
    for (const chart of Object.values(this.charts)) chart.flush();
  }

  /**
   * Draws what is queued, charts in the window first: those are drawn now and the others one
   * per task once that frame has been painted (a long run's history takes ~30-150 ms a chart).
   * @param {function} [onVisiblePainted] called when the window's charts have been painted
   * @returns {Promise<void>} resolved when every chart is drawn
   */
  drawVisibleFirst(onVisiblePainted) {
    const charts = Object.values(this.charts);
    const rects = charts.map((c) => c.el.getBoundingClientRect()); // one layout, before any draw
    const later = charts.filter((c, i) => rects[i].top >= window.innerHeight || rects[i].bottom <= 0);
    for (const c of later) c.unschedule();
    for (const c of charts) if (!later.includes(c)) c.flush();
    return new Promise((resolve) => {
      const next = () => {
        const c = later.shift();
        if (!c || this.purged) return resolve();
        c.flush();
        return setTimeout(next, 0);
      };
      afterPaint(() => {
        if (onVisiblePainted) onVisiblePainted();
        next();
      });
    });
  }

  purge() {
    this.purged = true; // stops drawVisibleFirst's queue
    for (const chart of Object.values(this.charts)) chart.purge();
  }
}
