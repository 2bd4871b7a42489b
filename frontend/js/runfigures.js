// The run page's header figures, from the records as they arrive (a finished run's come from the
// backend's summary, `store.summary`, which sums them the same way).

import { h } from "./ui.js";

/** The header's figures, summed from records as `store.summary` sums them in the backend:
 * peak VRAM per stage (stage 1 from the trainer's "cache" stage record to its "train" one). */
export function newFigures() {
  return { loss: null, peak: null, encodePeak: null, stage1: false, trained: false, stepMsSum: 0, steps: 0, spill: null, weights: null, squareq: null };
}

/** Adds one `step` record (any source); true when a figure changed. */
export function addFigures(f, rec) {
  let changed = false;
  const key = f.stage1 ? "encodePeak" : "peak";
  if (typeof rec.vram_peak_mb === "number" && (f[key] === null || rec.vram_peak_mb > f[key])) {
    f[key] = rec.vram_peak_mb;
    changed = true;
  }
  if (rec.source === "trainer") {
    if (typeof rec.loss === "number") f.loss = rec.loss;
    if (typeof rec.step_time_ms === "number") {
      f.stepMsSum += rec.step_time_ms;
      f.steps += 1;
    }
    changed = true;
  } else if (rec.source === "activation_stagehand" && typeof rec.spill_bytes === "number") {
    f.spill = (f.spill ?? 0) + rec.spill_bytes;
    changed = true;
  } else if (rec.source === "stagehand" && typeof rec.weights_mode === "string") {
    // The last stagehand step record's mode: the training stage's (stage 1 streams before it).
    f.weights = { weights_mode: rec.weights_mode, weights_mode_reason: rec.weights_mode_reason ?? null };
    changed = true;
  } else if (rec.source === "squareq" && typeof rec.note === "string") {
    f.squareq = rec.note;  // frozen weights in 8 bits (README "Frozen weights in 8 bits")
    changed = true;
  }
  return changed;
}

/** The figures as `RunSummary` fields (absent where no record said anything yet). */
export function figuresOf(f) {
  const out = {};
  if (f.loss !== null) out.final_loss = f.loss;
  if (f.peak !== null) out.peak_vram_mb = f.peak;
  if (f.encodePeak !== null) out.encode_peak_vram_mb = f.encodePeak;
  if (f.steps) out.mean_step_time_ms = f.stepMsSum / f.steps;
  if (f.spill !== null) out.spill_bytes = f.spill;
  if (f.weights) Object.assign(out, f.weights);
  if (f.squareq) out.weights_squareq = f.squareq;
  return out;
}

/** The header fact saying how weight streaming reaches the GPU and why (README "Which mode
 * weight streaming runs in"), or null for a run that streams no weights. */
export function weightsFact(s) {
  if (!s.weights_mode) return null;
  return h("div", { class: "fact", id: "fact-weights", title: s.weights_mode_reason || "" },
    h("span", { class: "fact-label" }, "weights"),
    h("span", { class: "fact-value" }, s.weights_mode),
    s.weights_mode_reason ? h("span", { class: "fact-note muted" }, s.weights_mode_reason) : null,
    s.weights_squareq ? h("span", { class: "fact-note fact-squareq muted" }, s.weights_squareq) : null);
}
