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

// Hover of the VRAM lines: the figure with its unit, then what the record was (block, event).
const VRAM_HOVER = "%{y:.1f} MB%{text}";

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
        { name: "allocated", line: { color: COLORS.allocated, width: 1.5 }, text: [], hovertemplate: VRAM_HOVER },
        { name: "reserved (CUDA)", line: { color: COLORS.reserved, width: 1.5 }, text: [], hovertemplate: VRAM_HOVER },
        // A watermark is in force until the next record changes it: drawn to the newest point.
        { name: "high watermark", line: { color: COLORS.high, dash: "dot", width: 1, shape: "hv" }, hovertemplate: "%{y} MB", holdToEnd: true },
        { name: "low watermark", line: { color: COLORS.low, dash: "dot", width: 1, shape: "hv" }, hovertemplate: "%{y} MB", holdToEnd: true },
      ],
      layout: { xaxis: { title: { text: "time since start (s)" } }, yaxis: { title: { text: "MB" } } },
    }),
    residency: new ResidencyMap(divs.residency, { title: "Block residency (on device over time)", width }),
    transfers: new LiveChart(divs.transfers, {
      title: "Weights moved per step (H2D)",
      width,
      traces: [
        { name: "H2D (GB)", type: "bar", marker: { color: "#7fb3e6" }, hovertemplate: "%{y:.3f} GB" },
        { name: "block loads", yaxis: "y2", mode: "lines+markers", line: { color: "#1f5fa8", width: 1.5 }, marker: { size: 4 } },
        { name: "resident blocks", yaxis: "y2", mode: "lines", line: { color: "#2e9e5b", dash: "dash" } },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "GB (1e9 B)" }, rangemode: "tozero" }, yaxis2: { title: { text: "blocks" }, rangemode: "tozero" } },
    }),
    host: new LiveChart(divs.host, {
      title: "Host memory (MB)",
      width,
      traces: [
        { name: "process RSS", line: { color: COLORS.rss } },
        { name: "pinned (trainer)", line: { color: COLORS.pinned } },
        { name: "weight pool used", line: { color: COLORS.pool, dash: "dash" } },
        { name: "weight pool total", line: { color: "#9aa5b1", dash: "dot", width: 1 } },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "MB" } } },
    }),
    spill: new LiveChart(divs.spill, {
      title: "Activation spill per step",
      width,
      traces: [
        { name: "kept (count)", type: "bar", marker: { color: "#7fb3e6" } },
        { name: "spilled (count)", type: "bar", marker: { color: "#e08a1e" } },
        { name: "spill MB", yaxis: "y2", mode: "lines+markers", line: { color: "#b4235a" } },
        { name: "restore MB", yaxis: "y2", mode: "lines+markers", line: { color: "#2e9e5b", dash: "dash" } },
      ],
      layout: { barmode: "relative", xaxis: stepAxis(), yaxis: { title: { text: "saved tensors" } }, yaxis2: { title: { text: "MB" } } },
    }),
    "spill-pool": new LiveChart(divs["spill-pool"], {
      title: "Spill pool hit rate and stalls",
      width,
      traces: [
        { name: "pool hit rate (%)", mode: "lines+markers", line: { color: "#2e9e5b" } },
        { name: "stall (ms)", yaxis: "y2", type: "bar", marker: { color: "#d3262f", opacity: 0.6 } },
        { name: "weight stall (ms)", yaxis: "y2", mode: "lines", line: { color: "#6b4fbb", dash: "dot" } },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "%" }, range: [0, 105] }, yaxis2: { title: { text: "ms" }, rangemode: "tozero" } },
    }),
    phases: new LiveChart(divs.phases, {
      title: "Phase timings per step (ms)",
      width,
      traces: [
        { name: "forward", type: "bar", marker: { color: COLORS.forward } },
        { name: "backward", type: "bar", marker: { color: COLORS.backward } },
        { name: "optimizer", type: "bar", marker: { color: COLORS.optimizer } },
        { name: "step time", mode: "lines+markers", line: { color: COLORS.step, width: 1.5 }, marker: { size: 4 } },
      ],
      layout: { barmode: "stack", xaxis: stepAxis(), yaxis: { title: { text: "ms" } } },
    }),
    loss: new LiveChart(divs.loss, {
      title: "Loss and grad norm",
      width,
      traces: [
        { name: "loss", mode: "lines+markers", line: { color: COLORS.loss, width: 1 }, marker: { size: 3 } },
        { name: `loss (EMA ${EMA})`, line: { color: COLORS.smooth, width: 2 } },
        { name: "grad norm", yaxis: "y2", line: { color: COLORS.grad, width: 1.5 } },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "loss" } }, yaxis2: { title: { text: "grad norm" } } },
    }),
    conductor: new LiveChart(divs.conductor, {
      title: "Conductor grants and transfers per step",
      width,
      traces: [
        { name: "grants", line: { color: "#2e9e5b" } },
        { name: "partials", line: { color: "#e08a1e" } },
        { name: "denials", line: { color: "#d3262f" } },
        { name: "H2D in flight", yaxis: "y2", line: { color: "#1f5fa8", dash: "dot" } },
        { name: "D2H in flight", yaxis: "y2", line: { color: "#6b4fbb", dash: "dot" } },
      ],
      layout: { xaxis: stepAxis(), yaxis: { title: { text: "count" } }, yaxis2: { title: { text: "transfers in flight" } } },
    }),
  };
}
