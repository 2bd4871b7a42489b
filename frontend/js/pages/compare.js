// Compare page (#/compare?ids=1,2): runs overlaid on the same axes (VRAM, step time, loss,
// spill), a summary table and the config diff (the fields that differ, and the live limits a
// run changed while it ran: the config's value, then "→ new at step N" per change).
// Runs of different lengths share one step range on every chart (zoom one, the others follow);
// the summary gives each figure's change against the first run, and the loss at the last step
// every run reached. Runs are added and removed here (the ids in the URL change); an id that
// no longer exists is named in a notice and the others compared.

import { api } from "../api.js";
import { LiveChart } from "../charts.js";
import { groupSamples, samplePrompt, stepText } from "../samples.js";
import { fill, fmtBytes, fmtMB, fmtMs, fmtNum, h, showError, statusBadge } from "../ui.js";

const MAX_RUNS = 6;

// `hover`: each figure with its unit and the digits that tell.
const METRICS = [
  { id: "vram_peak_mb", chart: "cmp-vram", title: "Peak VRAM per step (MB)", y: "MB", scale: 1, hover: "%{y:,.1f} MB" },
  { id: "step_time_ms", chart: "cmp-step", title: "Step time (ms)", y: "ms", scale: 1, hover: "%{y:,.1f} ms" },
  { id: "loss", chart: "cmp-loss", title: "Loss", y: "loss", scale: 1, hover: "%{y:.4f}" },
  { id: "spill_bytes", chart: "cmp-spill", title: "Activation spill per step (MB)", y: "MB", scale: 1 / 2 ** 20, hover: "%{y:,.1f} MB" },
];
const PALETTE = ["#1f5fa8", "#e08a1e", "#2e9e5b", "#b4235a", "#6b4fbb", "#17a2b8"];

/** A config value, then each live change: "1 → 2 at step 8". */
function fmtDiffCell(value, changes) {
  const cell = [fmtValue(value)];
  for (const [step, now] of changes || []) cell.push(h("span", { class: "live-change" }, ` → ${fmtValue(now)} at step ${step ?? "?"}`));
  return cell;
}

/** `value` against the baseline's as a signed percentage ("+12.5%"), or null when either is
 * missing or the baseline is 0. */
export function pctDelta(value, base) {
  if (typeof value !== "number" || typeof base !== "number" || base === 0) return null;
  const pct = (100 * (value - base)) / Math.abs(base);
  const shown = Math.abs(pct).toFixed(1);
  return `${pct >= 0 || Number(shown) === 0 ? "+" : "−"}${shown}%`; // no "−0.0%"
}

/** A config path that wraps only between its segments ("memory.stagehand.x" breaks after a
 * dot, never inside a name). */
function pathCell(path) {
  const parts = path.split(".");
  return h("code", { class: "diff-path" }, parts.flatMap((p, i) => [
    h("span", { class: "seg" }, i < parts.length - 1 ? `${p}.` : p), i < parts.length - 1 ? h("wbr") : null,
  ]));
}

