// What each chart of the live view draws: its traces, colours and axes. How the telemetry
// records feed them, the window and the markers are runcharts.js's.

import { LiveChart } from "./charts.js";
import { ResidencyMap } from "./residency.js";

export const EMA = 0.9; // loss smoothing by default, as TensorBoard's slider

const COLORS = {
  allocated: "#1f5fa8", reserved: "#7fb3e6", high: "#d3262f", low: "#e08a1e",
  rss: "#6b4fbb", pinned: "#2e9e5b", pool: "#a3d9b8",
  forward: "#1f5fa8", backward: "#e08a1e", optimizer: "#2e9e5b", step: "#1d2733",
  loss: "#a9b8c9", smooth: "#1f5fa8", grad: "#b4235a",
};

/** Chart ids, in page order (the tests read `document.getElementById(id).data`). */
export const CHART_IDS = ["vram", "residency", "transfers", "host", "spill", "spill-pool", "phases", "loss", "conductor"];

function stepAxis() {
  return { title: { text: "step" } };
}

// Hover figures with their unit and the digits that tell (Plotly's own would print
// "129.4998" and "11.54266k"); the VRAM lines add what the record was (block, event).
const HOVER = {
  vram: "%{y:,.1f} MB%{text}", mb: "%{y:,.0f} MB", mbFine: "%{y:,.1f} MB", gb: "%{y:.2f} GB",
  ms: "%{y:,.1f} ms", count: "%{y:,.0f}", pct: "%{y:.1f}%", loss: "%{y:.4f}", norm: "%{y:.3f}",
};
// Step charts: ticks on whole steps (ChartPanel wholeX).
const STEPS = { wholeX: true };

/**
 * The live view's charts, one per id of CHART_IDS, each in its `divs[id]`, all `width` px wide.
 * @returns {object} id -> LiveChart (ResidencyMap for "residency")
 */
