// The New run page's plan panel: before Start, "Plan" sends the config being edited to
// POST /api/plan with a device profile and shows whether it fits (or the knob that makes it
// fit), peak VRAM, the steady band, host bytes, the step time with its breakdown, what a
// steady step moves (resident vs streamed blocks, GB of H2D per step and where the loads come
// from, the bound max(compute, bytes / H2D)), SquareQ's quantization error when it is on, and
// the predicted VRAM over one steady step as a Plotly line. Sizes in MiB / GiB (2^20, 2^30
// bytes).

import { api } from "./api.js";
import { BASE_LAYOUT, PLOT_CONFIG } from "./charts.js";
import { drawnWatermark } from "./runcharts.js";
import { fill, h, showError } from "./ui.js";

const MB = 1024 * 1024;
const GIB = 1024 * MB;
const DEVICES = ["cpu", "rtx3090", "rtx4090", "rtx5090", "h100", "h100-pcie"];

const mb = (bytes) => `${(bytes / MB).toFixed(1)} MiB`;
const gib = (bytes) => `${(bytes / GIB).toFixed(2)} GiB`;
/** Bytes moved: GiB from 1 GiB up, else MiB (a tiny model moves a few MiB a step). */
const moved = (bytes) => (bytes >= GIB ? gib(bytes) : mb(bytes));

const SOURCES = {
  host_cache: "host cache (pinned H2D)", page_cache: "page cache through the readers",
  disk: "disk through the readers", tracked: "host copies (CPU device)",
};

/** Resident vs streamed blocks, GB moved per step and from where, the bound (plan.transfers). */
function transfers(plan) {
  const t = plan.transfers;
  if (!t) return [];
  const from = Object.entries(t.loads_by_source).map(([k, n]) => `${SOURCES[k] || k} ${n}`).join(", ");
  const b = plan.bound_ms;
  const resident = h("li", { id: "plan-residency" },
    h("strong", {}, `${t.resident_blocks} of ${t.resident_blocks + t.streamed_blocks} blocks resident`),
    ` (${moved(t.resident_block_bytes)}), ${t.streamed_blocks} streamed (${moved(t.streamed_block_bytes)})`);
  const perStep = h("li", { id: "plan-moved" },
    h("strong", {}, `${moved(t.h2d_bytes_per_step)} H2D per step`),
    ` in ${t.block_loads_per_step} block loads${from ? `, from ${from}` : ""}`,
    t.block_loads_per_step ? `; ${t.misses_per_step} miss their prefetch (loaded on demand), ${t.waits_per_step} host waits on a copy in flight, prefetch window ${t.window_blocks} block${t.window_blocks === 1 ? "" : "s"}` : "");
  const bound = b ? h("li", { id: "plan-bound" },
    `bound max(compute ${b.compute.toFixed(1)} ms, H2D ${b.h2d.toFixed(1)} ms) = ${b.bound.toFixed(1)} ms; plan ${plan.step_ms.total.toFixed(1)} ms`) : null;
  const a = plan.auto_watermarks;
  // A pair "auto" left without a budget (a tracked device, no cap) is "no limit", not 1e9 MiB.
  const pair = (high, low) => (drawnWatermark(high) === null ? "no limit" : `${high.toFixed(0)} / ${low.toFixed(0)} MiB`);
  const auto = a ? h("li", { id: "plan-auto" }, `"auto": weight watermarks ${pair(a.high_mb, a.low_mb)}`
    + (a.activation_mb ? `, activation ${pair(...a.activation_mb)}` : "")
    + (a.conductor_caps_mb ? `, Conductor caps ${pair(...a.conductor_caps_mb)}` : "")) : null;
  return [resident, perStep, bound, auto];
}

const pct = (x) => `${(100 * x).toFixed(3)}%`;

/** SquareQ's quantization error of the weights (workbench.plan.quant_error, backend/workbench/plan/quant_error.py):
 * read from SquareQ's cache only (a request never quantizes), else "not measured: why". */
