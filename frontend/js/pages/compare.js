// Compare page (#/compare?ids=1,2): runs overlaid on the same axes (VRAM, step time, loss,
// spill), a summary table and the config diff (the fields that differ, and the live limits a
// run changed while it ran: the config's value, then "→ new at step N" per change).

import { api } from "../api.js";
import { LiveChart } from "../charts.js";
import { groupSamples, stepText } from "../samples.js";
import { fill, fmtBytes, fmtMB, fmtMs, fmtNum, h, showError, statusBadge } from "../ui.js";

const METRICS = [
  { id: "vram_peak_mb", chart: "cmp-vram", title: "Peak VRAM per step (MB)", y: "MB", scale: 1 },
  { id: "step_time_ms", chart: "cmp-step", title: "Step time (ms)", y: "ms", scale: 1 },
  { id: "loss", chart: "cmp-loss", title: "Loss", y: "loss", scale: 1 },
  { id: "spill_bytes", chart: "cmp-spill", title: "Activation spill per step (MB)", y: "MB", scale: 1 / 2 ** 20 },
];
const PALETTE = ["#1f5fa8", "#e08a1e", "#2e9e5b", "#b4235a", "#6b4fbb", "#17a2b8"];

/** A config value, then each live change: "1 → 2 at step 8". */
function fmtDiffCell(value, changes) {
  const cell = [fmtValue(value)];
  for (const [step, now] of changes || []) cell.push(h("span", { class: "live-change" }, ` → ${fmtValue(now)} at step ${step ?? "?"}`));
  return cell;
}

