// New run page: pick a preset, edit its key fields as a form (components/newrun/form.js: the
// model and data folders, the sample prompts, the knobs) or the whole JSON
// (components/newrun/json.js), then Start (POST /api/runs with the changes as `overrides`, after
// a data scan: components/newrun/request.js) or save it as a new preset
// (components/newrun/presets.js). While a field holds text the page marked invalid, nothing is
// sent: Start, Check data, Plan, Tune and Save wait, and a note says which fields. As a field
// changes (a folder: once left) the server checks the request (components/newrun/checks.js)
// and every field it refuses shows its error at once; the buttons wait for those too.
// `#/new?from=ID` opens it prefilled from a past run ("Re-run with changes", with the live
// limits the run ended with, not those it started with); `#/new?preset=NAME` selects one.
// "Plan" (plan.js) predicts VRAM and step time of the config on a device profile before Start.

import { api } from "../api.js";
import { onAssets } from "../assets.js";
import { clearErrors, deepDiff, fill, h, setPath, showError } from "../ui.js";
import { planPanel } from "../plan.js";
import { pipelinePanel } from "../components/panels/pipeline.js";
import { KeyFieldsForm } from "../components/newrun/form.js";
import { JsonEditor } from "../components/newrun/json.js";
import { overridesOf, RunRequest } from "../components/newrun/request.js";
import { FieldChecks } from "../components/newrun/checks.js";
import { PresetActions } from "../components/newrun/presets.js";

