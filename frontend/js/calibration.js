// A finished run's plan next to what it measured (GET /api/runs/{id}/calibration): the plan's
// VRAM over one steady step beside the weight runtime's allocated MB at each block record of the
// run's last step (each over its own step's span), their peaks, and a table of the
// predicted and measured figures with their ratios (what later plans on this device and family
// are scaled by).

import { BASE_LAYOUT, PLOT_CONFIG, legendFit } from "./charts.js";
import { fmtMB, fmtMs, h } from "./ui.js";

const MB = 1024 * 1024;
const ROWS = [
  ["peak_vram_mb", "peak VRAM (training)", fmtMB],
  ["step_ms", "mean step time", fmtMs],
  ["host_ram_mb", "host RAM peak", fmtMB],
  ["pinned_mb", "pinned", fmtMB],
];
// On CPU nothing is pinned: the worker's "pinned" is the pools' sizes, and the plan's host RAM
// counts them at their full size, while the run's RSS is what it used.
const CPU_LABELS = {
  host_ram_mb: "host RAM peak (predicted: a budget, the pools at their full size; measured: RSS)",
  pinned_mb: "pinned (the pools' sizes: budgets on CPU, nothing is pinned)",
};

function table(cal) {
  const label = (key, text) => (cal.device === "cpu" && CPU_LABELS[key]) || text;
  return h("table", { class: "scan-table", id: "calibration-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "figure"), h("th", {}, "predicted"), h("th", {}, "measured"), h("th", {}, "measured / predicted"))),
    h("tbody", {}, ROWS.map(([key, text, fmt]) => h("tr", { dataset: { figure: key } },
      h("td", {}, label(key, text)), h("td", {}, fmt(cal.predicted[key])), h("td", {}, fmt(cal.measured[key])),
      h("td", {}, cal.ratios[key] != null ? `×${cal.ratios[key].toFixed(3)}` : "–")))));
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