function quantError(plan) {
  const q = plan.quant_error;
  if (!q) return null;
  const head = h("strong", {}, `SquareQ ${q.format}`);
  if (!q.measured) return h("li", { id: "plan-quant-error" }, head, `: ${q.reason}`);
  const stored = q.prequantized_layers
    ? `; ${q.prequantized_layers} layers stored in 8 bits in the checkpoint (no source to compare)` : "";
  if (!q.quantized_layers) return h("li", { id: "plan-quant-error" }, head, `: no layer quantized${stored}`);
  const worst = q.worst_layers.map(([name, err]) => `${name} ${pct(err)}`).join(", ");
  return h("li", { id: "plan-quant-error", title: `five worst: ${worst}` }, head,
    `: ${q.quantized_layers} layers, relative RMS error mean ${pct(q.rel_rms_mean)}, worst ${pct(q.rel_rms_max)} (${q.worst_layer})${stored}`);
}

/**
 * The plan's host memory. On a tracked (CPU) device it is a budget: the plan counts the pools and
 * the host cache at their full size, while a CPU run pins nothing and fills its weight pool only
 * as blocks use it (a run's RSS is far below).
 */
function hostText(host, tracked) {
  const spilled = `spilled ${mb(host.spilled_activation_bytes)} per step`;
  const cache = mb(host.host_cache_bytes ?? 0);
  if (!tracked) return `host RAM peak ${mb(host.ram_peak_bytes)} (pinned ${mb(host.pinned_bytes)}, of it host cache ${cache}), ${spilled}`;
  return `host RAM budget ${mb(host.ram_peak_bytes)} (the worker with its pools and host cache at their full size:`
    + ` ${mb(host.pinned_bytes)}, of it host cache ${cache}); on CPU nothing is pinned and the pools fill as blocks use them; ${spilled}`;
}

/** The plan's numbers as a few lines. */
function summary(plan) {
  const ms = plan.step_ms;
  const [low, high] = plan.steady_band_bytes;
  const knob = plan.knob ? Object.entries(plan.knob).filter(([k]) => k !== "peak_bytes")
    .map(([k, v]) => `${k} = ${JSON.stringify(v)}`).join(", ") : null;
  const verdict = plan.fits ? "fits"
    : knob ? `does not fit; fits with ${knob} (peak ${mb(plan.knob.peak_bytes)})` : "does not fit; no knob tried makes it fit";
  const cap = plan.device.vram_bytes ? ` of ${mb(plan.device.vram_bytes)}` : "";
  return h("div", { id: "plan-summary" },
    h("p", {}, h("strong", { id: "plan-verdict", "data-fits": String(plan.fits) }, verdict),
      ` on ${plan.device.name} (${plan.vram_source})`),
    h("ul", {},
      h("li", { id: "plan-peak" }, `peak VRAM ${mb(plan.peak_bytes.steady)} steady, ${mb(plan.peak_bytes.trace_step)} trace step${cap}`),
      h("li", {}, `steady band ${mb(low)} – ${mb(high)}`),
      h("li", { id: "plan-host" }, hostText(plan.host, plan.vram_source === "tracked")),
      h("li", { id: "plan-step" }, `step ${ms.total.toFixed(1)} ms = compute ${ms.compute.toFixed(1)} + exposed H2D ${ms.exposed_h2d.toFixed(1)} (stalls ${ms.stall.toFixed(1)})`),
      h("li", { id: "plan-profile", title: plan.device.source }, profileText(plan.device)),
      ...transfers(plan),
      quantError(plan),
      plan.calibration ? h("li", { id: "plan-calibration" }, calibrationText(plan.calibration)) : null,
      // Runs of this family on this card that ran out of memory: the limits planned are capped at
      // those they went on with (backend/workbench/plan/recovery.py).
      plan.recovery ? h("li", { id: "plan-recovery" }, plan.recovery.note) : null));
}

/** "profile 0.037 TFLOPs, H2D 2.18 GB/s, memory 3.3 GB/s, 46.2 µs/op, 3813 µs/load; median of 3
 * of 3 measurements on this machine (µs/op measured: 44.1, 46.2, 61.9)": the device profile's
 * figures, and for this machine's stored CPU profile how far apart the measurements its median
 * is of were (NOTE [ One CPU profile per machine ] in backend/workbench/plan/profiles.py). */