function fmtValue(v) {
  if (v === undefined) return h("span", { class: "muted" }, "(unset)");
  if (v === null) return "null";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

export function mount(root, { params }) {
  const ids = (params.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean);
  const errors = h("div", { class: "page-errors" });
  const card = h("section", { class: "card" }, h("div", { class: "toolbar" }, h("h1", {}, "Compare runs")), errors);
  root.append(card);
  const charts = [];

  if (ids.length < 2) {
    card.append(picker(ids));
    return () => {};
  }

  const grid = h("div", { class: "chart-grid", id: "compare-charts" });
  const summary = h("div", { class: "table-wrap", id: "compare-summary" });
  const diff = h("div", { class: "table-wrap", id: "config-diff" });
  const samplesCard = h("section", { class: "card", id: "compare-samples", hidden: true });
  root.append(grid,
    h("section", { class: "card" }, h("h2", {}, "Summary"), summary),
    samplesCard,
    h("section", { class: "card" }, h("h2", {}, "Config diff (fields that differ or changed during a run)"), diff));

  (async () => {
    let result;
    try {
      result = await api.compare(ids, METRICS.map((m) => m.id));
    } catch (err) {
      showError(errors, err, "compare");
      return;
    }
    const runs = result.runs || [];
    const nameOf = new Map(runs.map((r) => [String(r.id), `${r.name || `run ${r.id}`} (#${r.id})`]));
    card.querySelector("h1").textContent = `Compare ${runs.map((r) => `#${r.id}`).join(", ")}`;
    const runIds = runs.map((r) => String(r.id));

    for (const metric of METRICS) {
      const div = h("div", { id: metric.chart, class: "chart" });
      grid.append(h("div", { class: "chart-panel" }, div));
      const series = (result.series || {})[metric.id] || {};
      const chart = new LiveChart(div, {
        title: metric.title,
        traces: runIds.map((id, i) => ({ name: nameOf.get(id), line: { color: PALETTE[i % PALETTE.length], width: 1.5 } })),
        layout: { xaxis: { title: { text: "step" } }, yaxis: { title: { text: metric.y } } },
      });
      // Whole steps only: a short run would otherwise get ticks at 1.5, 2.5.
      const lastStep = Math.max(1, ...runIds.flatMap((id) => (series[id] || []).map((p) => p[0])));
      if (lastStep < 20) chart.layout.xaxis = { ...chart.layout.xaxis, tick0: 0, dtick: Math.ceil(lastStep / 8) };
      runIds.forEach((id, i) => {
        const points = series[id] || [];
        chart.setSeries(i, points.map((p) => p[0]), points.map((p) => p[1] * metric.scale));
      });
      chart.flush();
      charts.push(chart);
    }

    const rows = result.summary || [];
    const byId = new Map(runs.map((r) => [String(r.id), r]));
    fill(summary, h("table", { class: "runs-table" },
      h("thead", {}, h("tr", {}, ["run", "preset", "status", "steps", "peak VRAM", "mean step", "spill", "stall", "final loss"].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.map((s) => {
        const r = byId.get(String(s.run_id)) || {};
        return h("tr", { "data-run-id": s.run_id },
          h("td", {}, h("a", { href: `#/runs/${s.run_id}` }, nameOf.get(String(s.run_id)) || s.run_id)),
          h("td", {}, r.preset || "–"),
          h("td", {}, r.status ? statusBadge(r.status) : "–"),
          h("td", { class: "num" }, `${s.steps_done ?? "–"}/${s.max_steps ?? "?"}`),
          h("td", { class: "num" }, fmtMB(s.peak_vram_mb)),
          h("td", { class: "num" }, fmtMs(s.mean_step_time_ms)),
          h("td", { class: "num" }, fmtBytes(s.spill_bytes)),
          h("td", { class: "num" }, fmtMs(s.stall_ms)),
          h("td", { class: "num" }, fmtNum(s.final_loss)));
      }))));

    loadSamples(runs, nameOf);

    const entries = result.config_diff || [];
    fill(diff, entries.length
      ? h("table", { class: "diff-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "field"), runIds.map((id) => h("th", {}, nameOf.get(id))))),
        h("tbody", {}, entries.map((d) => h("tr", { "data-path": d.path },
          h("td", {}, h("code", {}, d.path)),
          runIds.map((id) => h("td", {}, fmtDiffCell((d.values || {})[id], (d.live || {})[id])))))))
      : h("p", { class: "muted" }, "The configs are identical."));
  })();

  /** The runs' samples side by side at one step, chosen with a slider over every sampled step
   * (a run without samples at that step says so). */
  async function loadSamples(runs, nameOf) {
    let lists;
    try {
      lists = await Promise.all(runs.map((r) => api.artifacts(r.id)));
    } catch (err) {
      showError(errors, err, "samples");
      return;
    }
    const byRun = runs.map((r, i) => [r, groupSamples((lists[i].data || []).map((a) => a.name))]);
    const steps = [...new Set(byRun.flatMap(([, g]) => [...g.keys()]))].sort((a, b) => a - b);
    if (!steps.length) return;
    const slider = h("input", { type: "range", id: "compare-sample-step", min: "0", max: String(steps.length - 1), step: "1", value: String(steps.length - 1) });
    const label = h("span", { id: "compare-sample-label", class: "muted" });
    const rows = h("div", { id: "compare-sample-rows" });
    const show = () => {
      const step = steps[Number(slider.value)];
      label.textContent = `${stepText(step)} · ${Number(slider.value) + 1} of ${steps.length}`;
      fill(rows, byRun.map(([r, groups]) => {
        const names = groups.get(step) || [];
        return h("div", { class: "compare-sample-row", dataset: { runId: String(r.id) } },
          h("h3", {}, nameOf.get(String(r.id))),
          names.length
            ? h("div", { class: "gallery" }, names.map((name) => {
              const url = api.artifactUrl(r.id, name);
              return h("figure", {}, h("a", { href: url, target: "_blank" }, h("img", { src: url, alt: name, loading: "lazy" })));
            }))
            : h("p", { class: "muted" }, `no samples at ${stepText(step)}`));
      }));
    };
    slider.addEventListener("input", show);
    fill(samplesCard, h("h2", {}, "Samples"),
      h("div", { class: "sample-controls" }, h("label", { for: "compare-sample-step" }, "step"), slider, label), rows);
    samplesCard.hidden = false;
    show();
  }

  return () => { for (const c of charts) c.purge(); };
}

/** Without ids: pick runs here (same as selecting them on the Runs page). */
function picker(preselected) {
  const box = h("div", {}, h("p", { class: "muted" }, "Pick 2–6 runs (or select them on the Runs page)."));
  const list = h("div", { class: "picker" });
  const go = h("button", { class: "primary", disabled: true, onclick: () => {
    const chosen = [...list.querySelectorAll("input:checked")].map((i) => i.value);
    location.hash = `#/compare?ids=${chosen.join(",")}`;
  } }, "Compare");
  box.append(list, go);
  api.runs({}).then((res) => {
    for (const r of res.data || []) {
      const cb = h("input", { type: "checkbox", value: r.id, checked: preselected.includes(String(r.id)), onchange: () => {
        const n = list.querySelectorAll("input:checked").length;
        go.disabled = n < 2 || n > 6;
      } });
      list.append(h("label", { class: "pick" }, cb, ` #${r.id} ${r.name} `, statusBadge(r.status), ` ${r.preset}`));
    }
  }).catch((err) => showError(box, err, "loading runs"));
  return box;
}
