// The New run page's key fields: a form over the most used values of the config being edited
// (`doc.config`), each input bound to one JSON path; a change goes into the config at once.

import { getPath, h, setPath, splitPath } from "../../ui.js";

const SH = "memory.stagehand";
const AS = `${SH}.activation_stagehand`;

// Each form field binds to the first of `paths` present in the preset (the seeds spell the
// LoRA rank two ways; a model is a folder or a factory). A `limit` field is a LiveLimits field:
// its path comes from the API (GET /api/limits/fields, contract/limits.py).
const FIELDS = [
  { id: "model", label: "Model (folder or factory)", paths: ["model.path", "model.factory"], type: "text" },
  { id: "max_steps", label: "Steps", paths: ["max_steps"], type: "int" },
  { id: "learning_rate", label: "Learning rate", paths: ["learning_rate"], type: "float" },
  { id: "resolution", label: "Resolution (px)", paths: ["resolution"], type: "int" },
  { id: "lora_rank", label: "LoRA rank", paths: ["lora_rank", "adapter.rank"], type: "int" },
  { id: "strategy", label: "Memory strategy", paths: ["memory.strategy"], type: "select", options: ["none", "stagehand", "layer_offload"] },
  { id: "vram_high_watermark_mb", label: "VRAM high watermark (MB or auto)", limit: true, type: "watermark" },
  { id: "vram_low_watermark_mb", label: "VRAM low watermark (MB or auto)", limit: true, type: "watermark" },
  { id: "prefetch_window_blocks", label: "Prefetch window (blocks)", limit: true, type: "int" },
  { id: "max_inflight_transfers", label: "In-flight block H2D copies", limit: true, type: "int" },
  // SquareQ (README "Frozen weights in 8 bits"): blank removes the whole `squareq` section.
  { id: "squareq_format", label: "8-bit frozen weights (~0.5x bytes)", paths: [`${SH}.squareq.format`], type: "select", options: ["", "int8", "fp8_e4m3"], section: `${SH}.squareq` },
  { id: "activation_enabled", label: "Activation spill", paths: [`${AS}.enabled`], type: "bool" },
  { id: "activation_vram_high_watermark_mb", label: "Spill high watermark (MB or auto)", limit: true, type: "watermark" },
  { id: "activation_vram_low_watermark_mb", label: "Spill low watermark (MB or auto)", limit: true, type: "watermark" },
  { id: "max_inflight_d2h", label: "Spill in-flight D2H", limit: true, type: "int" },
  { id: "max_inflight_h2d", label: "Restore in-flight H2D", limit: true, type: "int" },
  { id: "pinned_pool_classes_mb", label: "Spill pool classes (MB, comma separated)", paths: [`${AS}.pinned_pool_classes_mb`], type: "list" },
];

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
  if (field.type === "int") {
    if (!/^-?\d+$/.test(raw)) throw new Error(`expected a whole number, got "${raw}"`);
    return Number(raw);
  }
  // A watermark is MB or "auto" (README "Watermarks": the budget from the card, issue 33).
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
   * @param {function(string): void} onChange called with a field's path once its value went
   *   into `doc.config`
   */
  constructor(doc, onChange) {
    this.doc = doc;
    this.onChange = onChange;
    this.bound = new Map(); // field id -> JSON path
    this.limitPaths = {}; // LiveLimits field -> config path (GET /api/limits/fields)
    this.inputs = new Map();
    this.el = h("div", { class: "form-grid", id: "run-form" });
    for (const field of FIELDS) {
      let input;
      if (field.type === "select") input = h("select", {}, field.options.map((o) => h("option", { value: o }, o || "off")));
      else if (field.type === "bool") input = h("input", { type: "checkbox" });
      else input = h("input", { type: "text", placeholder: "default", inputmode: ["text", "list", "watermark"].includes(field.type) ? "text" : "decimal" });
      input.id = `field-${field.id}`;
      input.addEventListener(field.type === "bool" || field.type === "select" ? "change" : "input", () => this.read(field));
      const err = h("div", { class: "field-error", id: `error-${field.id}` });
      this.inputs.set(field.id, { input, err });
      this.el.append(h("label", { class: "field", for: input.id, "data-field": field.id },
        h("span", { class: "label" }, field.label), input, h("code", { class: "path" }), err));
    }
  }

  pathsOf(field) {
    return field.limit ? [this.limitPaths[field.id]] : field.paths;
  }

  /** Binds each field to the first of its paths present in the config. */
  bind() {
    for (const field of FIELDS) {
      const paths = this.pathsOf(field);
      const path = paths.find((p) => getPath(this.doc.config, p) != null) || paths[0];
      this.bound.set(field.id, path);
      const label = this.inputs.get(field.id).input.closest("label").querySelector(".path");
      label.textContent = path;
      label.title = path;
    }
  }

  /** Puts the config's values into the inputs. */
  show() {
    for (const field of FIELDS) {
      const { input } = this.inputs.get(field.id);
      const value = getPath(this.doc.config, this.bound.get(field.id));
      if (field.type === "bool") input.checked = value === true;
      else if (field.type === "list") input.value = Array.isArray(value) ? value.join(", ") : "";
      else input.value = value === undefined || value === null ? "" : String(value);
    }
  }

  /** `field`'s input into the config, or its error beside it. */
  read(field) {
    const { input, err } = this.inputs.get(field.id);
    const path = this.bound.get(field.id);
    try {
      const value = parseField(field, input);
      if (value === undefined) deletePath(this.doc.config, field.section || path);
      else setPath(this.doc.config, path, value);
      err.textContent = "";
      input.classList.remove("invalid");
      this.onChange(path);
    } catch (exc) {
      err.textContent = exc.message;
      input.classList.add("invalid");
    }
  }

  clear() {
    for (const { err, input } of this.inputs.values()) {
      err.textContent = "";
      input.classList.remove("invalid");
    }
  }

  /** Shows `message` beside the field bound to `path` (or, for a section's path, its first
   * field: a model-level check such as the watermark order names the section); false when no
   * field shows it. */
  place(path, message) {
    let target = FIELDS.find((f) => this.bound.get(f.id) === path);
    if (!target) target = FIELDS.find((f) => path && this.bound.get(f.id).startsWith(`${path}.`));
    if (!target) return false;
    const { err, input } = this.inputs.get(target.id);
    err.textContent = message;
    input.classList.add("invalid");
    return true;
  }
}
