// The New run page's run request: what the edited config becomes (the preset and the changes
// as `overrides`, a value of the preset removed as null), the data scan before Start
// (POST /api/data/scan: a run that would fail on it does not start; files left out or caption
// warnings are shown once before "Start anyway") and Start. Nothing is sent while the page
// holds a value it marked invalid (`setBlocked`). API validation errors are shown beside the
// form field their `field` JSON path names, every one of them.

import { api } from "../../api.js";
import { noteworthy, scanView } from "../../scan.js";
import { clearErrors, deepDiff, fill, h, showError } from "../../ui.js";

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

/** The changes from `base` to `config` as overrides: what `config` adds or replaces, and null
 * for what it removed (the server removes a key given as null: the field's default applies). */
export function overridesOf(base, config) {
  const out = deepDiff(base, config);
  for (const [key, value] of Object.entries(base || {})) {
    const now = config ? config[key] : undefined;
    if (now === undefined) {
      if (value !== null) out[key] = null;
    } else if (isObject(value) && isObject(now)) {
      const inner = overridesOf(value, now);
      if (Object.keys(inner).length) out[key] = { ...(out[key] || {}), ...inner };
    }
  }
  return out;
}

export class RunRequest {
  /**
   * @param {object} page the page's parts: `doc` (`{base, config}`), `form` (KeyFieldsForm),
   *   `json` (JsonEditor), `errors`, `presetSel`, `nameInput`, `deviceSel`, `checks`
   *   (FieldChecks: a check scheduled is dropped when the request is sent) and `gate()` (what
   *   holds Start back: fields marked invalid or refused by the server, the demo assets)
   */
  constructor(page) {
    this.page = page;
    this.startBtn = h("button", { id: "start-run", class: "primary", onclick: () => this.start() }, "Start run");
    this.scanBtn = h("button", { id: "scan-data", onclick: () => this.scanData() }, "Check data");
    this.scanBox = h("div", { class: "scan-box", id: "data-scan", hidden: true });
    this.shownScan = null; // the request (JSON) whose scan the user has seen
    this.blocked = null; // why nothing may be sent (fields the page marked invalid), or null
    this.busy = false;
  }

  /** Holds Start and Check data back while `reason` (a sentence) holds; null lets them go. */
  setBlocked(reason) {
    this.blocked = reason;
    this.startBtn.disabled = this.busy || Boolean(reason);
    this.scanBtn.disabled = Boolean(reason);
    for (const btn of [this.startBtn, this.scanBtn]) btn.title = reason || "";
  }

  clearFieldErrors() {
    const { doc, presetSel, form, json } = this.page;
    if (this.shownScan !== JSON.stringify([presetSel.value, overridesOf(doc.base, doc.config)])) {
      // The scan on show was of another run request: take it away with its "Start anyway".
      this.startBtn.textContent = "Start run";
      delete this.startBtn.dataset.confirm;
      fill(this.scanBox);
      this.scanBox.hidden = true;
      this.shownScan = null;
    }
    form.clear();
    json.error.textContent = "";
  }

  /** Puts an API error next to the fields it names (`field` and each `details[].field`), and in
   * a box above under `prefix`. */
  showApiError(err, prefix) {
    const named = [{ field: err.field, message: err.message }, ...err.details.filter((d) => d && d.field)];
    let placed = false;
    for (const { field, message } of named) {
      if (!field) continue;
      placed = this.page.form.place(field, message) || placed;
    }
    if (!placed || err.field === null) this.page.json.error.textContent = err.describe();
    showError(this.page.errors, err, prefix);
  }

  /** Puts a Plan's 422 beside the fields it names, in no box: its message lists each problem
   * as `path: what` (`; ` between them), as the planner words them. Such an error does not hold
   * Start back (the plan's rules are not the run's). False (nothing placed) when a problem
   * names no field of the form: the caller shows the error whole. */
  placePlanError(err) {
    if (err.status !== 422 || !err.field) return false;
    const parts = String(err.message).split(/; (?=[\w.[\]]+: )/).map((part) => /^([\w.[\]]+): ([\s\S]*)$/.exec(part));
    if (parts.some((m) => !m || !this.page.form.canPlace(m[1]))) return false;
    for (const [, field, message] of parts) this.page.form.place(field, message, false);
    this.page.gate();
    return true;
  }

