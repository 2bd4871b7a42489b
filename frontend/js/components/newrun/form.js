// The New run page's key fields: a form over the most used values of the config being edited
// (`doc.config`), each input bound to one JSON path; a change goes into the config at once, a
// value that does not parse stays out of it and marks the field invalid (`invalid()`), which
// holds Start back. A folder field is the run's own model or data: naming one where the preset
// names none drops the preset's fields bound to it (`useFolder`), as the server does. The
// server's errors (its checks as fields change, a 422 of Start, Plan or Save) show beside the
// fields they name (`setChecked`, `place`); one whose value changes loses its error at once.

import { SQUAREQ_FORMATS, STRATEGIES } from "../../contract.js";
import { limitFields } from "../../limitfields.js";
import { getPath, h, setPath, splitPath } from "../../ui.js";

const SH = "memory.stagehand";
const AS = `${SH}.activation_stagehand`;

// Each form field binds to the first of `paths` present in the preset (the seeds spell the
// LoRA rank two ways; a model is a folder or a factory). A select's options and the live-limit
// fields come from the server (/static/js/contract.js): a field with `limits` is followed by
// the LiveLimits fields of that config section (runtime/stagehand/config/limits.py).
const KEY_FIELDS = [
  { id: "model", label: "Model folder (a diffusers pipeline; empty: the preset's model)", paths: ["model.path"], type: "folder", wide: true },
  { id: "data", label: "Data folder (images with .txt captions; empty: the preset's data)", paths: ["data.path"], type: "folder", wide: true },
  { id: "prompts", label: "Sample prompts (one a line; empty: no samples)", paths: ["samples.prompts"], type: "lines", wide: true },
  { id: "max_steps", label: "Steps", paths: ["max_steps"], type: "int" },
  { id: "learning_rate", label: "Learning rate", paths: ["learning_rate"], type: "float" },
  { id: "resolution", label: "Resolution (px)", paths: ["resolution"], type: "int" },
  { id: "lora_rank", label: "LoRA rank", paths: ["lora_rank", "adapter.rank"], type: "int" },
  { id: "strategy", label: "Memory strategy", paths: ["memory.strategy"], type: "select", options: STRATEGIES, limits: SH },
  // SquareQ (README "Frozen weights in 8 bits"): blank removes the whole `squareq` section.
  { id: "squareq_format", label: "8-bit frozen weights (~0.5x bytes)", paths: [`${SH}.squareq.format`], type: "select", options: ["", ...SQUAREQ_FORMATS], section: `${SH}.squareq` },
  { id: "activation_enabled", label: "Activation spill", paths: [`${AS}.enabled`], type: "bool", limits: AS },
  { id: "pinned_pool_classes_mb", label: "Spill pool classes (MB, comma separated)", paths: [`${AS}.pinned_pool_classes_mb`], type: "list" },
];

/** A live limit as a form field: a watermark takes MB or "auto" (README "Watermarks"), the
 * others whole numbers. */
function limitField({ field, path, label, int }) {
  return int
    ? { id: field, label, paths: [path], type: "int" }
    : { id: field, label: label.replace("(MB)", "(MB or auto)"), paths: [path], type: "watermark" };
}

const section = (path) => path.slice(0, path.lastIndexOf("."));
const LIMITS = limitFields();
const FIELDS = KEY_FIELDS.flatMap((field) =>
  [field, ...LIMITS.filter((l) => field.limits && section(l.path) === field.limits).map(limitField)]);
// A live limit of a section no field names is shown last, not left out.
FIELDS.push(...LIMITS.filter((l) => !FIELDS.some((f) => f.id === l.field)).map(limitField));

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

function deletePath(obj, path) {
  const keys = splitPath(path);
  const parent = getPath(obj, keys.slice(0, -1).join("."));
  if (parent && typeof parent === "object") delete parent[keys[keys.length - 1]];
}

