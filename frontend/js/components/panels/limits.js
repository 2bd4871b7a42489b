// Live-limits panel: PATCH /api/runs/{id}/limits with the LiveLimits fields that changed
// (runtime/stagehand/config/limits.py), then wait for the worker's answer with the same request_id and say
// which: a `strategy/limits_applied` record (applied at the next step begin) or a
// `trainer/event` `control_rejected` one (refused, with the worker's message). The charts
// draw a marker for either. Once the runtimes settle under an applied change, its
// `trainer/limits_effect` record says what it did: resident blocks, H2D and spill per step and
// the peak, before -> after (backend/workbench/worker/limits_effect.py). A change the run made itself after the
// card ran out of memory (`trainer/oom_recovery`, then `limits_applied` with request "oom") is
// listed as the run's, not as a request of the user's.

import { api } from "../../api.js";
import { limitFields } from "../../limitfields.js";
import { clearErrors, fill, getPath, h, showError } from "../../ui.js";

export class LimitsPanel {
  /**
   * @param {HTMLElement} box the panel's card
   * @param {object} run the API's Run
   * @param {object} limits the API's limits of the run (`{paths, pairs}` are read: the fields
   *   shown, their config paths and which are watermarks, limitfields.js)
   * @param {HTMLElement} errors where API errors are shown (besides the panel itself)
   */
  constructor(box, run, limits, errors) {
    this.box = box;
    this.run = run;
    this.errors = errors;
    this.current = {};
    this.pending = new Map(); // request_id -> list item
    // A busy server can deliver the worker's answer before the PATCH answer: kept here.
    this.early = new Map(); // request_id -> limits_applied or control_rejected record
    this.items = new Map(); // request_id -> list item, kept for the change's effect
    this.effects = new Map(); // request_id -> limits_effect record come before its item
    this.recoveries = new Map(); // step -> its trainer/oom_recovery record (the newest attempt)
    this.inputs = new Map();
    this.fields = limitFields(limits);
    // The values in the run's config (at the API's paths); its limits_applied records move them.
    for (const { field, path } of this.fields) {
      const value = getPath(run.config || {}, path);
      if (value !== undefined && value !== null) this.current[field] = value;
    }
    this.applyBtn = h("button", { class: "primary", id: "apply-limits", onclick: () => this.submit() }, "Apply limits");
    this.note = h("span", { class: "muted", id: "limits-note" });
    this.log = h("ul", { class: "limits-log", id: "limits-log" });
    const grid = h("div", { class: "form-grid compact" });
    for (const { field, label, hint } of this.fields) {
      const input = h("input", { type: "text", inputmode: "decimal", id: `limit-${field}`, value: this.current[field] ?? "", placeholder: "unchanged" });
      const err = h("div", { class: "field-error" });
      // Editing a field the API refused takes its error (and the banner naming it) away.
      input.addEventListener("input", () => {
        if (!input.classList.contains("invalid")) return;
        err.textContent = "";
        input.classList.remove("invalid");
        clearErrors(this.box, null, field);
      });
      this.inputs.set(field, { input, err });
      grid.append(h("label", { class: "field" }, h("span", { class: "label" }, label), input,
        h("span", { class: "hint" }, hint), err));
    }
    fill(box,
      h("h2", {}, "Live limits"),
      h("p", { class: "muted" }, "Changes apply at the next step begin; each changes only itself (the VRAM watermarks are the weight runtime's, the spill ones the activation runtime's). The charts mark where the worker applied or refused them."),
      grid, h("div", { class: "toolbar" }, this.applyBtn, this.note), this.log);
    this.setStatus(run.status);
  }

  setStatus(status) {
    const running = status === "running";
    this.note.textContent = running ? "" : `run is ${status}: limits can only change while it runs`;
    this.box.classList.toggle("inactive", !running);
  }

  /** Body of the PATCH: the fields whose input differs from the current value. */
  body() {
    const out = {};
    let bad = false;
    for (const { field, int } of this.fields) {
      const { input, err } = this.inputs.get(field);
      err.textContent = "";
      input.classList.remove("invalid");
      const raw = input.value.trim();
      if (raw === "") continue;
      const value = Number(raw);
      if (!Number.isFinite(value) || (int && !Number.isInteger(value))) {
        err.textContent = `expected ${int ? "a whole number" : "a number"}, got "${raw}"`;
        input.classList.add("invalid");
        bad = true;
        continue;
      }
      if (value !== this.current[field]) out[field] = value;
    }
    return bad ? null : out;
  }

  async submit() {
    const body = this.body();
    if (body === null) return;
    if (!Object.keys(body).length) {
      this.note.textContent = "nothing changed";
      return;
    }
    try {
      const { request_id: requestId } = await api.setLimits(this.run.id, body);
      clearErrors(this.box, "limits");
      const item = h("li", { "data-request-id": requestId, class: "pending" },
        `${describe(body)}: sent, waiting for the worker…`);
      this.log.prepend(item);
      this.pending.set(requestId, { item, body });
      this.items.set(requestId, item);
      const early = this.early.get(requestId);
      if (early) {
        this.early.delete(requestId);
        this.answered(early);
      }
    } catch (err) {
      if (err.field) {
        const target = this.inputs.get(err.field.replace(/^limits\./, ""));
        if (target) {
          target.err.textContent = err.sentence();
          target.input.classList.add("invalid");
        }
      }
      showError(this.box, err, "limits");
    }
  }