  body() {
    const { doc, presetSel, nameInput, deviceSel } = this.page;
    const body = { preset: presetSel.value, overrides: overridesOf(doc.base, doc.config) };
    if (nameInput.value.trim()) body.name = nameInput.value.trim();
    if (deviceSel.value !== "auto") body.device = deviceSel.value;
    return body;
  }

  /** Why the form cannot become a run request (a field marked invalid, or no preset) as an
   * error; null when it can. */
  problem() {
    const { presetSel } = this.page;
    const message = this.blocked || (presetSel.value ? null : "pick a preset, or save this config as a new preset and start that");
    return message ? { field: null, message, details: [], describe: () => message } : null;
  }

  /** The run request Tune's trials start from, or null (the problem shown beside its field)
   * when the form cannot become one (`problem`). */
  forTune() {
    if (this.blocked) return null;
    this.clearFieldErrors();
    const problem = this.problem();
    if (problem) {
      this.showApiError(problem, "tune");
      return null;
    }
    return this.body();
  }

  /** Scans the data of `body`'s run and shows it; the scan, or null on an API error (shown
   * under `label`: what the user asked for, Check data or Start). */
  async scanData(body = null, label = "check data") {
    if (this.blocked) return null;
    this.page.checks.cancel(); // the scan's answer says the same of this request
    this.clearFieldErrors();
    if (!body) {
      clearErrors(this.page.errors);
      if (!this.page.json.parse()) return null;
      const problem = this.problem();
      if (problem) {
        this.showApiError(problem, label);
        return null;
      }
      body = this.body();
    }
    const { startBtn, scanBox } = this;
    try {
      const scan = await api.scanData({ preset: body.preset, overrides: body.overrides });
      clearErrors(this.page.errors, label);
      // Files left out or warned about: the next Start goes ahead, now that they were shown.
      const confirm = !scan.problem && noteworthy(scan);
      fill(scanBox, h("h2", {}, "Data"), scanView(scan, { open: confirm }),
        confirm ? h("p", { class: "muted", id: "scan-confirm" }, `Start anyway trains on the ${scan.usable} usable samples and leaves the files above out.`) : null);
      scanBox.hidden = false;
      this.shownScan = JSON.stringify([body.preset, body.overrides]);
      startBtn.textContent = confirm ? "Start anyway" : "Start run";
      if (confirm) startBtn.dataset.confirm = "1";
      else delete startBtn.dataset.confirm;
      return scan;
    } catch (err) {
      this.showApiError(err, label);
      return null;
    }
  }

  async start() {
    if (this.blocked) return;
    this.page.checks.cancel(); // Start's answer says the same of this request
    this.clearFieldErrors();
    clearErrors(this.page.errors); // a new attempt: the last one's errors come back if they still hold
    if (!this.page.json.parse()) return;
    const problem = this.problem();
    if (problem) {
      this.showApiError(problem, "start run");
      return;
    }
    const body = this.body();
    const seen = this.shownScan === JSON.stringify([body.preset, body.overrides]);
    const startBtn = this.startBtn;
    this.busy = true;
    startBtn.disabled = true;
    try {
      if (!seen || startBtn.dataset.confirm !== "1") {
        const scan = await this.scanData(body, "start run");
        // Stop when the run would fail on its data, or to show what it leaves out.
        if (!scan || scan.problem || noteworthy(scan)) return;
      }
      const run = await api.createRun(body);
      location.hash = `#/runs/${run.id}`;
    } catch (err) {
      this.showApiError(err, "start run");
    } finally {
      this.busy = false;
      this.page.gate();
    }
  }
}
