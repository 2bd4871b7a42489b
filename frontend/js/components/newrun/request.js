// The New run page's run request: what the edited config becomes (the preset and the changes
// as `overrides`), why it cannot (a value of the preset removed), the data scan before Start
// (POST /api/data/scan: a run that would fail on it does not start; files left out or caption
// warnings are shown once before "Start anyway"), Start and "Save as new preset". API
// validation errors are shown beside the form field their `field` JSON path names.

import { api } from "../../api.js";
import { noteworthy, scanView } from "../../scan.js";
import { clearErrors, deepDiff, fill, h, showError } from "../../ui.js";

/** Paths of values `base` holds that `config` no longer has: overrides only add or replace
 * (the server merges them into the preset), so a run would still get these. */
function removedPaths(base, config, prefix = "") {
  return Object.entries(base || {}).flatMap(([key, value]) => {
    const path = prefix ? `${prefix}.${key}` : key;
    const now = config ? config[key] : undefined;
    if (now === undefined) return value === null ? [] : [path]; // null: as if not set
    const nested = value && typeof value === "object" && !Array.isArray(value) && now && typeof now === "object" && !Array.isArray(now);
    return nested ? removedPaths(value, now, path) : [];
  });
}

export class RunRequest {
  /**
   * @param {object} page the page's parts: `doc` (`{base, config}`), `form` (KeyFieldsForm),
   *   `json` (JsonEditor), `errors`, `presetSel`, `nameInput`, `deviceSel`, `presetName`,
   *   `gate()` (the asset note) and `loadPresets(name)`
   */
  constructor(page) {
    this.page = page;
    this.startBtn = h("button", { id: "start-run", class: "primary", onclick: () => this.start() }, "Start run");
    this.scanBtn = h("button", { id: "scan-data", onclick: () => this.scanData() }, "Check data");
    this.saveBtn = h("button", { id: "save-preset", onclick: () => this.savePreset() }, "Save as new preset");
    this.scanBox = h("div", { class: "scan-box", id: "data-scan", hidden: true });
    this.shownScan = null; // the request (JSON) whose scan the user has seen
  }

  clearFieldErrors() {
    const { doc, presetSel, form, json } = this.page;
    if (this.shownScan !== JSON.stringify([presetSel.value, deepDiff(doc.base, doc.config)])) {
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

  /** Puts an API error next to the fields it names (`field` and each `details[].field`). */
  showApiError(err, prefix) {
    const named = [{ field: err.field, message: err.message }, ...err.details.filter((d) => d && d.field)];
    let placed = false;
    for (const { field, message } of named) {
      if (!field) continue;
      placed = this.page.form.place(field.replace(/^(overrides|config)\.?/, ""), message) || placed;
    }
    if (!placed || err.field === null) this.page.json.error.textContent = err.describe();
    showError(this.page.errors, err, prefix);
  }

  body() {
    const { doc, presetSel, nameInput, deviceSel } = this.page;
    const body = { preset: presetSel.value, overrides: deepDiff(doc.base, doc.config) };
    if (nameInput.value.trim()) body.name = nameInput.value.trim();
    if (deviceSel.value !== "auto") body.device = deviceSel.value;
    return body;
  }

  /** Why the form cannot become a run request (no preset, or a value of the preset removed,
   * which overrides cannot do) as an error naming the field, shown beside it; null when it can. */
  problem() {
    const { doc, presetSel } = this.page;
    if (!presetSel.value) {
      return { field: null, message: "pick a preset, or save this config as a new preset and start that", details: [], describe() { return this.message; } };
    }
    const [path] = removedPaths(doc.base, doc.config);
    if (!path) return null;
    const message = `${path}: preset "${presetSel.value}" sets it and a run's changes cannot remove it; give it a value, or save this config as a new preset and start that`;
    return { field: `overrides.${path}`, message, details: [], describe: () => message };
  }

  /** The run request Tune's trials start from, or null (the problem shown beside its field)
   * when the form cannot become one (`problem`). */
  forTune() {
    this.clearFieldErrors();
    const problem = this.problem();
    if (problem) {
      this.showApiError(problem, "tune");
      return null;
    }
    return this.body();
  }

  /** Scans the data of `body`'s run and shows it; the scan, or null on an API error. */
  async scanData(body = null) {
    this.clearFieldErrors();
    if (!body) {
      clearErrors(this.page.errors);
      if (!this.page.json.parse()) return null;
      const problem = this.problem();
      if (problem) {
        this.showApiError(problem, "check data");
        return null;
      }
      body = this.body();
    }
    const { startBtn, scanBox } = this;
    try {
      const scan = await api.scanData({ preset: body.preset, overrides: body.overrides });
      clearErrors(this.page.errors, "check data");
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
      this.showApiError(err, "check data");
      return null;
    }
  }

  async start() {
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
    startBtn.disabled = true;
    try {
      if (!seen || startBtn.dataset.confirm !== "1") {
        const scan = await this.scanData(body);
        // Stop when the run would fail on its data, or to show what it leaves out.
        if (!scan || scan.problem || noteworthy(scan)) return;
      }
      const run = await api.createRun(body);
      location.hash = `#/runs/${run.id}`;
    } catch (err) {
      this.showApiError(err, "start run");
    } finally {
      startBtn.disabled = false;
      this.page.gate();
    }
  }

  async savePreset() {
    const { errors, presetName, doc } = this.page;
    this.clearFieldErrors();
    clearErrors(errors); // a new attempt: the last one's errors come back if they still hold
    if (!this.page.json.parse()) return;
    const name = presetName.value.trim();
    if (!name) {
      showError(errors, new Error("give the new preset a name"), "save preset");
      return;
    }
    try {
      const saved = await api.createPreset(name, doc.config);
      await this.page.loadPresets(saved.name || name);
    } catch (err) {
      this.showApiError(err, "save preset");
    }
  }
}
