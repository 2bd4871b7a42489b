// The run page's outputs: the LoRA files (download links) and checkpoints with "Resume" for a
// run that stopped early, the plan of a succeeded run beside what it measured (calibration, or
// why it has none), and the worker's own log.

import { api } from "../../api.js";
import { calibrationView, drawOverlay } from "../../calibration.js";
import { clearErrors, fill, fmtBytes, h, showError } from "../../ui.js";

export class RunOutputs {
  /**
   * @param {object} view the page's `{run, stopped}` (the API's Run, once loaded)
   * @param {HTMLElement} errors where API errors are shown
   */
  constructor(view, errors) {
    this.view = view;
    this.errors = errors;
    this.outputsCard = h("section", { class: "card", id: "run-outputs", hidden: true });
    this.calibrationCard = h("section", { class: "card", id: "run-calibration", hidden: true });
    this.logText = h("pre", { id: "worker-log-text", class: "log" }, "");
    this.logCard = h("details", { class: "card", id: "worker-log" }, h("summary", {}, "Worker log"), this.logText);
    this.logCard.addEventListener("toggle", () => this.loadLog());
  }

  /** The worker's own output, while the log card is open (every 3 s while the run goes). */
  async loadLog() {
    const { run } = this.view;
    if (!this.logCard.open || !run) return;
    const logText = this.logText;
    try {
      const { text } = await api.workerLog(run.id);
      clearErrors(this.errors, "worker log");
      const atEnd = logText.scrollTop + logText.clientHeight >= logText.scrollHeight - 4;
      logText.textContent = text ?? "(the worker has written nothing yet)";
      if (atEnd) logText.scrollTop = logText.scrollHeight;
    } catch (err) {
      showError(this.errors, err, "worker log");
    }
  }

  /**
   * The LoRA files (download links) and checkpoints; "Continue from step N" for a run that stopped
   * before its end (a stop saves the checkpoint of its last step: the same run goes on from it).
   */
  async loadOutputs() {
    const { run } = this.view;
    let out;
    try {
      out = await api.outputs(run.id);
      clearErrors(this.errors, "outputs");
    } catch (err) {
      showError(this.errors, err, "outputs");
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
          showError(this.errors, err, "resume");
        }
      } }, `Continue from step ${last.step}`)
      : null;
    if (!lora.length && !ckpts.length) return;
    fill(this.outputsCard,
      h("h2", {}, "Outputs"),
      lora.length ? h("div", {}, h("h3", {}, "LoRA"), h("ul", { id: "lora-files" }, ...lora)) : null,
      ckpts.length ? h("div", {}, h("h3", {}, "Checkpoints"), h("ul", { id: "checkpoint-list" }, ...ckpts)) : null,
      resume);
    this.outputsCard.hidden = false;
  }

  /**
   * The plan of a succeeded run next to what it measured, asked for once. The backend plans it
   * after the run has ended, on its own thread: while it answers "calibration_pending" it is
   * asked again a few times; a run that has none gets the card with the backend's reason.
   */
  async loadCalibration(tries = 10) {
    const { run } = this.view;
    if (this.view.stopped || !run || run.status !== "succeeded" || this.calibrationAsked) return;
    this.calibrationAsked = true; // one request per load: loadEnded runs on load and at the end
    let cal;
    try {
      cal = await api.calibration(run.id);
    } catch (err) {
      if (err.status === 404 && err.code === "calibration_pending" && tries > 1) {
        setTimeout(() => {
          this.calibrationAsked = false;
          this.loadCalibration(tries - 1);
        }, 1500);
      } else if (err.status === 404 && !this.view.stopped) {
        fill(this.calibrationCard, h("h2", {}, "Plan vs measured"), h("p", { class: "muted", id: "calibration-none" }, err.message));
        this.calibrationCard.hidden = false;
      } else if (err.status !== 404) {
        showError(this.errors, err, "calibration");
      }
      return;
    }
    if (this.view.stopped) return;
    const { chart, nodes } = calibrationView(cal);
    fill(this.calibrationCard, ...nodes);
    this.calibrationCard.hidden = false;
    drawOverlay(chart, cal);
  }
}