export function mount(root, { params }) {
  let presets = [];
  const doc = { base: {}, config: {} }; // the selected preset's config; what the user edits
  const errors = h("div", { class: "page-errors" });
  const presetSel = h("select", { id: "preset-select", onchange: () => selectPreset(presetSel.value) });
  const nameInput = h("input", { id: "run-name", type: "text", placeholder: "run name (optional)" });
  // The worker's device (POST /api/runs "device"); runs on one device share its --max-parallel slots.
  const deviceSel = h("select", { id: "run-device", title: "the device the run's worker trains on" },
    h("option", { value: "auto" }, "auto (CUDA if present)"), h("option", { value: "cpu" }, "cpu"));
  // A preset waiting for the demo-asset build (its model unchanged) cannot start yet: say why.
  const assetNote = h("p", { class: "asset-note", id: "asset-note", role: "status", hidden: true });
  const blockedNote = h("p", { class: "asset-note", id: "blocked-note", role: "status", hidden: true });
  let assets = null;
  const from = params.get("from");
  const title = h("h1", {}, from ? `Re-run ${from} with changes` : "New run");

  const form = new KeyFieldsForm(doc, (path, how) => {
    // The value changed: an error that named this field no longer holds until asked again.
    clearErrors(errors, null, path);
    json.show();
    if (how === "typing") checks.cancel(); // a folder is checked once left, not half typed
    else if (how === "left") checks.now();
    else checks.schedule();
  });
  const json = new JsonEditor(doc, () => {
    form.show();
    checks.schedule();
  });
  const checks = new FieldChecks({
    // Nothing is asked while a field holds text that did not parse (the request would carry
    // its last good value) or without a preset.
    request: () => (form.invalidLabels().length || !json.valid || !presetSel.value ? null
      : { preset: presetSel.value, overrides: overridesOf(doc.base, doc.config) }),
    onResult: (problems) => {
      form.setChecked(problems);
      json.error.textContent = form.unplaced.map((p) => `${p.field}: ${p.message}`).join("\n");
      gate();
    },
  });
  const request = new RunRequest({ doc, form, json, errors, presetSel, nameInput, deviceSel, checks, gate });
  const presetActions = new PresetActions({
    doc, json, errors, presetSel, loadPresets,
    selected: () => presets.find((p) => p.name === presetSel.value),
    showApiError: (err, label) => request.showApiError(err, label),
  });
  const plan = planPanel({
    getConfig: () => (json.parse() ? doc.config : null),
    getRequest: () => request.forTune(),
    placeError: (err) => request.placePlanError(err),
  });

  root.append(
    h("section", { class: "card" },
      h("div", { class: "toolbar" }, title, h("div", { class: "spacer" }),
        h("label", { class: "inline" }, "Preset ", presetSel),
        h("label", { class: "inline" }, "Device ", deviceSel), nameInput),
      errors,
      pipelinePanel({ onUse: usePipeline }),
      h("div", { class: "two-col" },
        h("div", {}, h("h2", {}, "Key fields"), form.el),
        h("div", {}, h("h2", {}, "Full config (JSON)"), json.area, json.error)),
      request.scanBox,
      plan.el,
      assetNote,
      blockedNote,
      h("div", { class: "toolbar actions-row" }, request.startBtn, request.scanBtn, h("div", { class: "spacer" }), presetActions.el),
      presetActions.note),
  );
  root.addEventListener("input", gate);
  root.addEventListener("change", gate);

  /** Holds back every button that sends the config while a field holds text the page marked
   * invalid (its last good value is still in the config: Start would run that one) or a value
   * the server refused (its check as fields change, or the last Start), naming the fields; and
   * says why the selected preset cannot start while its demo assets build (GET
   * /api/assets blocked_presets; Start is refused by the server with the same reason, 409
   * assets_not_ready); a pipeline folder (another model) lifts that. */
  function gate() {
    const bad = form.invalidLabels();
    if (!json.valid) bad.push("Full config (JSON)");
    const refused = form.checkedLabels();
    const reasons = [
      bad.length ? `Fix ${bad.join("; ")} first: a run would not get what is typed there.` : "",
      refused.length ? `Fix ${refused.join("; ")} first: the server refuses ${refused.length > 1 ? "them" : "it"} (see beside each).` : "",
    ].filter(Boolean);
    const reason = reasons.length ? reasons.join(" ") : null;
    request.setBlocked(reason);
    plan.setBlocked(reason);
    presetActions.setBlocked(reason);
    blockedNote.hidden = !reason;
    blockedNote.textContent = reason ? `Start, Check data, Plan, Tune and Save wait. ${reason}` : "";
    const why = assets?.blocked_presets?.[presetSel.value];
    const blocked = Boolean(why) && !("model" in deepDiff(doc.base, doc.config));
    request.startBtn.classList.toggle("waiting", blocked);
    assetNote.hidden = !blocked;
    assetNote.textContent = blocked ? `This preset cannot start until the demo assets are built: ${why}.` : "";
  }
  const offAssets = onAssets((status) => {
    assets = status;
    gate();
  });

  /** The config into both editors, with the fields bound to the paths it has. */
  function showConfig() {
    form.bind();
    form.show();
    json.show();
    gate();
  }

  function load(baseConfig, editConfig) {
    doc.base = structuredClone(baseConfig || {});
    doc.config = structuredClone(editConfig || baseConfig || {});
    request.clearFieldErrors();
    showConfig();
  }

  /** A pipeline folder replaces the preset's model: model.path set (the preset's factory model
   *  fields dropped, as the Model folder field does), model.expert the chosen one (left out for
   *  a pipeline with one transformer). Fields marked invalid keep what was typed. */
  function usePipeline(path, expert) {
    form.useFolder("model.path", path);
    if (expert) setPath(doc.config, "model.expert", expert);
    else if (doc.config.model) delete doc.config.model.expert;
    form.show({ keepInvalid: true });
    json.show();
    gate();
    checks.now();
  }

  function selectPreset(name) {
    const preset = presets.find((p) => p.name === name);
    if (preset) load(preset.config);
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
      form.folderFields = (await api.folderFields()).bound;
      if (from) {
        const [run, limits] = await Promise.all([api.run(from), api.limits(from)]);
        await loadPresets(run.preset);
        const preset = presets.find((p) => p.name === run.preset);
        if (!preset) {
          // Its config is loaded as it ran; another preset's would add to it: save it under a name first.
          presetSel.prepend(h("option", { value: "" }, `(${run.preset}: deleted)`));
          presetSel.value = "";
          presetActions.nameInput.value = run.preset;
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

  return () => {
    offAssets();
    checks.cancel();
  };
}
