// The run page's header (status, step x/y, ETA, what it does before its first step, the run's
// figures), its failure card (error, traceback, log tail) and the stream's reconnect banner.

import { FINISHED, api } from "../../api.js";
import { figuresOf, weightsFact } from "../../runfigures.js";
import { StreamState } from "../../stream.js";
import { clearErrors, fill, fmtDuration, fmtMB, fmtMs, fmtNum, h, runDuration, showError, statusBadge } from "../../ui.js";

/** What Stop asks before it stops `run` (the API's Run), as Delete asks: what stopping does. */
function stopQuestion(run) {
  const name = run.name ? ` "${run.name}"` : "";
  if (run.status === "queued") return `Cancel run ${run.id}${name}? It has not started: it leaves the queue.`;
  const samples = run.config?.samples?.prompts?.length ? ", saves its LoRA and draws its final samples" : " and saves its LoRA";
  return `Stop run ${run.id}${name}? It finishes its current step${samples}.`;
}

/** One figure of the header: its label and value (ids are the tests' and the CSS's handles). */
function fact(label, value, id) {
  return h("div", { class: "fact", id }, h("span", { class: "fact-label" }, label), h("span", { class: "fact-value" }, value));
}

export class RunHeader {
  /**
   * @param {object} view the page's `{run, live}`: the API's Run and what the records told
   * @param {HTMLElement} errors where API errors are shown
   */
  constructor(view, errors) {
    this.view = view;
    this.errors = errors;
    this.header = h("section", { class: "card run-header", id: "run-header" }, "loading run…");
    this.banner = h("div", { id: "stream-banner", class: "banner", hidden: true, role: "status" });
    this.failure = h("section", { id: "run-error", class: "card failure", hidden: true });
  }

  eta() {
    const { live } = this.view;
    if (live.step === null || !live.maxSteps || !live.stepTimes.length) return null;
    const recent = live.stepTimes.slice(-10);
    const mean = recent.reduce((a, b) => a + b, 0) / recent.length;
    return ((live.maxSteps - live.step) * mean) / 1000;
  }

  /** What the run is doing before its first step: queued behind which runs, starting its
   * worker, stage 1 (caching N/M and its message), loading the model; null once it trains. */
  doingText() {
    const { run, live } = this.view;
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
  async loadAhead() {
    const { run } = this.view;
    if (!run || run.status !== "queued") return;
    try {
      const { data } = await api.runs({ status: "running" });
      this.view.live.ahead = (data || []).map((r) => r.id).filter((id) => id !== run.id).sort((a, b) => a - b);
      clearErrors(this.errors, "queue");
      this.render();
    } catch (err) {
      showError(this.errors, err, "queue");
    }
  }

  render() {
    const { run, live } = this.view;
    if (!run) return;
    const running = run.status === "running";
    // While the run goes, its figures come from the records as they arrive; once it ended,
    // from the backend's summary of what it stored.
    const s = running ? { ...run.summary, ...figuresOf(live.figures) } : run.summary || {};
    const maxSteps = live.maxSteps ?? s.max_steps;
    const step = live.step ?? s.steps_done ?? 0;
    const doing = this.doingText();
    // Counted from the records as they come (all of them, the stored ones first); the summary's
    // count covers a run whose records were not all read.
    const recoveries = Math.max(live.recoveries || 0, s.recoveries || 0);
    fill(this.facts(),
      fact("step", `${step}/${maxSteps ?? "?"}`, "fact-step"),
      fact("ETA", running ? fmtDuration(this.eta()) : "–", "fact-eta"),
      doing ? fact("now", doing, "fact-stage") : null,
      fact("elapsed", fmtDuration(runDuration(run)), "fact-elapsed"),
      fact("preset", run.preset, "fact-preset"),
      run.executor ? fact("node", `${run.node || "waiting for a node"} (${run.executor})`, "fact-node") : null,
      fact(FINISHED.has(run.status) ? "final loss" : "loss", fmtNum(s.final_loss), "fact-loss"),
      fact("peak VRAM (training)", fmtMB(s.peak_vram_mb), "fact-peak"),
      s.encode_peak_vram_mb != null ? fact("peak VRAM (encoding)", fmtMB(s.encode_peak_vram_mb), "fact-encode-peak") : null,
      fact("mean step", fmtMs(s.mean_step_time_ms), "fact-mean-step"),
      fact("spill", s.spill_bytes != null ? fmtMB(s.spill_bytes / 2 ** 20) : "–", "fact-spill"),
      weightsFact(s),
      recoveries ? fact("out-of-memory recoveries", String(recoveries), "fact-recoveries") : null,
      run.exit_code != null ? fact("exit code", String(run.exit_code), "fact-exit") : null);
  }

  /** The facts' container under the toolbar. The toolbar (title, status, Stop, Re-run) is built
   * again only when the run's status or name changes: rebuilt on every record, a button under
   * the pointer is replaced between mousedown and mouseup, and the click is lost. */
  facts() {
    const { run } = this.view;
    const key = `${run.id}|${run.status}|${run.name}`;
    if (this.toolbarKey !== key) {
      this.toolbarKey = key;
      this.factsEl = h("div", { class: "facts" });
      fill(this.header, this.toolbar(run), this.factsEl);
    }
    return this.factsEl;
  }

  toolbar(run) {
    const cancelBtn = run.status === "running" || run.status === "queued"
      ? h("button", { class: "danger", id: "cancel-run", onclick: async () => {
        if (!window.confirm(stopQuestion(this.view.run))) return;
        try {
          await api.cancelRun(this.view.run.id);
        } catch (err) {
          showError(this.errors, err, "cancel");
        }
      } }, "Stop run")
      : null;
    return h("div", { class: "toolbar" },
      h("h1", {}, run.name || `run ${run.id}`), statusBadge(run.status), h("div", { class: "spacer" }),
      cancelBtn,
      h("a", { class: "button", id: "rerun", href: `#/new?from=${run.id}` }, "Re-run with changes"));
  }

  renderFailure() {
    const err = this.view.run && this.view.run.error;
    const failure = this.failure;
    if (!err) {
      failure.hidden = true;
      return;
    }
    failure.hidden = false;
    fill(failure,
      h("h2", {}, `${this.view.run.status}: ${err.error_type ? `${err.error_type}: ` : ""}`, h("span", { class: "error-message" }, err.message)),
      err.oom ? h("p", { class: "muted" }, "The device ran out of memory: lower the watermarks or enable activation spill.") : null,
      err.traceback ? h("details", { open: true }, h("summary", {}, "traceback"), h("pre", { class: "traceback" }, err.traceback)) : null,
      err.log_tail ? h("details", {}, h("summary", {}, "worker.log (last lines)"), h("pre", { class: "traceback" }, err.log_tail)) : null);
  }

  /** The stream's state (stream.js `StreamState`) in the banner. */
  onState(state, detail) {
    const banner = this.banner;
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
}