function fmtValue(v) {
  if (v === undefined) return h("span", { class: "muted" }, "(unset)");
  if (v === null) return "null";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

export function mount(root, { params }) {
  const ids = [...new Set((params.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean))];
  const errors = h("div", { class: "page-errors" });
  const runsBar = h("div", { class: "toolbar compare-runs", id: "compare-runs" });
  const card = h("section", { class: "card" }, h("div", { class: "toolbar" }, h("h1", {}, "Compare runs")), errors, runsBar);
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
    const missing = result.missing || [];
    if (missing.length) {
      errors.after(h("div", { class: "banner warn", id: "compare-missing", role: "status" },
        `No run with id ${missing.map((id) => `#${id}`).join(", ")} (deleted?): `
        + `comparing the other${runs.length === 1 ? "" : "s"}.`));
    }
    runsToolbar(runs, nameOf);

    // One step range for every chart: the first and the last step any run reached.
    const allSteps = METRICS.flatMap((m) => runIds.flatMap((id) => (((result.series || {})[m.id] || {})[id] || []).map((p) => p[0])));
    const range = allSteps.length ? [Math.min(...allSteps), Math.max(...allSteps)] : null;
    const lastSteps = runIds.map((id) => ((result.series || {}).loss?.[id] || []).reduce((a, p) => Math.max(a, p[0]), -Infinity));
    const common = lastSteps.length && lastSteps.every(Number.isFinite) ? Math.min(...lastSteps) : null;

    for (const metric of METRICS) {
      const div = h("div", { id: metric.chart, class: "chart" });
      grid.append(h("div", { class: "chart-panel" }, div));
      const series = (result.series || {})[metric.id] || {};
      const chart = new LiveChart(div, {
        title: metric.title,
        traces: runIds.map((id, i) => ({ name: nameOf.get(id), line: { color: PALETTE[i % PALETTE.length], width: 1.5 }, hovertemplate: metric.hover })),
        layout: { xaxis: { title: { text: "step" } }, yaxis: { title: { text: metric.y } } },
        wholeX: true,
      });
      runIds.forEach((id, i) => {
        const points = series[id] || [];
        chart.setSeries(i, points.map((p) => p[0]), points.map((p) => p[1] * metric.scale));
      });
      if (range && range[1] > range[0]) chart.setWindow(() => range);
      for (const other of charts) chart.link(other);
      chart.flush();
      charts.push(chart);
    }
    if (range && new Set(lastSteps).size > 1) {
      grid.before(h("p", { class: "muted", id: "compare-range" },
        `Runs of ${lastSteps.map((n) => (Number.isFinite(n) ? n : 0)).join(", ")} steps: every chart shows steps ${range[0]}–${range[1]}; `
        + `drag to zoom (all charts follow), double-click to return.`));
    }

    const rows = result.summary || [];
    const byId = new Map(runs.map((r) => [String(r.id), r]));
    // The loss each run had at the last step all of them reached (final losses of runs of
    // different lengths are not comparable).
    const lossAt = (id) => (((result.series || {}).loss || {})[id] || []).find((p) => p[0] === common)?.[1] ?? null;
    const figures = [
      { label: "peak VRAM", key: "peak_vram_mb", fmt: fmtMB },
      { label: "mean step", key: "mean_step_time_ms", fmt: fmtMs },
      { label: "spill", key: "spill_bytes", fmt: fmtBytes },
      { label: "stall", key: "stall_ms", fmt: fmtMs },
      { label: "final loss", key: "final_loss", fmt: fmtNum },
      // Out-of-memory recoveries (the run lowered its limits and ran the step again): a count, no
      // percentage against the first run's.
      { label: "OOM recoveries", key: "recoveries", fmt: (v) => (v == null ? "–" : String(v)), count: true },
      ...(common !== null ? [{ label: `loss at step ${common}`, key: "loss_at", fmt: fmtNum }] : []),
    ];
    const valueOf = (s, key) => (key === "loss_at" ? lossAt(String(s.run_id)) : s[key]);
    const base = rows[0];
    fill(summary, h("table", { class: "runs-table" },
      h("thead", {}, h("tr", {}, ["run", "preset", "status", "steps", ...figures.map((f) => f.label)].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.map((s, i) => {
        const r = byId.get(String(s.run_id)) || {};
        return h("tr", { "data-run-id": s.run_id },
          h("td", {}, h("a", { href: `#/runs/${s.run_id}` }, nameOf.get(String(s.run_id)) || s.run_id)),
          h("td", {}, r.preset || "–"),
          h("td", {}, r.status ? statusBadge(r.status) : "–"),
          h("td", { class: "num" }, `${s.steps_done ?? "–"}/${s.max_steps ?? "?"}`),
          figures.map((f) => {
            const delta = i > 0 && !f.count ? pctDelta(valueOf(s, f.key), valueOf(base, f.key)) : null;
            return h("td", { class: "num", dataset: { figure: f.key } }, f.fmt(valueOf(s, f.key)),
              delta ? h("span", { class: "delta", title: `against ${nameOf.get(String(base.run_id))}` }, ` (${delta})`) : null);
          }));
      }))),
    rows.length > 1 ? h("p", { class: "muted" }, `Changes in brackets are against the first run, ${nameOf.get(String(base.run_id))}.`) : null);

    loadSamples(runs, nameOf);

    const entries = result.config_diff || [];
    fill(diff, entries.length
      ? h("table", { class: "diff-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "field"), runIds.map((id) => h("th", {}, nameOf.get(id))))),
        h("tbody", {}, entries.map((d) => h("tr", { "data-path": d.path },
          h("td", { class: "path" }, pathCell(d.path)),
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
    // Each image under the prompt it was drawn from, as the run page labels them: side by side,
    // runs with other prompts would read as the same picture.
    const prompts = runs.map((r) => r.config?.samples?.prompts || []);
    const steps = [...new Set(byRun.flatMap(([, g]) => [...g.keys()]))].sort((a, b) => a - b);
    if (!steps.length) return;
    const slider = h("input", { type: "range", id: "compare-sample-step", min: "0", max: String(steps.length - 1), step: "1", value: String(steps.length - 1) });
    const label = h("span", { id: "compare-sample-label", class: "muted" });
    const rows = h("div", { id: "compare-sample-rows" });
    const show = () => {
      const step = steps[Number(slider.value)];
      label.textContent = `${stepText(step)} · ${Number(slider.value) + 1} of ${steps.length}`;
      fill(rows, byRun.map(([r, groups], i) => {
        const names = groups.get(step) || [];
        return h("div", { class: "compare-sample-row", dataset: { runId: String(r.id) } },
          h("h3", {}, nameOf.get(String(r.id))),
          names.length
            ? h("div", { class: "gallery" }, names.map((name) => {
              const url = api.artifactUrl(r.id, name);
              const prompt = samplePrompt(name, prompts[i]);
              return h("figure", {},
                h("a", { href: url, target: "_blank" }, h("img", { src: url, alt: `${prompt || name}, ${stepText(step)}`, loading: "lazy" })),
                h("figcaption", {}, prompt || name));
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

  /** The compared runs with a remove button each, and a list to add another. */
  function runsToolbar(runs, nameOf) {
    const go = (list) => { location.hash = `#/compare?ids=${list.join(",")}`; };
    const shown = runs.map((r) => String(r.id));
    const add = h("select", { id: "compare-add", "aria-label": "add a run", disabled: shown.length >= MAX_RUNS, onchange: () => {
      if (add.value) go([...shown, add.value]);
    } }, h("option", { value: "" }, shown.length >= MAX_RUNS ? `at most ${MAX_RUNS} runs` : "add a run…"));
    fill(runsBar, ...runs.map((r) => h("span", { class: "run-chip", dataset: { runId: String(r.id) } },
      nameOf.get(String(r.id)),
      h("button", { class: "small remove-run", title: `remove ${nameOf.get(String(r.id))} from the comparison`,
        "aria-label": `remove run ${r.id}`, onclick: () => go(shown.filter((id) => id !== String(r.id))) }, "×"))), add);
    api.runs({}).then((res) => {
      for (const r of res.data || []) {
        if (!shown.includes(String(r.id))) add.append(h("option", { value: r.id }, `#${r.id} ${r.name} (${r.status})`));
      }
    }).catch((err) => showError(errors, err, "loading runs"));
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