/** Form text -> JSON value; throws with what was expected. */
function parseField(field, el) {
  const raw = field.type === "bool" ? el.checked : el.value.trim();
  if (field.type === "bool") return raw;
  if (raw === "") return undefined;
  if (field.type === "lines") return raw.split("\n").map((line) => line.trim()).filter(Boolean);
  if (field.type === "int") {
    if (!/^-?\d+$/.test(raw)) throw new Error(`expected a whole number, got "${raw}"`);
    return Number(raw);
  }
  // A watermark is MB or "auto" (README "Watermarks": the budget from the card).
  if (field.type === "watermark" && raw === "auto") return raw;
  if (field.type === "float" || field.type === "watermark") {
    const v = Number(raw);
    if (!Number.isFinite(v)) throw new Error(`expected a number${field.type === "watermark" ? ' or "auto"' : ""}, got "${raw}"`);
    return v;
  }
  if (field.type === "list") {
    const parts = raw.split(",").map((p) => p.trim()).filter(Boolean);
    const nums = parts.map(Number);
    if (nums.some((n) => !Number.isFinite(n))) throw new Error(`expected numbers separated by commas, got "${raw}"`);
    return nums;
  }
  return raw;
}

export class KeyFieldsForm {
  /**
   * @param {object} doc the page's `{config}`: the config being edited
   * @param {function(string, string): void} onChange called with a field's path once its value
   *   went into `doc.config`, and how: "typed" (a keystroke), "typing" (a keystroke in a folder
   *   field: not left yet), "left" (a folder field left with its new value), "set" (a select or
   *   a checkbox)
   */
  constructor(doc, onChange) {
    this.doc = doc;
    this.onChange = onChange;
    this.checked = new Map(); // field id -> the server's error shown beside it
    this.unplaced = []; // the server's {field, message} naming no field of the form
    this.bound = new Map(); // field id -> JSON path
    this.folderFields = {}; // folder path -> the preset fields it drops (GET /api/overrides/folders)
    this.inputs = new Map();
    this.invalid = new Map(); // field id -> label, for the fields whose text did not parse
    this.el = h("div", { class: "form-grid", id: "run-form" });
    for (const field of FIELDS) {
      let input;
      if (field.type === "select") input = h("select", {}, field.options.map((o) => h("option", { value: o }, o || "off")));
      else if (field.type === "bool") input = h("input", { type: "checkbox" });
      else if (field.type === "lines") input = h("textarea", { rows: 3, placeholder: "a photo of sks dog on a beach" });
      else if (field.type === "folder") input = h("input", { type: "text", placeholder: "/path/to/folder", spellcheck: "false" });
      else input = h("input", { type: "text", placeholder: "default", inputmode: ["text", "list", "watermark"].includes(field.type) ? "text" : "decimal" });
      input.id = `field-${field.id}`;
      const set = field.type === "bool" || field.type === "select";
      const how = set ? "set" : field.type === "folder" ? "typing" : "typed";
      input.addEventListener(set ? "change" : "input", () => this.read(field, how));
      if (field.type === "folder") input.addEventListener("change", () => this.onChange(this.bound.get(field.id), "left"));
      const err = h("div", { class: "field-error", id: `error-${field.id}` });
      this.inputs.set(field.id, { input, err });
      this.el.append(h("label", { class: field.wide ? "field wide" : "field", for: input.id, "data-field": field.id },
        h("span", { class: "label" }, field.label), input, h("code", { class: "path" }), err));
    }
  }

  /** Binds each field to the first of its paths present in the config. */
  bind() {
    for (const field of FIELDS) {
      const path = field.paths.find((p) => getPath(this.doc.config, p) != null) || field.paths[0];
      this.bound.set(field.id, path);
      const label = this.inputs.get(field.id).input.closest("label").querySelector(".path");
      label.textContent = path;
      label.title = path;
    }
  }

  /** Puts the config's values into the inputs, and takes the invalid marks away: the config is
   * the truth again. `except`: a field left as typed (the one being typed in); `keepInvalid`:
   * fields whose text did not parse keep it (a folder changed other fields, not those). */
  show({ except = null, keepInvalid = false } = {}) {
    for (const field of FIELDS) {
      if (field.id === except || (keepInvalid && this.invalid.has(field.id))) continue;
      const { input, err } = this.inputs.get(field.id);
      const value = getPath(this.doc.config, this.bound.get(field.id));
      const was = field.type === "bool" ? input.checked : input.value;
      if (field.type === "bool") input.checked = value === true;
      else if (field.type === "list") input.value = Array.isArray(value) ? value.join(", ") : "";
      else if (field.type === "lines") input.value = Array.isArray(value) ? value.join("\n") : "";
      else input.value = value === undefined || value === null ? "" : String(value);
      // A new value ("Use this folder", another preset): the error about the old one is gone.
      if (was !== (field.type === "bool" ? input.checked : input.value)) this.unmark(field.id);
      if (this.invalid.delete(field.id)) {
        err.textContent = "";
        input.classList.remove("invalid");
      }
    }
  }

