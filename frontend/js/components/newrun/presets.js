// The New run page's preset actions: "Save as new preset" (POST /api/presets: the config being
// edited under the name typed, its own `name` and a description saying where it came from, then
// selected, with a note that says so) and "Delete preset" for a user preset (DELETE
// /api/presets/NAME after a confirm; built-in presets cannot be deleted).

import { api } from "../../api.js";
import { clearErrors, h, showError } from "../../ui.js";
import { overridesOf } from "./request.js";

/** Leaf paths of an overrides object (`data.path`, `max_steps`), for a description. */
function leaves(obj, prefix = "") {
  return Object.entries(obj).flatMap(([key, value]) => {
    const path = prefix ? `${prefix}.${key}` : key;
    return value && typeof value === "object" && !Array.isArray(value) ? leaves(value, path) : [path];
  });
}

export class PresetActions {
  /**
   * @param {object} page the page's parts: `doc` (`{base, config}`), `json` (JsonEditor),
   *   `errors`, `presetSel`, `selected()` (the selected preset as GET /api/presets lists it, or
   *   undefined), `loadPresets(name)` and `showApiError(err, label)` (beside the fields it names)
   */
  constructor(page) {
    this.page = page;
    this.nameInput = h("input", { id: "new-preset-name", type: "text", placeholder: "new preset name" });
    this.saveBtn = h("button", { id: "save-preset", onclick: () => this.save() }, "Save as new preset");
    this.deleteBtn = h("button", { id: "delete-preset", class: "danger", hidden: true, onclick: () => this.remove() }, "Delete preset");
    this.note = h("p", { class: "muted", id: "preset-note", role: "status", hidden: true });
    this.el = h("div", { class: "preset-actions" }, this.nameInput, this.saveBtn, this.deleteBtn);
  }

  /** Holds Save back while `reason` holds (a field marked invalid: its value is not in the
   * config that would be saved); the delete button shows for a user preset only. */
  setBlocked(reason) {
    this.saveBtn.disabled = Boolean(reason);
    this.saveBtn.title = reason || "";
    const preset = this.page.selected();
    this.deleteBtn.hidden = !preset || preset.builtin;
  }

  say(text) {
    this.note.textContent = text;
    this.note.hidden = !text;
  }

  /** The config being edited, as a preset named `name`: its own `name`, and a description of
   * where it came from in place of the preset's (which described that preset, not this one). */
  configFor(name) {
    const { doc, presetSel } = this.page;
    const changed = leaves(overridesOf(doc.base, doc.config)).filter((p) => p !== "name" && p !== "description");
    const from = presetSel.value ? `From preset "${presetSel.value}"` : "Saved from the New run page";
    const description = changed.length ? `${from}, with changes to ${changed.join(", ")}.` : `${from}, unchanged.`;
    return { ...doc.config, name, description: description.slice(0, 2000) };
  }

  async save() {
    const { errors } = this.page;
    clearErrors(errors); // a new attempt: the last one's errors come back if they still hold
    this.say("");
    if (this.saveBtn.disabled || !this.page.json.parse()) return;
    const name = this.nameInput.value.trim();
    if (!name) {
      showError(errors, new Error("give the new preset a name"), "save preset");
      return;
    }
    try {
      const config = this.configFor(name);
      const saved = await api.createPreset(name, config, config.description);
      await this.page.loadPresets(saved.name || name);
      this.nameInput.value = "";
      this.say(`Saved preset "${saved.name || name}"; it is selected. Runs started now use it.`);
    } catch (err) {
      this.page.showApiError(err, "save preset");
    }
  }

  async remove() {
    const { errors } = this.page;
    const preset = this.page.selected();
    if (!preset || preset.builtin) return;
    if (!window.confirm(`Delete preset "${preset.name}"? Runs made from it keep their config.`)) return;
    clearErrors(errors);
    try {
      await api.deletePreset(preset.name);
      await this.page.loadPresets(null);
      this.say(`Deleted preset "${preset.name}".`);
    } catch (err) {
      showError(errors, err, "delete preset");
    }
  }
}
