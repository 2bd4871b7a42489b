// Tunes (#/tunes) and one tune's result (#/tunes/ID): its trials (ordinary runs of one group)
// with their limits, predicted and measured peak VRAM and step time; a chart of step time against
// peak VRAM for every trial, predicted and measured, the measured Pareto front marked and the
// budget drawn; Cancel for the whole group while trials are queued or running; "Save as preset"
// for the chosen trial. Refreshed every 2 s while trials are active.

import { FINISHED, api } from "../api.js";
import { BASE_LAYOUT, PLOT_CONFIG, legendFit } from "../charts.js";
import { fill, fmtMB, fmtMs, fmtTime, h, showError, statusBadge } from "../ui.js";

// A GPU profile's predictions of a tiny model are fractions of a millisecond, and its peaks a
// few MB that differ in the second decimal (1.03 MB is not the budget of 1 MB).
const fmtStep = (ms) => (ms != null && ms < 1 ? `${ms.toPrecision(2)} ms` : fmtMs(ms));
const fmtPeak = (mb) => (mb != null && Math.abs(mb) < 10 ? `${mb.toFixed(2)} MB` : fmtMB(mb));

/** The scatter: measured trials (Pareto ones larger, joined by the front's line), predicted
 * ones as open diamonds joined to their measured point, and the budget. */
function drawChart(el, tune) {
  const trials = tune.trials;
  const done = trials.filter((t) => t.measured && t.measured.step_ms != null && t.measured.peak_mb != null);
  const front = done.filter((t) => t.pareto).sort((a, b) => a.measured.peak_mb - b.measured.peak_mb);
  const label = (t) => `${t.label} (run #${t.run_id})`;
  const data = [
    {
      x: trials.map((t) => t.predicted.peak_mb), y: trials.map((t) => t.predicted.step_ms),
      text: trials.map(label), mode: "markers", name: "predicted",
      marker: { symbol: "diamond-open", size: 10, color: "#e08a1e" },
    },
    {
      x: done.map((t) => t.measured.peak_mb), y: done.map((t) => t.measured.step_ms),
      text: done.map(label), mode: el.clientWidth > 600 ? "markers+text" : "markers", textposition: "top center", name: "measured",
      marker: { size: done.map((t) => (t.pareto ? 13 : 8)), color: done.map((t) => (t.pareto ? "#1f5fa8" : "#9aa5b1")) },
    },
    {
      x: front.map((t) => t.measured.peak_mb), y: front.map((t) => t.measured.step_ms),
      mode: "lines", name: "Pareto front (measured)", line: { color: "#1f5fa8", dash: "dash", shape: "hv" },
    },
  ];
  for (const t of done) {
    data.push({
      x: [t.predicted.peak_mb, t.measured.peak_mb], y: [t.predicted.step_ms, t.measured.step_ms],
      mode: "lines", showlegend: false, hoverinfo: "skip", line: { color: "#d5dbe3", width: 1 },
    });
  }
  const ys = [...trials.map((t) => t.predicted.step_ms), ...done.map((t) => t.measured.step_ms)].filter((v) => v > 0);
  const log = ys.length && Math.max(...ys) / Math.min(...ys) > 50;
  const layout = {
    ...BASE_LAYOUT,
    ...legendFit(el.clientWidth, 3),
    height: 380,
    title: { text: "Step time against peak VRAM", font: { size: 13 } },
    xaxis: { ...BASE_LAYOUT.xaxis, title: { text: "peak VRAM (MB)" } },
    // Not from zero: trials differ by a few percent.
    yaxis: { ...BASE_LAYOUT.yaxis, title: { text: "step time (ms)" }, type: log ? "log" : "linear", rangemode: "normal" },
    shapes: [{ type: "line", xref: "x", yref: "paper", x0: tune.budget_mb, x1: tune.budget_mb, y0: 0, y1: 1, line: { color: "#d3262f", dash: "dot", width: 1 } }],
    annotations: [{ x: tune.budget_mb, y: 1, xref: "x", yref: "paper", text: "budget", showarrow: false, font: { color: "#d3262f", size: 11 }, yanchor: "bottom" }],
    hovermode: "closest",
  };
  if (window.Plotly) window.Plotly.react(el, data, layout, PLOT_CONFIG);
}

