// A finished run's plan next to what it measured (GET /api/runs/{id}/calibration): the plan's
// VRAM over one steady step beside the weight runtime's allocated MB at each block record of the
// run's last step (each over its own step's span), their peaks, and a table of the
// predicted and measured figures with their ratios (what later plans on this device and family
// are scaled by); with weight streaming, what a steady step moves (block loads, H2D, prefetch
// misses, host waits: backend/workbench/plan/feedback.py TRANSFERS), which scales nothing.

import { BASE_LAYOUT, PLOT_CONFIG, legendFit } from "./charts.js";
import { fmtMB, fmtMs, fmtNum, h } from "./ui.js";

const MB = 1024 * 1024;
const ROWS = [
  ["peak_vram_mb", "peak VRAM (training)", fmtMB],
  ["step_ms", "mean step time", fmtMs],
  ["host_ram_mb", "host RAM peak", fmtMB],
  ["pinned_mb", "pinned", fmtMB],
];
const TRANSFER_ROWS = [
  ["block_loads_per_step", "block loads per step", fmtNum],
  ["h2d_mb_per_step", "H2D per step", fmtMB],
  ["misses_per_step", "prefetch misses per step (loads on demand)", fmtNum],
  ["waits_per_step", "host waits per step (on a copy in flight)", fmtNum],
];
// On CPU nothing is pinned: the worker's "pinned" is the pools' sizes, and the plan's host RAM
// counts them at their full size, while the run's RSS is what it used.
const CPU_LABELS = {
  host_ram_mb: "host RAM peak (predicted: a budget, the pools at their full size; measured: RSS)",
  pinned_mb: "pinned (the pools' sizes: budgets on CPU, nothing is pinned)",
};

// A count the schedule decides: equal or not, and by how much (no ratio of a 0).
function compared(p, m) {
  if (typeof p !== "number" || typeof m !== "number") return "–";
  if (p === m) return "equal";
  return p > 0 && m > 0 ? `×${(m / p).toFixed(3)}` : `${m > p ? "+" : ""}${fmtNum(m - p)}`;
}

function table(cal) {
  const label = (key, text) => (cal.device === "cpu" && CPU_LABELS[key]) || text;
  const row = (key, text, fmt, versus) => h("tr", { dataset: { figure: key } },
    h("td", {}, label(key, text)), h("td", {}, fmt(cal.predicted[key])), h("td", {}, fmt(cal.measured[key])),
    h("td", {}, versus));
  const ratio = (key) => (cal.ratios[key] != null ? `×${cal.ratios[key].toFixed(3)}` : "–");
  const moved = TRANSFER_ROWS.filter(([key]) => cal.predicted[key] != null);
  return h("table", { class: "scan-table", id: "calibration-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "figure"), h("th", {}, "predicted"), h("th", {}, "measured"), h("th", {}, "measured / predicted"))),
    h("tbody", {},
      ROWS.map(([key, text, fmt]) => row(key, text, fmt, ratio(key))),
      moved.map(([key, text, fmt]) => row(key, text, fmt, compared(cal.predicted[key], cal.measured[key])))));
}

/** Draws the overlay into `el` (a chart div already in the page). */
export function drawOverlay(el, cal) {
  const plan = cal.plan.curve;
  const measured = cal.measured.curve || { t_ms: [], mb: [] };
  const predictedPeak = cal.predicted.peak_vram_mb;
  const measuredPeak = cal.measured.peak_vram_mb;
  // Each curve over its own step, as a share of it: a plan on a GPU profile and a run that took
  // far longer (or a CPU run's host overheads) still overlay; hover gives each point's ms.
  const share = (t) => {
    const end = t[t.length - 1] || 1;
    return t.map((v) => (100 * v) / end);
  };
  const hover = (events, t) => events.map((e, i) => `${e} at ${t[i].toFixed(2)} ms`);
  const flat = (y, name, color) => ({ x: [0, 100], y: [y, y], mode: "lines", name, line: { color, dash: "dot", width: 1 } });
  const data = [
    { x: share(plan.t_ms), y: plan.bytes.map((b) => b / MB), text: hover(plan.event, plan.t_ms), mode: "lines", name: "predicted (plan, one steady step)", line: { shape: "hv", color: "#e08a1e", width: 1.5 } },
    { x: share(measured.t_ms), y: measured.mb, text: hover(measured.event, measured.t_ms), mode: "lines", name: `measured (block records, step ${measured.step ?? "?"})`, line: { shape: "hv", color: "#1f5fa8", width: 1.5 } },
  ];
  if (predictedPeak != null) data.push(flat(predictedPeak, "predicted peak", "#e08a1e"));
  if (measuredPeak != null) data.push(flat(measuredPeak, "measured peak", "#1f5fa8"));
  const layout = {
    ...BASE_LAYOUT,
    ...legendFit(el.clientWidth, data.length), // a phone's legend in rows below the axis title
    title: { text: "VRAM over one step: predicted vs measured", font: { size: 13 } },
    xaxis: { ...BASE_LAYOUT.xaxis, title: { text: "% of the step (first to last event)" }, range: [0, 100] },
    yaxis: { ...BASE_LAYOUT.yaxis, title: { text: "MB" } },
    hovermode: "closest",
  };
  if (window.Plotly) window.Plotly.react(el, data, layout, PLOT_CONFIG);
}

/** The card's content: a note, the figures table and the chart div (drawn by drawOverlay). */
export function calibrationView(cal) {
  const chart = h("div", { class: "chart", id: "calibration-chart" });
  const note = `Planned on ${cal.device} for family ${cal.family}: later plans on ${cal.device} for ${cal.family} are scaled by these ratios (calibration from run #${cal.run_id}).`;
  return { chart, nodes: [h("h2", {}, "Plan vs measured"), h("p", { class: "muted" }, note), table(cal), chart] };
}
