// New run page: pick a preset, edit its key fields as a form or the whole JSON, then Start
// (POST /api/runs with the changes as `overrides`) or save as a new preset. `#/new?from=ID`
// opens it prefilled from a past run ("Re-run with changes", with the live limits the run ended
// with, not those it started with); `#/new?preset=NAME` selects one.
// API validation errors are shown beside the form field their `field` JSON path names.
// Start scans the data first (POST /api/data/scan): a run that would fail on it does not start,
// and files left out or caption warnings are shown once before "Start anyway". "Plan" (plan.js)
// predicts VRAM and step time of the config on a device profile before Start.

import { api } from "../api.js";
import { onAssets } from "../assets.js";
import { noteworthy, scanView } from "../scan.js";
import { clearErrors, deepDiff, fill, getPath, h, setPath, showError, splitPath } from "../ui.js";
import { planPanel } from "../plan.js";
import { pipelinePanel } from "../components/panels/pipeline.js";

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
  { id: "vram_high_watermark_mb", label: "VRAM high watermark (MB)", limit: true, type: "float" },
  { id: "vram_low_watermark_mb", label: "VRAM low watermark (MB)", limit: true, type: "float" },
  { id: "prefetch_window_blocks", label: "Prefetch window (blocks)", limit: true, type: "int" },
  { id: "max_inflight_transfers", label: "In-flight block H2D copies", limit: true, type: "int" },
  // SquareQ (README "Frozen weights in 8 bits"): blank removes the whole `squareq` section.
  { id: "squareq_format", label: "8-bit frozen weights (~0.5x bytes)", paths: [`${SH}.squareq.format`], type: "select", options: ["", "int8", "fp8_e4m3"], section: `${SH}.squareq` },
  { id: "activation_enabled", label: "Activation spill", paths: [`${AS}.enabled`], type: "bool" },
  { id: "activation_vram_high_watermark_mb", label: "Spill high watermark (MB)", limit: true, type: "float" },
  { id: "activation_vram_low_watermark_mb", label: "Spill low watermark (MB)", limit: true, type: "float" },
  { id: "max_inflight_d2h", label: "Spill in-flight D2H", limit: true, type: "int" },
  { id: "max_inflight_h2d", label: "Restore in-flight H2D", limit: true, type: "int" },
  { id: "pinned_pool_classes_mb", label: "Spill pool classes (MB, comma separated)", paths: [`${AS}.pinned_pool_classes_mb`], type: "list" },
];

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
  if (field.type === "float") {
    const v = Number(raw);
    if (!Number.isFinite(v)) throw new Error(`expected a number, got "${raw}"`);
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

export function mount(root, { params }) {
  let presets = [];
  let base = {}; // the selected preset's config
  let config = {}; // what the user edits
  const bound = new Map(); // field id -> JSON path
  let limitPaths = {}; // LiveLimits field -> config path (GET /api/limits/fields)
  const pathsOf = (field) => (field.limit ? [limitPaths[field.id]] : field.paths);
  const errors = h("div", { class: "page-errors" });
  const presetSel = h("select", { id: "preset-select", onchange: () => selectPreset(presetSel.value) });
  const nameInput = h("input", { id: "run-name", type: "text", placeholder: "run name (optional)" });
  // The worker's device (POST /api/runs "device"); runs on one device share its --max-parallel slots.
  const deviceSel = h("select", { id: "run-device", title: "the device the run's worker trains on" },
    h("option", { value: "auto" }, "auto (CUDA if present)"), h("option", { value: "cpu" }, "cpu"));
  const jsonArea = h("textarea", { id: "config-json", class: "json-editor", spellcheck: "false", rows: 24 });
  const jsonError = h("div", { class: "field-error", id: "config-json-error" });
  const form = h("div", { class: "form-grid", id: "run-form" });
  const presetName = h("input", { id: "new-preset-name", type: "text", placeholder: "new preset name" });
  const startBtn = h("button", { id: "start-run", class: "primary", onclick: start }, "Start run");
  const scanBtn = h("button", { id: "scan-data", onclick: () => scanData() }, "Check data");
  const scanBox = h("div", { class: "scan-box", id: "data-scan", hidden: true });
  let shownScan = null; // the request (JSON) whose scan the user has seen
  const saveBtn = h("button", { id: "save-preset", onclick: savePreset }, "Save as new preset");
  // A preset waiting for the demo-asset build (its model unchanged) cannot start yet: say why.
  const assetNote = h("p", { class: "asset-note", id: "asset-note", role: "status", hidden: true });
  let assets = null;
  const from = params.get("from");
  const title = h("h1", {}, from ? `Re-run ${from} with changes` : "New run");

  const inputs = new Map();
  for (const field of FIELDS) {
    let input;
    if (field.type === "select") input = h("select", {}, field.options.map((o) => h("option", { value: o }, o || "off")));
    else if (field.type === "bool") input = h("input", { type: "checkbox" });
    else input = h("input", { type: "text", placeholder: "default", inputmode: field.type === "text" || field.type === "list" ? "text" : "decimal" });
    input.id = `field-${field.id}`;
    input.addEventListener(field.type === "bool" || field.type === "select" ? "change" : "input", () => fromForm(field));
    const err = h("div", { class: "field-error", id: `error-${field.id}` });
    inputs.set(field.id, { input, err });
    form.append(h("label", { class: "field", for: input.id, "data-field": field.id },
      h("span", { class: "label" }, field.label), input, h("code", { class: "path" }), err));
  }
  jsonArea.addEventListener("input", fromJson);

  root.append(
    h("section", { class: "card" },
      h("div", { class: "toolbar" }, title, h("div", { class: "spacer" }),
        h("label", { class: "inline" }, "Preset ", presetSel),
        h("label", { class: "inline" }, "Device ", deviceSel), nameInput),
      errors,
      pipelinePanel({ onUse: usePipeline }),
      h("div", { class: "two-col" },
        h("div", {}, h("h2", {}, "Key fields"), form),
        h("div", {}, h("h2", {}, "Full config (JSON)"), jsonArea, jsonError)),
      scanBox,
      planPanel({ getConfig: () => (fromJson() ? config : null), getRequest: tuneRequest }),
      assetNote,
      h("div", { class: "toolbar actions-row" }, startBtn, scanBtn, h("div", { class: "spacer" }), presetName, saveBtn)),
  );
  root.addEventListener("input", gate);

  /** Says why the selected preset cannot start while its demo assets build (GET /api/assets
   * blocked_presets; Start is refused by the server with the same reason, 409
   * assets_not_ready); a pipeline folder (another model) lifts it. */
  function gate() {
    const why = assets?.blocked_presets?.[presetSel.value];
    const blocked = Boolean(why) && !("model" in deepDiff(base, config));
    startBtn.classList.toggle("waiting", blocked);
    assetNote.hidden = !blocked;
    assetNote.textContent = blocked ? `This preset cannot start until the demo assets are built: ${why}.` : "";
  }
  const offAssets = onAssets((status) => {
    assets = status;
    gate();
  });

  function clearFieldErrors() {
    if (shownScan !== JSON.stringify([presetSel.value, deepDiff(base, config)])) {
      // The scan on show was of another run request: take it away with its "Start anyway".
      startBtn.textContent = "Start run";
      delete startBtn.dataset.confirm;
      fill(scanBox);
      scanBox.hidden = true;
      shownScan = null;
    }
    for (const { err, input } of inputs.values()) {
      err.textContent = "";
      input.classList.remove("invalid");
    }
    jsonError.textContent = "";
  }

  function bindPaths() {
    for (const field of FIELDS) {
      const paths = pathsOf(field);
      const path = paths.find((p) => getPath(config, p) != null) || paths[0];
      bound.set(field.id, path);
      const label = inputs.get(field.id).input.closest("label").querySelector(".path");
      label.textContent = path;
      label.title = path;
    }
  }

  function toForm() {
    for (const field of FIELDS) {
      const { input } = inputs.get(field.id);
      const value = getPath(config, bound.get(field.id));
      if (field.type === "bool") input.checked = value === true;
      else if (field.type === "list") input.value = Array.isArray(value) ? value.join(", ") : "";
      else input.value = value === undefined || value === null ? "" : String(value);
    }
  }

  function toJson() {
    jsonArea.value = JSON.stringify(config, null, 2);
  }

  function fromForm(field) {
    const { input, err } = inputs.get(field.id);
    try {
      const value = parseField(field, input);
      if (value === undefined) deletePath(config, field.section || bound.get(field.id));
      else setPath(config, bound.get(field.id), value);
      err.textContent = "";
      input.classList.remove("invalid");
      // The value changed: an error that named this field no longer holds until asked again.
      clearErrors(errors, null, bound.get(field.id));
      toJson();
    } catch (exc) {
      err.textContent = exc.message;
      input.classList.add("invalid");
    }
  }

  function fromJson() {
    try {
      const parsed = JSON.parse(jsonArea.value);
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("the config must be a JSON object");
      config = parsed;
      jsonError.textContent = "";
      toForm();
      return true;
    } catch (exc) {
      jsonError.textContent = `JSON: ${exc.message}`;
      return false;
    }
  }

  function load(baseConfig, editConfig) {
    base = structuredClone(baseConfig || {});
    config = structuredClone(editConfig || baseConfig || {});
    clearFieldErrors();
    bindPaths();
    toForm();
    toJson();
    gate();
  }

  /** A pipeline folder replaces the preset's model: model.path set, model.factory and
   *  model.pretrained null, model.expert the chosen one (null for a pipeline with one transformer). */
  function usePipeline(path, expert) {
    setPath(config, "model.path", path);
    setPath(config, "model.factory", null);
    setPath(config, "model.pretrained", null);
    setPath(config, "model.expert", expert);
    bindPaths();
    toForm();
    toJson();
    gate();
  }

  function selectPreset(name) {
    const preset = presets.find((p) => p.name === name);
    if (preset) load(preset.config);
  }

  /** Puts an API error next to the fields it names (`field` and each `details[].field`). */
  function showApiError(err, prefix) {
    const named = [{ field: err.field, message: err.message }, ...err.details.filter((d) => d && d.field)];
    let placed = false;
    for (const { field, message } of named) {
      if (!field) continue;
      const path = field.replace(/^(overrides|config)\.?/, "");
      let target = FIELDS.find((f) => bound.get(f.id) === path);
      // A model-level check (watermark order) names the section: show it on its first field.
      if (!target) target = FIELDS.find((f) => path && bound.get(f.id).startsWith(`${path}.`));
      if (target) {
        const { err: box, input } = inputs.get(target.id);
        box.textContent = message;
        input.classList.add("invalid");
        placed = true;
      }
    }
    if (!placed || err.field === null) jsonError.textContent = err.describe();
    showError(errors, err, prefix);
  }

  function runRequest() {
    const body = { preset: presetSel.value, overrides: deepDiff(base, config) };
    if (nameInput.value.trim()) body.name = nameInput.value.trim();
    if (deviceSel.value !== "auto") body.device = deviceSel.value;
    return body;
  }

  /** Why the form cannot become a run request (no preset, or a value of the preset removed,
   * which overrides cannot do) as an error naming the field, shown beside it; null when it can. */
  function requestProblem() {
    if (!presetSel.value) {
      return { field: null, message: "pick a preset, or save this config as a new preset and start that", details: [], describe() { return this.message; } };
    }
    const [path] = removedPaths(base, config);
    if (!path) return null;
    const message = `${path}: preset "${presetSel.value}" sets it and a run's changes cannot remove it; give it a value, or save this config as a new preset and start that`;
    return { field: `overrides.${path}`, message, details: [], describe: () => message };
  }

  /** The run request Tune's trials start from, or null (the problem shown beside its field)
   * when the form cannot become one (`requestProblem`). */
  function tuneRequest() {
    clearFieldErrors();
    const problem = requestProblem();
    if (problem) {
      showApiError(problem, "tune");
      return null;
    }
    return runRequest();
  }

  /** Scans the data of `body`'s run and shows it; the scan, or null on an API error. */
  async function scanData(body = null) {
    clearFieldErrors();
    if (!body) {
      clearErrors(errors);
      if (!fromJson()) return null;
      const problem = requestProblem();
      if (problem) {
        showApiError(problem, "check data");
        return null;
      }
      body = runRequest();
    }
    try {
      const scan = await api.scanData({ preset: body.preset, overrides: body.overrides });
      clearErrors(errors, "check data");
      // Files left out or warned about: the next Start goes ahead, now that they were shown.
      const confirm = !scan.problem && noteworthy(scan);
      fill(scanBox, h("h2", {}, "Data"), scanView(scan, { open: confirm }),
        confirm ? h("p", { class: "muted", id: "scan-confirm" }, `Start anyway trains on the ${scan.usable} usable samples and leaves the files above out.`) : null);
      scanBox.hidden = false;
      shownScan = JSON.stringify([body.preset, body.overrides]);
      startBtn.textContent = confirm ? "Start anyway" : "Start run";
      if (confirm) startBtn.dataset.confirm = "1";
      else delete startBtn.dataset.confirm;
      return scan;
    } catch (err) {
      showApiError(err, "check data");
      return null;
    }
  }

  async function start() {
    clearFieldErrors();
    clearErrors(errors); // a new attempt: the last one's errors come back if they still hold
    if (!fromJson()) return;
    const problem = requestProblem();
    if (problem) {
      showApiError(problem, "start run");
      return;
    }
    const body = runRequest();
    const seen = shownScan === JSON.stringify([body.preset, body.overrides]);
    startBtn.disabled = true;
    try {
      if (!seen || startBtn.dataset.confirm !== "1") {
        const scan = await scanData(body);
        // Stop when the run would fail on its data, or to show what it leaves out.
        if (!scan || scan.problem || noteworthy(scan)) return;
      }
      const run = await api.createRun(body);
      location.hash = `#/runs/${run.id}`;
    } catch (err) {
      showApiError(err, "start run");
    } finally {
      startBtn.disabled = false;
      gate();
    }
  }

  async function savePreset() {
    clearFieldErrors();
    clearErrors(errors); // a new attempt: the last one's errors come back if they still hold
    if (!fromJson()) return;
    const name = presetName.value.trim();
    if (!name) {
      showError(errors, new Error("give the new preset a name"), "save preset");
      return;
    }
    try {
      const saved = await api.createPreset(name, config);
      await loadPresets(saved.name || name);
    } catch (err) {
      showApiError(err, "save preset");
    }
  }

  async function loadPresets(selectName) {
    const list = await api.presets();
    presets = list.data || [];
    fill(presetSel, presets.map((p) => h("option", { value: p.name }, `${p.name}${p.builtin ? " (built-in)" : ""}`)));
    const has = (n) => n && presets.some((p) => p.name === n);
    // The embedded demo is what a first-time user should start: open on it unless asked otherwise.
    const name = has(selectName) ? selectName : has("default") ? "default" : presets[0]?.name;
    if (name) {
      presetSel.value = name;
      selectPreset(name);
    }
  }

  /** `config` with the live limits the run ended with in place of those it started with. */
  function withLimits(runConfig, limits) {
    const out = structuredClone(runConfig);
    for (const [field, value] of Object.entries(limits.now)) {
      if (limits.preset[field] !== value) setPath(out, limits.paths[field], value);
    }
    return out;
  }

  function limitsNote(limits) {
    const moved = Object.keys(limits.now).filter((f) => limits.preset[f] !== limits.now[f]);
    if (!moved.length) return;
    const text = moved.map((f) => `${f} ${limits.preset[f]} → ${limits.now[f]}`).join(", ");
    title.closest(".toolbar").after(h("p", { class: "muted", id: "rerun-limits" },
      `Filled in with the live limits run ${from} ended with (changed while it ran): ${text}.`));
  }

  // One option per CUDA device the server's probe found (GET /api/system "cuda_devices").
  const devicesListed = api.system().then((s) => {
    for (let i = 0; i < (s.cuda_devices || 0); i++) deviceSel.append(h("option", { value: `cuda:${i}` }, `cuda:${i}`));
  }).catch(() => {});

  (async () => {
    try {
      limitPaths = (await api.limitFields()).paths;
      if (from) {
        const [run, limits] = await Promise.all([api.run(from), api.limits(from)]);
        await loadPresets(run.preset);
        const preset = presets.find((p) => p.name === run.preset);
        if (!preset) {
          // Its config is loaded as it ran; another preset's would add to it: save it under a name first.
          presetSel.prepend(h("option", { value: "" }, `(${run.preset}: deleted)`));
          presetSel.value = "";
          presetName.value = run.preset;
          showError(errors, new Error(`preset "${run.preset}" no longer exists; the run's config is loaded: save it as a new preset to start it`), "re-run");
        }
        load(preset ? preset.config : run.config, withLimits(run.config, limits));
        limitsNote(limits);
        nameInput.value = `${run.name || `run ${run.id}`} (re-run)`;
        await devicesListed;
        if ([...deviceSel.options].some((o) => o.value === run.device)) deviceSel.value = run.device;
      } else {
        await loadPresets(params.get("preset"));
      }
    } catch (err) {
      showError(errors, err, "loading presets");
    }
  })();

  return () => offAssets();
}