function listPage(root) {
  const errors = h("div", { class: "page-errors" });
  const body = h("div", { id: "tunes-list" }, "loading tunes…");
  root.append(h("section", { class: "card" }, h("h1", {}, "Tunes"),
    h("p", { class: "muted" }, "Start one from New run: pick a preset, give a VRAM budget, press Tune."), errors, body));
  (async () => {
    try {
      const { data } = await api.tunes();
      if (!data.length) return fill(body, h("p", { class: "muted" }, "No tunes yet."));
      fill(body, h("ul", {}, data.map((t) => h("li", {},
        h("a", { href: `#/tunes/${t.id}` }, `tune #${t.id}`),
        ` ${t.preset} within ${fmtPeak(t.budget_mb)} on ${t.device}, ${t.trials.length} trials`,
        t.active ? ` (${t.active} active)` : "", ` · ${fmtTime(t.created_at)}`))));
    } catch (err) {
      fill(body);
      showError(errors, err, "tunes");
    }
  })();
}

export function mount(root, { parts }) {
  if (!parts[1]) return listPage(root);
  const tuneId = parts[1];
  const errors = h("div", { class: "page-errors" });
  const header = h("section", { class: "card", id: "tune-header" }, "loading tune…");
  const chart = h("div", { class: "chart", id: "tune-chart" });
  const tableBox = h("div", { class: "table-wrap", id: "tune-trials" });
  root.append(header, errors, h("section", { class: "card" }, chart), h("section", { class: "card" }, h("h2", {}, "Trials"), tableBox));
  let timer = null;
  let stopped = false;
  const names = new Map(); // run id -> the preset name typed (kept across refreshes)

  function renderHeader(tune) {
    const ids = tune.trials.map((t) => t.run_id).filter(Boolean);
    const cancel = tune.active
      ? h("button", { class: "danger", id: "cancel-tune", onclick: async () => {
        try {
          render(await api.cancelTune(tune.id));
        } catch (err) {
          showError(errors, err, "cancel tune");
        }
      } }, `Cancel ${tune.active} active trial${tune.active === 1 ? "" : "s"}`)
      : null;
    const best = tune.trials.find((t) => t.run_id === tune.best_run_id);
    const own = tune.trials.filter((t) => t.preset && t.measured);
    const drift = own.length === 2
      ? h("p", { class: "muted", id: "tune-drift" }, `The preset's own limits, run first and last: ${fmtMs(own[0].measured.step_ms)} and ${fmtMs(own[1].measured.step_ms)} (the machine's drift while the trials ran).`)
      : null;
    fill(header,
      h("div", { class: "toolbar" }, h("h1", {}, `Tune #${tune.id}: ${tune.preset} within ${fmtPeak(tune.budget_mb)}`),
        h("div", { class: "spacer" }), cancel,
        ids.length > 1 ? h("a", { class: "button", id: "compare-trials", href: `#/compare?ids=${ids.join(",")}` }, "Compare trials") : null),
      h("p", {}, `Planned on ${tune.device}: ${tune.searched} candidates simulated, ${tune.feasible} predicted to fit${tune.distinct ? ` (${tune.distinct} distinct predictions)` : ""}; the smallest feasible peak is ${fmtPeak(tune.min_peak_mb)}. Each trial runs ${tune.trial_steps} steps after its trace step; measured step time is their mean.`),
      tune.calibration_run_ids.length ? h("p", { class: "muted", id: "tune-calibration" }, `Predictions calibrated by ${tune.calibration_run_ids.length > 1 ? "the median of runs" : "run"} ${tune.calibration_run_ids.map((id) => `#${id}`).join(", ")}.`) : null,
      h("p", { id: "tune-best" }, best
        ? `Fastest within the budget (measured): ${best.label}, run #${best.run_id}: ${fmtMs(best.measured.step_ms)} at ${fmtPeak(best.measured.peak_mb)}.`
        : tune.active ? "Trials are running…" : "No trial succeeded within the budget."),
      drift,
      h("p", { class: "muted" }, `Not tuned: ${Object.entries(tune.not_tuned || {}).map(([k, why]) => `${k} (${why})`).join("; ")}.`));
  }

  function saveCell(tune, t) {
    if (t.status !== "succeeded") return h("td", {}, "");
    const input = h("input", { type: "text", class: "preset-name", placeholder: "new preset name", value: names.get(t.run_id) || `${tune.preset}-tuned-${t.label}` });
    input.addEventListener("input", () => names.set(t.run_id, input.value));
    const btn = h("button", { class: "save-preset", onclick: async () => {
      try {
        const saved = await api.saveTunePreset(tune.id, { run_id: t.run_id, name: input.value.trim() });
        btn.replaceWith(h("a", { class: "saved", href: `#/new?preset=${encodeURIComponent(saved.name)}` }, `saved as ${saved.name}`));
      } catch (err) {
        showError(errors, err, "save as preset");
      }
    } }, "Save as preset");
    return h("td", { class: "actions" }, input, btn);
  }

  function renderTable(tune) {
    const head = ["trial", "run", "status", "limits", "predicted peak", "predicted step", "measured peak", "measured step", "loads / step pred / meas", "Pareto", ""];
    fill(tableBox, h("table", { class: "runs-table", id: "tune-table" },
      h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))),
      h("tbody", {}, tune.trials.map((t) => h("tr", { dataset: { runId: String(t.run_id), pareto: String(t.pareto), label: t.label } },
        h("td", { class: "trial" }, h("strong", {}, t.preset ? `${t.label} (preset's own)` : t.label)),
        h("td", { "data-label": "run" }, t.run_id ? h("a", { href: `#/runs/${t.run_id}` }, `#${t.run_id}`) : "–"),
        h("td", { "data-label": "status" }, statusBadge(t.status)),
        h("td", { class: "limits" }, t.limits_text),
        h("td", { class: "num", "data-label": "predicted peak" }, fmtPeak(t.predicted.peak_mb)),
        h("td", { class: "num", "data-label": "predicted step" }, fmtStep(t.predicted.step_ms)),
        h("td", { class: "num", "data-label": "measured peak" }, t.measured ? fmtPeak(t.measured.peak_mb) : "–"),
        h("td", { class: "num", "data-label": "measured step" }, t.measured ? fmtMs(t.measured.step_ms) : "–"),
        h("td", { class: "num", "data-label": "block loads per step (predicted / measured)" },
          `${t.predicted.blocks_loaded ?? "–"} / ${t.measured?.blocks_loaded ?? "–"}`),
        h("td", { class: "pareto", "data-label": "Pareto" }, t.pareto ? "★ front" : "–"),
        saveCell(tune, t))))));
  }

  function render(tune) {
    renderHeader(tune);
    renderTable(tune);
    drawChart(chart, tune);
    root.dataset.active = String(tune.active);
    root.dataset.trialsDone = String(tune.trials.filter((t) => FINISHED.has(t.status)).length);
  }

  async function refresh() {
    try {
      const tune = await api.tune(tuneId);
      if (stopped) return;
      render(tune);
      if (tune.active) timer = setTimeout(refresh, 2000);
    } catch (err) {
      fill(header);
      showError(errors, err, `tune ${tuneId}`);
    }
  }
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
    if (window.Plotly) window.Plotly.purge(chart);
  };
}
