// Run live view: header (status, step x/y, ETA, error + traceback), the reconnect banner, the
// dataset scan the worker recorded, the charts (runcharts.js) with the live-limits panel beside
// the VRAM chart, and the samples gallery.
// Stored records are drawn first (history.js); the stream then resumes after the last of them.

import { FINISHED, api } from "../api.js";
import { loadHistory } from "../history.js";
import { calibrationView, drawOverlay } from "../calibration.js";
import { afterPaint } from "../charts.js";
import { RunCharts } from "../runcharts.js";
import { addFigures, figuresOf, newFigures, weightsFact } from "../runfigures.js";
import { sampleStep, stepText } from "../samples.js";
import { framesView, scanView } from "../scan.js";
import { RunStream, StreamState } from "../stream.js";
import { clearErrors, fill, fmtBytes, fmtDuration, fmtMB, fmtMs, fmtNum, h, runDuration, showError, statusBadge } from "../ui.js";
import { LimitsPanel } from "./limits.js";

export function mount(root, { parts }) {
  const runId = parts[1];
  let run = null;
  let stream = null;
  let stopped = false;
  const live = { step: null, maxSteps: null, stepTimes: [], stage: null, ahead: null, samples: new Set(), figures: newFigures() };

  const errors = h("div", { class: "page-errors" });
  const header = h("section", { class: "card run-header", id: "run-header" }, "loading run…");
  const banner = h("div", { id: "stream-banner", class: "banner", hidden: true, role: "status" });
  const failure = h("section", { id: "run-error", class: "card failure", hidden: true });
  const dataCard = h("section", { id: "run-data", class: "card run-data", hidden: true });
  const limitsBox = h("section", { class: "card", id: "limits-panel" });
  const grid = h("div", { class: "chart-grid", id: "charts" });
  const gallery = h("div", { class: "gallery", id: "samples" });
  const stepSlider = h("input", { type: "range", id: "sample-step", min: "0", max: "0", step: "1", value: "0" });
  const stepLabel = h("span", { id: "sample-step-label", class: "muted" });
  const sliderRow = h("div", { class: "sample-controls", hidden: true }, h("label", { for: "sample-step" }, "step"), stepSlider, stepLabel);
  const galleryCard = h("section", { class: "card", id: "samples-card", hidden: true }, h("h2", {}, "Samples"), sliderRow, gallery);
  const outputsCard = h("section", { class: "card", id: "run-outputs", hidden: true });
  const calibrationCard = h("section", { class: "card", id: "run-calibration", hidden: true });
  const logText = h("pre", { id: "worker-log-text", class: "log" }, "");
  const logCard = h("details", { class: "card", id: "worker-log" }, h("summary", {}, "Worker log"), logText);
  root.append(header, errors, banner, failure, dataCard, outputsCard, calibrationCard, grid, galleryCard, logCard);

  let charts = null;
  let limits = null;
  // Tests reach the stream and charts through this handle.
  window.__runView = { get charts() { return charts; }, get stream() { return stream; }, get run() { return run; } };

  function eta() {
    if (live.step === null || !live.maxSteps || !live.stepTimes.length) return null;
    const recent = live.stepTimes.slice(-10);
    const mean = recent.reduce((a, b) => a + b, 0) / recent.length;
    return ((live.maxSteps - live.step) * mean) / 1000;
  }

  /** What the run is doing before its first step: queued behind which runs, starting its
   * worker, stage 1 (caching N/M and its message), loading the model; null once it trains. */
  function doingText() {
    if (run.status === "queued") {
      return live.ahead && live.ahead.length ? `queued behind ${live.ahead.map((id) => `#${id}`).join(", ")}` : "queued";
    }
    if (run.status !== "running" || live.step !== null) return null;
    const st = live.stage;
    if (!st) return "starting worker";
    const count = st.total ? ` ${st.done ?? 0}/${st.total}` : "";
    return `${st.stage === "cache" ? "caching" : st.stage}${count}${st.message ? `: ${st.message}` : ""}`;
  }

  /** The runs that hold the worker slots while this one is queued. */
  async function loadAhead() {
    if (!run || run.status !== "queued") return;
    try {
      const { data } = await api.runs({ status: "running" });
      live.ahead = (data || []).map((r) => r.id).filter((id) => id !== run.id).sort((a, b) => a - b);
      clearErrors(errors, "queue");
      renderHeader();
    } catch (err) {
      showError(errors, err, "queue");
    }
  }

  function renderHeader() {
    if (!run) return;
    const running = run.status === "running";
    // While the run goes, its figures come from the records as they arrive; once it ended,
    // from the backend's summary of what it stored.
    const s = running ? { ...run.summary, ...figuresOf(live.figures) } : run.summary || {};
    const maxSteps = live.maxSteps ?? s.max_steps;
    const step = live.step ?? s.steps_done ?? 0;
    const cancelBtn = running || run.status === "queued"
      ? h("button", { class: "danger", id: "cancel-run", onclick: async () => {
        try {
          await api.cancelRun(run.id);
        } catch (err) {
          showError(errors, err, "cancel");
        }
      } }, "Stop run")
      : null;
    const fact = (label, value, id) => h("div", { class: "fact", id }, h("span", { class: "fact-label" }, label), h("span", { class: "fact-value" }, value));
    const stageText = doingText();
    fill(header,
      h("div", { class: "toolbar" },
        h("h1", {}, run.name || `run ${run.id}`), statusBadge(run.status), h("div", { class: "spacer" }),
        cancelBtn,
        h("a", { class: "button", id: "rerun", href: `#/new?from=${run.id}` }, "Re-run with changes")),
      h("div", { class: "facts" },
        fact("step", `${step}/${maxSteps ?? "?"}`, "fact-step"),
        fact("ETA", running ? fmtDuration(eta()) : "–", "fact-eta"),
        stageText ? fact("now", stageText, "fact-stage") : null,
        fact("elapsed", fmtDuration(runDuration(run)), "fact-elapsed"),
        fact("preset", run.preset, "fact-preset"),
        run.executor ? fact("node", `${run.node || "waiting for a node"} (${run.executor})`, "fact-node") : null,
        fact(FINISHED.has(run.status) ? "final loss" : "loss", fmtNum(s.final_loss), "fact-loss"),
        fact("peak VRAM (training)", fmtMB(s.peak_vram_mb), "fact-peak"),
        s.encode_peak_vram_mb != null ? fact("peak VRAM (encoding)", fmtMB(s.encode_peak_vram_mb), "fact-encode-peak") : null,
        fact("mean step", fmtMs(s.mean_step_time_ms), "fact-mean-step"),
        fact("spill", s.spill_bytes != null ? fmtMB(s.spill_bytes / 2 ** 20) : "–", "fact-spill"),
        weightsFact(s),
        run.exit_code != null ? fact("exit code", String(run.exit_code), "fact-exit") : null));
  }

  function renderFailure() {
    const err = run && run.error;
    if (!err) {
      failure.hidden = true;
      return;
    }
    failure.hidden = false;
    fill(failure,
      h("h2", {}, `${run.status}: ${err.error_type ? `${err.error_type}: ` : ""}`, h("span", { class: "error-message" }, err.message)),
      err.oom ? h("p", { class: "muted" }, "The device ran out of memory: lower the watermarks or enable activation spill.") : null,
      err.traceback ? h("details", { open: true }, h("summary", {}, "traceback"), h("pre", { class: "traceback" }, err.traceback)) : null,
      err.log_tail ? h("details", {}, h("summary", {}, "worker.log (last lines)"), h("pre", { class: "traceback" }, err.log_tail)) : null);
  }

  /** Samples by the step they were drawn at (`step-NNNNNN-ii.png` before and during training,
   * `sample-ii.png` at the end), shown one step at a time with a slider; the newest by default.
   * A later step shows each prompt's step-0 image (the model before training) beside it. */
  const sampleSteps = new Map(); // step (Infinity: the final samples) -> [{name, caption}]
  function showSamples(index) {
    const steps = [...sampleSteps.keys()].sort((a, b) => a - b);
    const step = steps[index];
    const last = run && run.summary ? run.summary.steps_done : null;
    stepLabel.textContent = `${stepText(step, last)} · ${index + 1} of ${steps.length}`;
    const before = step !== 0 && sampleSteps.has(0) ? sampleSteps.get(0) : [];
    const image = (name, caption, at, cls) => {
      const url = api.artifactUrl(run.id, name);
      return h("a", { href: url, target: "_blank", class: cls },
        h("img", { src: url, alt: `${caption || name}, ${stepText(at, last)}`, loading: "lazy" }),
        before.length ? h("span", { class: "sample-at" }, stepText(at, last)) : null);
    };
    gallery.classList.toggle("paired", before.length > 0);
    fill(gallery, ...(sampleSteps.get(step) || []).map(({ name, caption }) => {
      const prompt = name.slice(name.lastIndexOf("-")); // "-ii.png": the prompt's index
      const first = before.find((s) => s.name.endsWith(prompt));
      return h("figure", { dataset: { step: String(step) } },
        h("div", { class: "sample-pair" },
          first ? image(first.name, caption, 0, "sample-before") : null,
          image(name, caption, step, "sample-now")),
        h("figcaption", {}, caption || name));
    }));
  }
  stepSlider.addEventListener("input", () => showSamples(Number(stepSlider.value)));

  function addSample(name, caption) {
    if (live.samples.has(name)) return;
    live.samples.add(name);
    galleryCard.hidden = false;
    const step = sampleStep(name);
    if (!sampleSteps.has(step)) sampleSteps.set(step, []);
    sampleSteps.get(step).push({ name, caption });
    sampleSteps.get(step).sort((a, b) => (a.name < b.name ? -1 : 1));
    const count = sampleSteps.size;
    const atEnd = Number(stepSlider.value) >= Number(stepSlider.max);
    stepSlider.max = String(count - 1);
    sliderRow.hidden = count < 2;
    if (atEnd) stepSlider.value = String(count - 1); // follow the newest unless the user moved
    showSamples(Number(stepSlider.value));
  }

  /** The worker's own output, while the log card is open (every 3 s while the run goes). */
  async function loadLog() {
    if (!logCard.open || !run) return;
    try {
      const { text } = await api.workerLog(run.id);
      clearErrors(errors, "worker log");
      const atEnd = logText.scrollTop + logText.clientHeight >= logText.scrollHeight - 4;
      logText.textContent = text ?? "(the worker has written nothing yet)";
      if (atEnd) logText.scrollTop = logText.scrollHeight;
    } catch (err) {
      showError(errors, err, "worker log");
    }
  }
  logCard.addEventListener("toggle", loadLog);

  /** The LoRA files (download links) and checkpoints; "Resume" for a run that stopped early. */
  async function loadOutputs() {
    let out;
    try {
      out = await api.outputs(run.id);
      clearErrors(errors, "outputs");
    } catch (err) {
      showError(errors, err, "outputs");
      return;
    }
    const lora = (out.lora || []).map((f) =>
      h("li", {}, h("a", { href: f.url, download: "", class: "lora-link" }, f.name), ` ${fmtBytes(f.size)}`));
    const ckpts = (out.checkpoints || []).map((c) => h("li", {}, `${c.name} (${fmtBytes(c.size)})`));
    const last = out.checkpoints && out.checkpoints.length ? out.checkpoints[out.checkpoints.length - 1] : null;
    const resume = out.resumable && last
      ? h("button", { id: "resume-run", onclick: async () => {
        try {
          await api.resumeRun(run.id);
          location.reload(); // the same run, queued again: its page starts over
        } catch (err) {
          showError(errors, err, "resume");
        }
      } }, `Resume from ${last.name}`)
      : null;
    if (!lora.length && !ckpts.length) return;
    fill(outputsCard,
      h("h2", {}, "Outputs"),
      lora.length ? h("div", {}, h("h3", {}, "LoRA"), h("ul", { id: "lora-files" }, ...lora)) : null,
      ckpts.length ? h("div", {}, h("h3", {}, "Checkpoints"), h("ul", { id: "checkpoint-list" }, ...ckpts)) : null,
      resume);
    outputsCard.hidden = false;
  }

  /** The plan of a succeeded run next to what it measured; the backend plans it once the run
   * has ended, on its own thread: asked again a few times until it is there. */
  async function loadCalibration(tries = 10) {
    if (stopped || !run || run.status !== "succeeded" || !calibrationCard.hidden) return;
    let cal;
    try {
      cal = await api.calibration(run.id);
    } catch (err) {
      if (err.status === 404 && tries > 1) setTimeout(() => loadCalibration(tries - 1), 1500);
      else if (err.status !== 404) showError(errors, err, "calibration");
      return;
    }
    if (stopped) return;
    const { chart, nodes } = calibrationView(cal);
    fill(calibrationCard, ...nodes);
    calibrationCard.hidden = false;
    drawOverlay(chart, cal);
  }

  async function loadSamples() {
    try {
      const list = await api.artifacts(run.id);
      clearErrors(errors, "samples");
      for (const item of list.data || []) {
        const name = typeof item === "string" ? item : item.name;
        if (name && /\.(png|jpe?g|webp|gif)$/i.test(name)) addSample(name, item.prompt);
      }
    } catch (err) {
      showError(errors, err, "samples");
    }
  }

  // The Data card: the worker's scan (trainer/dataset_scan, recorded first) and, for a video run,
  // the frames per clip its trainer/run_started chose; each record fills its part, neither hides the other.
  const shown = { scan: null, frames: null };
  function showData(part) {
    Object.assign(shown, part);
    fill(dataCard, h("h2", {}, "Data"), shown.frames && framesView(shown.frames), shown.scan && scanView(shown.scan));
    dataCard.hidden = false;
  }

  function onRecords(records) {
    let headerDirty = false;
    for (const rec of records) {
      if (charts) charts.ingest(rec);
      const key = `${rec.source}/${rec.kind}`;
      if (rec.kind === "step") headerDirty = addFigures(live.figures, rec) || headerDirty;
      if (key === "trainer/run_started") {
        live.maxSteps = rec.max_steps ?? live.maxSteps;
        headerDirty = true;
        if (rec.frames != null) showData({ frames: rec });
      } else if (key === "trainer/step") {
        live.step = rec.step;
        if (typeof rec.step_time_ms === "number") live.stepTimes.push(rec.step_time_ms);
        if (live.stepTimes.length > 50) live.stepTimes.shift();
        headerDirty = true;
      } else if (key === "trainer/stage") {
        live.stage = rec;
        if (rec.stage === "cache" && !live.figures.trained) live.figures.stage1 = true;
        if (rec.stage === "train") Object.assign(live.figures, { stage1: false, trained: true });
        headerDirty = true;
      } else if (key === "trainer/dataset_scan") {
        showData({ scan: rec });
      } else if (key === "trainer/sample" && rec.path) {
        addSample(rec.path.split("/").pop(), rec.prompt);
      } else if (key === "strategy/limits_applied" || (key === "trainer/event" && rec.event === "control_rejected")) {
        if (limits) limits.answered(rec);
      } else if (key === "trainer/error" && run && !run.error) {
        run.error = { message: rec.message, error_type: rec.error_type, traceback: rec.traceback, oom: rec.oom };
        renderFailure();
      }
    }
    if (headerDirty) renderHeader();
  }

  async function onRun(fresh) {
    const wasFinished = run && FINISHED.has(run.status);
    run = { ...run, ...fresh };
    renderHeader();
    loadAhead();
    renderFailure();
    if (limits) limits.setStatus(run.status);
    if (FINISHED.has(run.status) && charts) charts.finished();
    if (FINISHED.has(run.status) && !wasFinished) {
      // The summary is computed by the backend: read the final one.
      try {
        run = await api.run(run.id);
        clearErrors(errors, "refresh run");
        renderHeader();
        renderFailure();
      } catch (err) {
        showError(errors, err, "refresh run");
      }
      loadSamples();
      loadOutputs();
      loadCalibration();
    }
  }

  function onState(state, detail) {
    if (state === StreamState.RECONNECTING) {
      banner.hidden = false;
      banner.className = "banner warn";
      banner.textContent = `Connection lost (${detail.reason}). Reconnecting in ${(detail.delayMs / 1000).toFixed(1)} s (attempt ${detail.attempt}); charts are behind, drawn up to record ${detail.lastSeq}.`;
      banner.dataset.lastWarning = banner.textContent;
    } else if (state === StreamState.CATCHING_UP) {
      banner.hidden = false;
      banner.className = "banner info";
      banner.textContent = `Reconnecting… will resume after record ${detail.lastSeq}.`;
    } else if (detail.error) {
      banner.hidden = false;
      banner.className = "banner warn";
      banner.textContent = detail.error;
    } else {
      banner.hidden = true;
    }
    banner.dataset.state = state;
  }

  const opened = performance.now();
  const ms = () => String(Math.round(performance.now() - opened)); // dataset timings of the open
  (async () => {
    try {
      run = await api.run(runId);
    } catch (err) {
      fill(header);
      showError(header, err, `run ${runId}`);
      return;
    }
    // Ask for the stored records first: the charts are built while the requests are in flight.
    const historyLoad = loadHistory(run);
    historyLoad.catch(() => {}); // reported where it is awaited below
    const limitsLoad = api.limits(run.id);
    renderHeader();
    renderFailure();
    loadAhead();
    charts = new RunCharts(grid, run.config, `run-${run.id}`);
    grid.before(charts.controls);
    // Beside the VRAM chart (under it on a narrow screen), where a user watching it looks.
    grid.firstElementChild.after(limitsBox);
    try {
      limits = new LimitsPanel(limitsBox, run, await limitsLoad, errors);
    } catch (err) {
      showError(errors, err, "live limits");
    }
    if (stopped) return;
    // Limits only matter while a run can still take them.
    limitsBox.hidden = FINISHED.has(run.status);
    let lastSeq = -1;
    try {
      const history = await historyLoad;
      if (stopped) return;
      grid.dataset.fetchedMs = ms();
      charts.ingestBuckets(history.buckets); // first: a long run's VRAM is drawn from them
      onRecords(history.records);
      // The charts in the window are drawn now, the rest right after that frame is painted.
      const drawn = charts.drawVisibleFirst(() => { grid.dataset.drawnMs = ms(); });
      drawn.then(() => afterPaint(() => { grid.dataset.allDrawnMs = ms(); }));
      lastSeq = history.lastSeq;
      grid.dataset.historyRecords = String(history.records.length);
      grid.dataset.downsampled = String(history.downsampled);
    } catch (err) {
      showError(errors, err, "loading telemetry");
      charts.flush(); // the charts' notes, at least
    }
    if (stopped) return;
    loadSamples();
    loadOutputs();
    loadCalibration();
    stream = new RunStream(run.id, { onRecords, onRun, onState }, lastSeq, (r) => FINISHED.has((r || run).status));
    stream.start();
    let ticks = 0;
    const tick = setInterval(() => {
      if (!run || run.status !== "running") return;
      renderHeader();
      if (++ticks % 3 === 0) loadLog();
    }, 1000);
    cleanup.push(() => clearInterval(tick));
  })();

  const cleanup = [];
  return () => {
    stopped = true;
    if (stream) stream.stop();
    for (const fn of cleanup) fn();
    if (charts) charts.purge();
    delete window.__runView;
  };
}
