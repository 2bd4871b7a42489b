// The demo-asset build (GET /api/assets): a strip under the system line on every page with a
// progress bar per stage (done/total, elapsed, estimate left), the failed stage and why with a
// Retry button (POST /api/assets/build: it resumes at that stage, keeping what is built), and
// a one-line "ready" once done. Pages subscribe with `onAssets(fn)` (the New run page disables
// Start for the presets that wait for the build).

import { api } from "./api.js";
import { fill, fmtDuration, h, showError } from "./ui.js";

const FAST_MS = 1000; // while building: the bars move every second
const SLOW_MS = 10000; // otherwise: a build started elsewhere (a terminal) still shows

let last = null;
const listeners = new Set();

/** Calls `fn(status)` now (when known) and on every poll; returns the unsubscribe. */
export function onAssets(fn) {
  listeners.add(fn);
  if (last) fn(last);
  return () => listeners.delete(fn);
}

function stageRow(stage) {
  const pct = stage.total ? Math.min(100, (100 * stage.done) / stage.total) : 0;
  let time = null;
  if (stage.kept) time = "already built, kept";
  else if (stage.state === "running")
    time = `elapsed ${fmtDuration(stage.elapsed_s)}${stage.estimate_s == null ? " · time left not known yet" : ` · about ${fmtDuration(stage.estimate_s)} left`}`;
  else if (stage.state === "done") time = `done in ${fmtDuration(stage.elapsed_s)}`;
  else if (stage.state === "pending") time = stage.estimate_s == null ? "waiting" : `estimate ${fmtDuration(stage.estimate_s)}`;
  else time = `${stage.state} after ${fmtDuration(stage.elapsed_s)}`;
  return h("li", { class: "asset-stage", dataset: { stage: stage.name, state: stage.state } },
    h("span", { class: "asset-name" }, stage.name),
    h("span", { class: "asset-bar", role: "progressbar", "aria-valuenow": Math.round(pct), "aria-valuemin": 0, "aria-valuemax": 100 },
      h("span", { class: "asset-fill", style: `width: ${pct.toFixed(1)}%` })),
    h("span", { class: "asset-count" }, `${stage.done}/${stage.total} ${stage.unit}`),
    h("span", { class: "asset-time" }, time));
}

function summary(s) {
  if (s.state === "ready") return "ready: the default preset can start.";
  const meanwhile = "Other presets and pipeline folders can start meanwhile; the default preset starts once they are ready.";
  if (s.state === "building" && !s.stages.length) return `starting the build: its stages and the time left show once the build process has begun. ${meanwhile}`;
  // A build this server has just started (a retry, a resume) has no figures of its own yet.
  if (s.state === "building" && s.estimate_s == null) return `building; the time left shows once the build process reports it. ${meanwhile}`;
  if (s.state === "building") return `building, about ${fmtDuration(s.estimate_s)} left. ${meanwhile}`;
  if (s.state === "failed") return `stage "${s.failed_stage}" failed.`;
  if (s.state === "interrupted") return `the build stopped at stage "${s.failed_stage}".`;
  return "not built. Build them to start the default preset.";
}

function render(strip, s, retry) {
  strip.dataset.state = s.state;
  strip.hidden = false;
  const stopped = s.state === "failed" || s.state === "interrupted";
  const label = stopped ? "Retry" : "Build";
  const button = !s.running && s.state !== "ready"
    ? h("button", { id: "asset-retry", class: stopped ? "primary" : "", onclick: retry }, label) : null;
  const error = stopped ? h("div", { class: "asset-error", role: "alert" },
    h("strong", {}, `Stage "${s.failed_stage}" ${s.state === "failed" ? "failed" : "was interrupted"}: `),
    s.error || "unknown error",
    h("div", { class: "muted" },
      `${label} starts again at that stage; the stages already built are kept (or run \`${s.retry_command}\`).`)) : null;
  const stages = h("ol", { class: "asset-stages" }, s.stages.map(stageRow));
  fill(strip,
    h("div", { class: "asset-head" },
      h("strong", {}, "Demo assets"), " ",
      h("span", { id: "asset-summary" }, summary(s)), button),
    error,
    s.state === "ready" ? h("details", {}, h("summary", {}, "stages"), stages) : stages);
}

/** Mounts the strip into `strip` and polls for as long as the page lives. */
export function mountAssetStrip(strip) {
  let timer = null;
  const poll = async () => {
    clearTimeout(timer);
    let wait = SLOW_MS;
    try {
      last = await api.assets();
      render(strip, last, retry);
      for (const fn of listeners) fn(last);
      if (last.running || last.state === "building") wait = FAST_MS;
    } catch (err) {
      showError(strip, err, "demo assets");
    }
    timer = setTimeout(poll, wait);
  };
  async function retry(event) {
    event.target.disabled = true;
    try {
      await api.buildAssets();
    } catch (err) {
      showError(strip, err, "demo assets");
    }
    poll();
  }
  poll();
}