function profileText(dev) {
  let text = `profile ${dev.tflops} TFLOPs, H2D ${dev.h2d_gbps} GB/s, memory ${dev.mem_gbps} GB/s`;
  if (dev.tracked) text += `, ${dev.op_us} µs/op, ${dev.load_us} µs/load`;
  const m = dev.measured;
  if (m) {
    const ops = m.values.op_us.filter((v) => v !== null).join(", ");
    text += `; ${m.count > 1 ? "median of " : ""}${m.count} of ${m.wanted} measurements on this machine (µs/op measured: ${ops})`;
  }
  return text;
}

const RATIO_NAMES = { peak_vram_mb: "VRAM", step_ms: "step", host_ram_mb: "host RAM", pinned_mb: "pinned" };

/** "calibrated by runs #7, #5 on cpu/flux (median): VRAM ×1.004, step ×1.698 (median ×4.900 of
 * 1 run, damped toward 1); refused: run #6 step ×0.047 (outside 0.2–5)" (backend/workbench/plan/feedback.py
 * describe; a median of too few runs is applied damped: NOTE [ A lone ratio ]). */
function calibrationText(cal) {
  const medians = cal.medians || {};
  const ratio = ([k, v]) => {
    const m = medians[k];
    const n = (cal.runs || {})[k];
    const damped = m !== undefined && Math.abs(m - v) > 1e-9
      ? ` (median ×${m.toFixed(3)} of ${n} run${n > 1 ? "s" : ""}, damped toward 1)` : "";
    return `${RATIO_NAMES[k] || k} ×${v.toFixed(3)}${damped}`;
  };
  const ratios = Object.entries(cal.ratios).map(ratio).join(", ");
  const runs = cal.run_ids.flatMap((id, i) => [i ? ", " : "", h("a", { href: `#/runs/${id}` }, `#${id}`)]);
  const refused = (cal.refused || []).map((r) => `run #${r.run_id} ${RATIO_NAMES[r.figure] || r.figure} ×${r.ratio.toPrecision(3)} (outside ${r.bounds[0]}–${r.bounds[1]})`);
  return h("span", {}, `calibrated by run${cal.run_ids.length > 1 ? "s" : ""} `, ...runs,
    ` on ${cal.device}/${cal.family}${cal.run_ids.length > 1 ? " (median)" : ""}: ${ratios}`,
    refused.length ? `; refused: ${refused.join(", ")}` : "");
}

function curve(el, plan) {
  const c = plan.curve;
  const data = [{
    x: c.t_ms, y: c.bytes.map((b) => b / MB), text: c.event, type: "scatter", mode: "lines",
    line: { shape: "hv", width: 1.5 }, name: "predicted VRAM (MiB)",
  }];
  const layout = {
    ...BASE_LAYOUT, title: { text: "Predicted VRAM over one steady step", font: { size: 13 } },
    xaxis: { ...BASE_LAYOUT.xaxis, title: { text: "ms" } },
    yaxis: { ...BASE_LAYOUT.yaxis, title: { text: "MiB" } }, hovermode: "closest",
  };
  if (window.Plotly) window.Plotly.react(el, data, layout, PLOT_CONFIG);
}

/**
 * @param {{getConfig: () => object|null, getRequest?: () => ({preset: string, overrides: object}|null),
 *   placeError?: (err: Error) => boolean}} opts the config being edited (null when invalid), the
 *   run request it makes (for Tune; null when it cannot make one, the page having said why), and
 *   what puts a plan's error beside the fields it names (true: placed, no box shown here)
 * @returns {{el: HTMLElement, setBlocked: (reason: string|null) => void}} the panel, and what
 *   holds Plan and Tune back while the page holds a value it marked invalid (the config would
 *   be planned without it)
 */
