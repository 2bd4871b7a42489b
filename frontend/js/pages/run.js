// Run live view: header (status, step x/y, ETA, error + traceback) and the reconnect banner
// (components/run/header.js), the dataset scan the worker recorded, the charts (runcharts.js)
// with the live-limits panel beside the VRAM chart (components/panels/limits.js), the outputs
// and calibration (components/run/outputs.js) and the samples (components/run/samples.js).
// Stored records are drawn first (history.js); the stream then resumes after the last of them,
// each record routed by components/run/feed.js.

import { FINISHED, api } from "../api.js";
import { loadHistory } from "../history.js";
import { afterPaint } from "../charts.js";
import { RunCharts } from "../runcharts.js";
import { newFigures } from "../runfigures.js";
import { framesView, scanView } from "../scan.js";
import { RunStream } from "../stream.js";
import { clearErrors, fill, h, showError } from "../ui.js";
import { LimitsPanel } from "../components/panels/limits.js";
import { recordFeed } from "../components/run/feed.js";
import { RunHeader } from "../components/run/header.js";
import { RunOutputs } from "../components/run/outputs.js";
import { SamplesCard } from "../components/run/samples.js";

export function mount(root, { parts }) {
  const runId = parts[1];
  // What the components share: the API's Run, what the records told, the charts once built.
  const view = {
    run: null, charts: null, stopped: false,
    live: { step: null, maxSteps: null, stepTimes: [], stage: null, ahead: null, figures: newFigures(), recoveries: 0 },
  };
  let stream = null;
  let limits = null;

  const errors = h("div", { class: "page-errors" });
  const head = new RunHeader(view, errors);
  const samples = new SamplesCard(view, errors);
  const outputs = new RunOutputs(view, errors);
  const dataCard = h("section", { id: "run-data", class: "card run-data", hidden: true });
  const limitsBox = h("section", { class: "card", id: "limits-panel" });
  const grid = h("div", { class: "chart-grid", id: "charts" });
  root.append(head.header, errors, head.banner, head.failure, dataCard, outputs.outputsCard,
    outputs.calibrationCard, grid, samples.card, outputs.logCard);

  // Tests reach the stream and charts through this handle.
  window.__runView = { get charts() { return view.charts; }, get stream() { return stream; }, get run() { return view.run; } };

  // The Data card: the worker's scan (trainer/dataset_scan, recorded first) and, for a video run,
  // the frames per clip its trainer/run_started chose; each record fills its part, neither hides the other.
  const shown = { scan: null, frames: null };
  function showData(part) {
    Object.assign(shown, part);
    fill(dataCard, h("h2", {}, "Data"), shown.frames && framesView(shown.frames), shown.scan && scanView(shown.scan));
    dataCard.hidden = false;
  }

  const live = view.live;
  const answered = (rec) => { if (limits) limits.answered(rec); };
  const onRecords = recordFeed(view, {
    "trainer/run_started": (rec) => {
      live.maxSteps = rec.max_steps ?? live.maxSteps;
      if (rec.frames != null) showData({ frames: rec });
      return true;
    },
    "trainer/step": (rec) => {
      live.step = rec.step;
      if (typeof rec.step_time_ms === "number") live.stepTimes.push(rec.step_time_ms);
      if (live.stepTimes.length > 50) live.stepTimes.shift();
      return true;
    },
    "trainer/stage": (rec) => {
      live.stage = rec;
      if (rec.stage === "cache" && !live.figures.trained) live.figures.stage1 = true;
      if (rec.stage === "train") Object.assign(live.figures, { stage1: false, trained: true });
      return true;
    },
    "trainer/dataset_scan": (rec) => showData({ scan: rec }),
    "trainer/sample": (rec) => { if (rec.path) samples.add(rec.path.split("/").pop(), rec.prompt); },
    "strategy/limits_applied": answered,
    "trainer/limits_effect": (rec) => { if (limits) limits.effect(rec); },
    "trainer/oom_recovery": (rec) => {
      live.recoveries += 1;
      if (limits) limits.recovery(rec);
      return true;
    },
    "trainer/event": (rec) => { if (rec.event === "control_rejected") answered(rec); },
    "trainer/error": (rec) => {
      if (!view.run || view.run.error) return;
      view.run.error = { message: rec.message, error_type: rec.error_type, traceback: rec.traceback, oom: rec.oom };
      head.renderFailure();
    },
  }, () => head.render());

  function loadEnded() {
    samples.load();
    outputs.loadOutputs();
    outputs.loadCalibration();
  }

  async function onRun(fresh) {
    const wasFinished = view.run && FINISHED.has(view.run.status);
    view.run = { ...view.run, ...fresh };
    head.render();
    head.loadAhead();
    head.renderFailure();
    if (limits) limits.setStatus(view.run.status);
    if (FINISHED.has(view.run.status) && view.charts) view.charts.finished();
    if (FINISHED.has(view.run.status) && !wasFinished) {
      // The summary is computed by the backend: read the final one.
      try {
        view.run = await api.run(view.run.id);
        clearErrors(errors, "refresh run");
        head.render();
        head.renderFailure();
      } catch (err) {
        showError(errors, err, "refresh run");
      }
      loadEnded();
    }
  }

  const opened = performance.now();
  const ms = () => String(Math.round(performance.now() - opened)); // dataset timings of the open
  (async () => {
    let run;
    try {
      run = view.run = await api.run(runId);
    } catch (err) {
      fill(head.header);
      showError(head.header, err, `run ${runId}`);
      return;
    }
    // Ask for the stored records first: the charts are built while the requests are in flight.
    const historyLoad = loadHistory(run);
    historyLoad.catch(() => {}); // reported where it is awaited below
    const limitsLoad = api.limits(run.id);
    head.render();
    head.renderFailure();
    head.loadAhead();
    const charts = view.charts = new RunCharts(grid, run.config, `run-${run.id}`);
    grid.before(charts.controls);
    // Beside the VRAM chart (under it on a narrow screen), where a user watching it looks.
    grid.firstElementChild.after(limitsBox);
    try {
      limits = new LimitsPanel(limitsBox, run, await limitsLoad, errors);
    } catch (err) {
      showError(errors, err, "live limits");
    }
    if (view.stopped) return;
    // Limits only matter while a run can still take them.
    limitsBox.hidden = FINISHED.has(run.status);
    let lastSeq = -1;
    try {
      const history = await historyLoad;
      if (view.stopped) return;
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
    if (view.stopped) return;
    loadEnded();
    stream = new RunStream(run.id, { onRecords, onRun, onState: (s, d) => head.onState(s, d) }, lastSeq,
      (r) => FINISHED.has((r || view.run).status));
    stream.start();
    let ticks = 0;
    const tick = setInterval(() => {
      if (!view.run || view.run.status !== "running") return;
      head.render();
      if (++ticks % 3 === 0) outputs.loadLog();
    }, 1000);
    cleanup.push(() => clearInterval(tick));
  })();

  const cleanup = [];
  return () => {
    view.stopped = true;
    if (stream) stream.stop();
    for (const fn of cleanup) fn();
    if (view.charts) view.charts.purge();
    delete window.__runView;
  };
}
