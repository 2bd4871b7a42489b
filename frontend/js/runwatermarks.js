// The VRAM chart's watermark lines and what "auto" limits became. The lines start at the first
// VRAM record with the config's figures, follow every record that gives them (stagehand/step,
// strategy/limits_applied) and are drawn on to the newest point (runchartspecs.js, holdToEnd).
// Limits a config left "auto" are named with the figures the worker resolved them to: the VRAM
// chart's legend for the weight watermarks, the spill chart's title for the activation ones.

/** Short names of LiveLimits fields for chart markers (the limits panel logs the full ones). */
export const SHORT = {
  vram_high_watermark_mb: "high",
  vram_low_watermark_mb: "low",
  activation_vram_high_watermark_mb: "spill high",
  activation_vram_low_watermark_mb: "spill low",
  prefetch_window_blocks: "window",
  max_inflight_transfers: "in-flight",
  max_inflight_d2h: "D2H",
  max_inflight_h2d: "H2D",
};

// "auto" watermarks on a tracked (CPU) device without a cap: no limit, written as this many MB
// (runtime/stagehand/strategy/auto.py, NO_BUDGET_MB). Not drawn: it would scale the VRAM chart to 1e9 MB.
const NO_LIMIT_MB = 1e9;

/** A watermark as the VRAM chart draws it: null (a gap) for "no limit". */
export function drawnWatermark(mb) {
  return mb >= NO_LIMIT_MB ? null : mb;
}

/** A watermark for a label: "no limit", or MB ("19,000"; whole MB, tiny ones to 3 digits) and
 * the unit unless `bare`. */
export function watermarkText(mb, bare = false) {
  if (drawnWatermark(mb) === null) return "no limit";
  return `${mb >= 100 ? Math.round(mb).toLocaleString("en-US") : Number(mb.toPrecision(3))}${bare ? "" : " MB"}`;
}

/**
 * [high, low] MB of the run's config when the weight runtime streams with numbers for them:
 * in force from the first VRAM record, before the first step's record gives them. Null
 * otherwise ("auto" is drawn from the worker's figures, its strategy/limits_applied record).
 */
function startWatermarks(config) {
  const memory = config.memory || {};
  const sh = memory.stagehand || {};
  if ((memory.strategy ?? "stagehand") !== "stagehand" || sh.weight_streaming === false) return null;
  const marks = [sh.vram_high_watermark_mb, sh.vram_low_watermark_mb];
  return marks.every((v) => typeof v === "number") ? marks : null;
}

/** The watermark traces (2: high, 3: low) of the VRAM chart of `charts` (buildRunCharts). */
export class WatermarkLines {
  constructor(charts, config) {
    this.charts = charts;
    this.startMarks = startWatermarks(config);
    this.drawn = false; // a watermark point is on the chart
    this.autoFields = new Set(); // the limits the config left "auto"
  }

  /** Watermark points (MB; undefined: not given) at `t` s. */
  draw(t, high, low) {
    const vram = this.charts.vram;
    if (high !== undefined) vram.push(2, t, drawnWatermark(high));
    if (low !== undefined) vram.push(3, t, drawnWatermark(low));
    if (high !== undefined || low !== undefined) this.drawn = true;
  }

  /** A VRAM figure at `t`: the config's watermarks start there unless a record gave some. */
  start(t) {
    if (!this.drawn && this.startMarks) this.draw(t, ...this.startMarks);
  }

  /** A stagehand/step record: the watermarks in force at its step's end. */
  step(t, rec) {
    this.draw(t, rec.vram_high_watermark_mb, rec.vram_low_watermark_mb);
    this._legend(rec.vram_high_watermark_mb, rec.vram_low_watermark_mb);
  }

  /**
   * What "auto" became (a strategy/limits_applied record of request "auto"). At build, the
   * config's "auto" fields resolved: the run's starting limits, not a change (null: no marker).
   * Later, the weight watermarks again from the activations the trace step measured: a change,
   * returned as its marker's label with the figures.
   */
  resolved(t, rec) {
    const changed = rec.changed || {};
    const atBuild = Object.values(changed).every(([old]) => old === "auto");
    if (atBuild) for (const field of Object.keys(changed)) this.autoFields.add(field);
    const now = (field) => changed[field]?.[1];
    this.draw(t, now("vram_high_watermark_mb"), now("vram_low_watermark_mb"));
    this._legend(now("vram_high_watermark_mb"), now("vram_low_watermark_mb"));
    const [high, low] = [now("activation_vram_high_watermark_mb"), now("activation_vram_low_watermark_mb")];
    if (high !== undefined && this.autoFields.has("activation_vram_high_watermark_mb")) {
      const figures = drawnWatermark(high) === null ? "no limit" : `${watermarkText(high, true)} / ${watermarkText(low)}`;
      this.charts.spill.setTitle(`Activation spill per step (auto watermarks: ${figures})`);
    }
    if (atBuild) return null;
    const text = Object.entries(changed).map(([field, [, mb]]) => `${SHORT[field] || field}=${watermarkText(mb, true)}`);
    return `auto: ${text.join(", ")} MB`;
  }

  /** The weight watermarks in force (MB) in the legend, where the config left them "auto". */
  _legend(high, low) {
    const vram = this.charts.vram;
    const name = (i, what, mb) => {
      if (mb === undefined) return; // a record without the figure
      const text = `${what} watermark (auto): ${watermarkText(mb)}`;
      if (vram.names[i] !== text) vram.setName(i, text);
    };
    if (this.autoFields.has("vram_high_watermark_mb")) name(2, "high", high);
    if (this.autoFields.has("vram_low_watermark_mb")) name(3, "low", low);
  }
}