export function planPanel({ getConfig, getRequest, placeError }) {
  const device = h("select", { id: "plan-device" }, DEVICES.map((d) => h("option", { value: d }, d)));
  const budget = h("input", { id: "tune-budget", type: "text", inputmode: "decimal", placeholder: "MB", size: 8 });
  const trialSteps = h("input", { id: "tune-steps", type: "text", inputmode: "numeric", value: "3", size: 3 });
  const tuneBtn = h("button", { id: "tune-run", onclick: tune, title: "run the plan's candidates within the budget as short trials" }, "Tune");
  const errors = h("div", { class: "page-errors", id: "plan-errors" });
  const result = h("div", { id: "plan-result" });
  const progress = h("div", { class: "muted", id: "plan-progress", hidden: true });
  const chart = h("div", { class: "chart", id: "plan-chart", hidden: true });
  const btn = h("button", { id: "plan-run", onclick: run }, "Plan");
  let blocked = null;

  function setBlocked(reason) {
    blocked = reason;
    for (const b of [btn, tuneBtn]) {
      if (b.dataset.busy !== "1") b.disabled = Boolean(reason);
      b.title = reason || b.dataset.title || "";
    }
  }
  tuneBtn.dataset.title = tuneBtn.title;

  async function run() {
    if (blocked) return;
    fill(errors);
    fill(result);
    const preset = getConfig();
    if (!preset) return;
    btn.disabled = true;
    btn.dataset.busy = "1";
    const stop = showProgress(device.value);
    try {
      const plan = await api.plan({ preset, device: device.value });
      fill(result, summary(plan));
      chart.hidden = false;
      curve(chart, plan);
    } catch (err) {
      if (!placeError || !placeError(err)) showError(errors, err, "plan");
    } finally {
      stop();
      delete btn.dataset.busy;
      btn.disabled = Boolean(blocked);
    }
  }

  /**
   * Says what a plan in flight is doing, with the seconds it has taken, until `stop()`. The
   * first plans on `cpu` measure this machine first (tens of seconds, longer while the demo
   * builds): the line says so rather than leaving a greyed-out button.
   * @param {string} name the device profile planned on
   * @returns {() => void} stop
   */
  function showProgress(name) {
    const started = performance.now();
    let doing = "Planning";
    const tick = () => {
      progress.textContent = `${doing}… ${Math.round((performance.now() - started) / 1000)} s`;
    };
    tick();
    progress.hidden = false;
    const timer = setInterval(tick, 1000);
    if (name === "cpu") {
      api.cpuProfile().then((s) => {
        if (!s.will_measure || progress.hidden) return;
        const last = s.measure_s ? `the last took ${Math.round(s.measure_s)} s` : "tens of seconds";
        doing = `Planning: measuring this machine's CPU first (measurement ${s.measurements + 1} ` +
          `of ${s.wanted}, once per machine; ${last})`;
        tick();
      }).catch(() => {});
    }
    return () => {
      clearInterval(timer);
      progress.hidden = true;
    };
  }

  /** Queues the plan's candidates within the budget as trial runs and opens the tune's page. */
  async function tune() {
    if (blocked) return;
    fill(errors);
    if (!getConfig() || !getRequest) return;
    const request = getRequest(); // null: the page said why
    if (!request) return;
    const { preset, overrides } = request;
    tuneBtn.disabled = true;
    tuneBtn.dataset.busy = "1";
    try {
      // Numbers as typed: the API says which field is wrong and why (a budget below the
      // smallest feasible plan gives that minimum).
      const made = await api.createTune({
        preset, overrides, device: device.value,
        budget_mb: budget.value.trim() === "" ? null : Number(budget.value),
        trial_steps: Number(trialSteps.value),
      });
      location.hash = `#/tunes/${made.id}`;
    } catch (err) {
      showError(errors, err, "tune");
    } finally {
      delete tuneBtn.dataset.busy;
      tuneBtn.disabled = Boolean(blocked);
    }
  }

  const el = h("div", { class: "plan-panel" },
    h("h2", {}, "Plan (predicted VRAM and step time, no weights loaded)"),
    h("div", { class: "toolbar" }, h("label", { class: "inline" }, "Device ", device), btn,
      getRequest ? h("label", { class: "inline" }, "VRAM budget (MB) ", budget) : null,
      getRequest ? h("label", { class: "inline" }, "trial steps ", trialSteps) : null,
      getRequest ? tuneBtn : null),
    progress, errors, result, chart);
  return { el, setBlocked };
}