  /**
   * The worker answered a request: `rec` is its `strategy/limits_applied` record (the limits
   * in force change) or its `trainer/event` `control_rejected` one (nothing changes).
   */
  answered(rec) {
    if (rec.request_id === "oom" && rec.kind === "limits_applied") {
      this.lowered(rec);
      return;
    }
    const refused = rec.kind !== "limits_applied";
    const changed = refused ? {} : rec.changed || {};
    for (const [field, [, now]] of Object.entries(changed)) this.current[field] = now;
    const entry = this.pending.get(rec.request_id);
    if (!entry) {
      this.early.set(rec.request_id, rec);
      this._showCurrent(Object.keys(changed));
      return;
    }
    this.pending.delete(rec.request_id);
    // A refused request leaves its fields as they were: the inputs show the values in force.
    this._showCurrent(refused ? Object.keys(entry.body) : Object.keys(changed));
    const text = refused
      ? `refused by the worker at step ${rec.step ?? "?"}: ${rec.message || "no reason given"}`
      : `applied at step ${rec.step ?? "?"}: ${Object.entries(changed).map(([f, [a, b]]) => `${f} ${a} → ${b}`).join(", ") || "no change"}`;
    entry.item.className = refused ? "refused" : "applied";
    entry.item.textContent = `${describe(entry.body)}: ${text}`;
    const effect = this.effects.get(rec.request_id);
    if (effect && !refused) this.effect(effect);
  }

  /**
   * What an applied change did once the runtimes settled (`trainer/limits_effect`): a line
   * under its entry, e.g. "resident blocks 8 → 4, H2D per step 0.00 → 2.89 MB; …".
   */
  effect(rec) {
    const item = this.items.get(rec.request_id);
    if (!item || item.className !== "applied") {
      this.effects.set(rec.request_id, rec);
      return;
    }
    this.effects.delete(rec.request_id);
    let line = item.querySelector(".limits-effect");
    if (!line) {
      line = h("div", { class: "limits-effect muted" });
      item.append(line);
    }
    line.textContent = effectText(rec);
  }

  /** The card ran out of memory at `rec.step` (`trainer/oom_recovery`): its rerun's
   * `limits_applied` (request "oom") says by how much the run lowered its limits. */
  recovery(rec) {
    this.recoveries.set(rec.step, rec);
  }

  /** The limits the run lowered itself after running out of memory, as a line of the log:
   * "lowered by the run after out of memory at step 3 (backward): vram_high_watermark_mb 40 → 22". */
  lowered(rec) {
    const changed = rec.changed || {};
    for (const [field, [, now]] of Object.entries(changed)) this.current[field] = now;
    this._showCurrent(Object.keys(changed));
    const failed = this.recoveries.get(rec.step);
    const phase = failed && failed.phase ? ` (${failed.phase})` : "";
    const changes = Object.entries(changed).map(([f, [a, b]]) => `${f} ${a} → ${b}`).join(", ");
    this.log.prepend(h("li", { class: "run-change", "data-request-id": "oom", "data-step": String(rec.step) },
      `lowered by the run after out of memory at step ${rec.step ?? "?"}${phase}: ${changes || "no change"}`));
  }

  /** Puts the values in force into the inputs of `fields` (not the one being typed in). */
  _showCurrent(fields) {
    for (const field of fields) {
      const entry = this.inputs.get(field);
      if (entry && document.activeElement !== entry.input) entry.input.value = this.current[field] ?? "";
    }
  }
}

const mb = (v) => (typeof v === "number" ? v.toFixed(2) : "–");
const count = (v) => (typeof v === "number" ? String(v) : "–");

/** "resident blocks A → B, H2D per step X → Y MB; spill per step …; peak …" of a limits_effect. */
export function effectText(rec) {
  const [r0, r1] = rec.resident_blocks || [];
  const [h0, h1] = rec.h2d_mb || [];
  const [s0, s1] = rec.spill_mb || [];
  const [p0, p1] = rec.vram_peak_mb || [];
  const when = rec.settled
    ? `settled by step ${rec.step ?? "?"}`
    : `not settled ${rec.steps_watched} steps after the change: step ${rec.step ?? "?"}'s figures`;
  return `resident blocks ${count(r0)} → ${count(r1)}, H2D per step ${mb(h0)} → ${mb(h1)} MB; `
    + `spill per step ${mb(s0)} → ${mb(s1)} MB; peak ${mb(p0)} → ${mb(p1)} MB (${when})`;
}

function describe(body) {
  return Object.entries(body).map(([k, v]) => `${k}=${v}`).join(", ");
}