export function buildRunCharts(divs, width) {
  return {
    vram: new LiveChart(divs.vram, {
      title: "VRAM (MB)",
      width,
      traces: [
        { name: "allocated", line: { color: COLORS.allocated, width: 1.5 }, text: [], hovertemplate: HOVER.vram },
        { name: "reserved (CUDA)", line: { color: COLORS.reserved, width: 1.5 }, text: [], hovertemplate: HOVER.vram },
        // A watermark is in force until the next record changes it: drawn to the newest point.
        { name: "high watermark", line: { color: COLORS.high, dash: "dot", width: 1, shape: "hv" }, hovertemplate: HOVER.mb, holdToEnd: true },
        { name: "low watermark", line: { color: COLORS.low, dash: "dot", width: 1, shape: "hv" }, hovertemplate: HOVER.mb, holdToEnd: true },
      ],
      layout: { xaxis: { title: { text: "time since start (s)" } }, yaxis: { title: { text: "MB" } } },
    }),
    residency: new ResidencyMap(divs.residency, { title: "Block residency (on device over time)", width }),
    transfers: new LiveChart(divs.transfers, {
      title: "Weights moved per step (H2D)",
      width,
      ...STEPS,
      traces: [
        { name: "H2D (GB)", type: "bar", marker: { color: "#7fb3e6" }, hovertemplate: HOVER.gb },
        { name: "block loads", yaxis: "y2", mode: "lines+markers", line: { color: "#1f5fa8", width: 1.5 }, marker: { size: 4 }, hovertemplate: HOVER.count },
        { name: "resident blocks", yaxis: "y2", mode: "lines", line: { color: "#2e9e5b", dash: "dash" }, hovertemplate: HOVER.count },
        { name: "prefetch misses", yaxis: "y2", mode: "lines+markers", line: { color: "#d9480f", width: 1 }, marker: { size: 4, symbol: "x" }, hovertemplate: HOVER.count },
        { name: "host waits", yaxis: "y2", mode: "lines", line: { color: "#e08a1e", width: 1, dash: "dot" }, hovertemplate: HOVER.count },
        { name: "copy waits (use before its copy ended)", yaxis: "y2", mode: "lines+markers", line: { color: "#8e44ad", width: 1 }, marker: { size: 4, symbol: "triangle-up" }, hovertemplate: HOVER.count },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "GB (1e9 B)" }, rangemode: "tozero" }, yaxis2: { title: { text: "blocks" }, rangemode: "tozero" } },
    }),
    host: new LiveChart(divs.host, {
      title: "Host memory (MB)",
      width,
      ...STEPS,
      traces: [
        { name: "process RSS", line: { color: COLORS.rss }, hovertemplate: HOVER.mb },
        { name: "pinned (trainer)", line: { color: COLORS.pinned }, hovertemplate: HOVER.mb },
        { name: "weight pool used", line: { color: COLORS.pool, dash: "dash" }, hovertemplate: HOVER.mb },
        { name: "weight pool total", line: { color: "#9aa5b1", dash: "dot", width: 1 }, hovertemplate: HOVER.mb },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "MB" } } },
    }),
    spill: new LiveChart(divs.spill, {
      title: "Activation spill per step",
      width,
      ...STEPS,
      traces: [
        { name: "kept (count)", type: "bar", marker: { color: "#7fb3e6" }, hovertemplate: HOVER.count },
        { name: "spilled (count)", type: "bar", marker: { color: "#e08a1e" }, hovertemplate: HOVER.count },
        { name: "spill MB", yaxis: "y2", mode: "lines+markers", line: { color: "#b4235a" }, hovertemplate: HOVER.mbFine },
        { name: "restore MB", yaxis: "y2", mode: "lines+markers", line: { color: "#2e9e5b", dash: "dash" }, hovertemplate: HOVER.mbFine },
      ],
      layout: { barmode: "relative", xaxis: stepAxis(), yaxis: { title: { text: "saved tensors" } }, yaxis2: { title: { text: "MB" } } },
    }),
    "spill-pool": new LiveChart(divs["spill-pool"], {
      title: "Spill pool hit rate and stalls",
      width,
      ...STEPS,
      traces: [
        { name: "pool hit rate (%)", mode: "lines+markers", line: { color: "#2e9e5b" }, hovertemplate: HOVER.pct },
        { name: "stall (ms)", yaxis: "y2", type: "bar", marker: { color: "#d3262f", opacity: 0.6 }, hovertemplate: HOVER.ms },
        { name: "weight stall (ms)", yaxis: "y2", mode: "lines", line: { color: "#6b4fbb", dash: "dot" }, hovertemplate: HOVER.ms },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "%" }, range: [0, 105] }, yaxis2: { title: { text: "ms" }, rangemode: "tozero" } },
    }),
    phases: new LiveChart(divs.phases, {
      title: "Phase timings per step (ms)",
      width,
      ...STEPS,
      traces: [
        { name: "forward", type: "bar", marker: { color: COLORS.forward }, hovertemplate: HOVER.ms },
        { name: "backward", type: "bar", marker: { color: COLORS.backward }, hovertemplate: HOVER.ms },
        { name: "optimizer", type: "bar", marker: { color: COLORS.optimizer }, hovertemplate: HOVER.ms },
        { name: "step time", mode: "lines+markers", line: { color: COLORS.step, width: 1.5 }, marker: { size: 4 }, hovertemplate: HOVER.ms },
      ],
      layout: { barmode: "stack", xaxis: stepAxis(), yaxis: { title: { text: "ms" } } },
    }),
    loss: new LiveChart(divs.loss, {
      title: "Loss and grad norm",
      width,
      ...STEPS,
      traces: [
        { name: "loss", mode: "lines+markers", line: { color: COLORS.loss, width: 1 }, marker: { size: 3 }, hovertemplate: HOVER.loss },
        { name: `loss (EMA ${EMA})`, line: { color: COLORS.smooth, width: 2 }, hovertemplate: HOVER.loss },
        { name: "grad norm", yaxis: "y2", line: { color: COLORS.grad, width: 1.5 }, hovertemplate: HOVER.norm },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "loss" } }, yaxis2: { title: { text: "grad norm" } } },
    }),
    conductor: new LiveChart(divs.conductor, {
      title: "Conductor grants and transfers per step",
      width,
      ...STEPS,
      traces: [
        { name: "grants", line: { color: "#2e9e5b" }, hovertemplate: HOVER.count },
        { name: "partials", line: { color: "#e08a1e" }, hovertemplate: HOVER.count },
        { name: "denials", line: { color: "#d3262f" }, hovertemplate: HOVER.count },
        { name: "H2D in flight", yaxis: "y2", line: { color: "#1f5fa8", dash: "dot" }, hovertemplate: HOVER.count },
        { name: "D2H in flight", yaxis: "y2", line: { color: "#6b4fbb", dash: "dot" }, hovertemplate: HOVER.count },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "count" } }, yaxis2: { title: { text: "transfers in flight" } } },
    }),
  };
}