  /** The labels of the fields whose text did not parse (their last good value is still in the
   * config: a run must not start with it). */
  invalidLabels() {
    return [...this.invalid.values()];
  }

  /** `value` (a folder, or "" for none) into the config at `path` (model.path, data.path). Where
   * the preset names no folder there, the fields it binds to its own model or data (a factory,
   * its size, the data limit and caption length, the digit prompts) leave the config while they
   * hold the preset's value, and come back when the folder is cleared. */
  useFolder(path, value) {
    const { base, config } = this.doc;
    if (value) setPath(config, path, value);
    else deletePath(config, path);
    if (getPath(base, path) != null) return;
    for (const key of this.folderFields[path] || []) {
      const ours = getPath(base, key);
      if (value && ours !== undefined && same(getPath(config, key), ours)) deletePath(config, key);
      else if (!value && ours !== undefined && getPath(config, key) === undefined) setPath(config, key, structuredClone(ours));
    }
  }

  /** `field`'s input into the config, or its error beside it; `how` goes to `onChange`. */
  read(field, how = "typed") {
    const { input, err } = this.inputs.get(field.id);
    const path = this.bound.get(field.id);
    try {
      const value = parseField(field, input);
      if (field.type === "folder") {
        this.useFolder(path, value || "");
        this.show({ except: field.id, keepInvalid: true }); // the fields it dropped or put back
      } else if (value === undefined) deletePath(this.doc.config, field.section || path);
      else setPath(this.doc.config, path, value);
      err.textContent = "";
      input.classList.remove("invalid");
      this.invalid.delete(field.id);
      this.checked.delete(field.id);
      this.onChange(path, how);
    } catch (exc) {
      err.textContent = exc.message;
      input.classList.add("invalid");
      this.invalid.set(field.id, field.label);
    }
  }

  /** Takes away the server's errors shown beside the fields; a field whose text did not parse
   * keeps its own. */
  clear() {
    for (const id of this.inputs.keys()) this.unmark(id);
    this.checked.clear();
    this.unplaced = [];
  }

  /** Takes the server's error away from field `id` (one whose text did not parse keeps its own). */
  unmark(id) {
    this.checked.delete(id);
    if (this.invalid.has(id)) return;
    const { err, input } = this.inputs.get(id);
    err.textContent = "";
    input.classList.remove("invalid");
  }

  /** The server's problems of the request as it stands (POST /api/runs/check), each beside its
   * field, in place of those shown before; those naming no field of the form are `unplaced`. */
  setChecked(problems) {
    this.clear();
    for (const { field, message } of problems) {
      if (!this.place(field, message)) this.unplaced.push({ field, message });
    }
  }

  /** The labels of the fields the server's errors hold back, then the paths of those naming no
   * field (a rule of the JSON config). */
  checkedLabels() {
    const labels = FIELDS.filter((f) => this.checked.has(f.id) && !this.invalid.has(f.id)).map((f) => f.label);
    return [...labels, ...this.unplaced.map((p) => p.field)];
  }

  /** The field that shows problems of `path` (as `place` takes it), or undefined. */
  target(path) {
    path = String(path || "").replace(/^(overrides|config|preset)\.?/, "");
    return FIELDS.find((f) => this.bound.get(f.id) === path)
      || FIELDS.find((f) => path && this.bound.get(f.id).startsWith(`${path}.`));
  }

  canPlace(path) {
    return Boolean(this.target(path));
  }

  /** Shows `message` beside the field bound to `path` (a JSON path of a request: `overrides.`,
   * `config.` or `preset.` first is dropped; a section's path goes to its first field: a
   * model-level check such as the watermark order names the section) and, unless `block` is
   * false (a Plan's own rule, not the run's), holds the buttons back until the field changes;
   * false when no field shows it. A field whose text did not parse keeps its own message. */
  place(path, message, block = true) {
    const target = this.target(path);
    if (!target) return false;
    if (this.invalid.has(target.id)) return true;
    const { err, input } = this.inputs.get(target.id);
    const text = String(message).replace(/^[\w.[\]]+: /, ""); // the field is named by its label
    const shown = this.checked.get(target.id);
    err.textContent = shown && shown !== text ? `${shown}; ${text}` : text;
    input.classList.add("invalid");
    if (block) this.checked.set(target.id, err.textContent);
    return true;
  }
}
