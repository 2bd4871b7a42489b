// Runs page: the table of runs with filters, selection for Compare, delete, notes and tags.
// The list is polled every POLL_MS and rows are updated in place (keyed by run id), so a
// selection or a half-typed note survives the refresh.

import { FINISHED, api } from "../api.js";
import {
  fmtBytes, fmtDuration, fmtMB, fmtMs, fmtNum, fmtTime, h, runDuration, showError, statusBadge,
} from "../ui.js";

const POLL_MS = 3000;
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled", "killed", "crashed", "stalled"];
const MAX_COMPARE = 6;

export function mount(root, { params }) {
  const selected = new Set();
  const rows = new Map(); // id -> {tr, editor}
  const errors = h("div", { class: "page-errors" });
  const filters = {
    status: params.get("status") || "",
    preset: params.get("preset") || "",
    tag: params.get("tag") || "",
  };

  const statusSel = h("select", { id: "filter-status", onchange: () => { filters.status = statusSel.value; refresh(); } },
    h("option", { value: "" }, "any status"), STATUSES.map((s) => h("option", { value: s }, s)));
  statusSel.value = filters.status;
  const presetSel = h("select", { id: "filter-preset", onchange: () => { filters.preset = presetSel.value; refresh(); } },
    h("option", { value: "" }, "any preset"));
  const tagInput = h("input", { id: "filter-tag", type: "search", placeholder: "tag", value: filters.tag });
  let tagTimer = null;
  tagInput.addEventListener("input", () => {
    clearTimeout(tagTimer);
    tagTimer = setTimeout(() => { filters.tag = tagInput.value.trim(); refresh(); }, 300);
  });
  const compareBtn = h("button", { id: "compare-selected", class: "primary", disabled: true, onclick: () => {
    location.hash = `#/compare?ids=${[...selected].join(",")}`;
  } }, "Compare selected");
  const selInfo = h("span", { class: "muted", id: "selection-info" }, "select 2–6 runs to compare");
  const count = h("span", { class: "muted", id: "runs-count" });
  const tbody = h("tbody", { id: "runs-body" });
  const empty = h("p", { class: "muted empty", hidden: true }, "No runs yet. Start one from ", h("a", { href: "#/new" }, "New run"), ".");

  const head = ["", "name", "preset", "status", "started", "duration", "steps", "final loss", "peak VRAM", "mean step", "spill", "tags", ""];
  root.append(
    h("section", { class: "card" },
      h("div", { class: "toolbar" },
        h("h1", {}, "Runs"), count,
        h("div", { class: "spacer" }),
        statusSel, presetSel, tagInput,
        h("a", { class: "button", href: "#/new" }, "New run")),
      errors,
      h("div", { class: "toolbar" }, compareBtn, selInfo),
      h("div", { class: "table-wrap" },
        h("table", { class: "runs-table", id: "runs-table" },
          h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), tbody)),
      empty),
  );

  function updateSelection() {
    const n = selected.size;
    compareBtn.disabled = n < 2 || n > MAX_COMPARE;
    selInfo.textContent = n ? `${n} selected${n > MAX_COMPARE ? ` (at most ${MAX_COMPARE})` : ""}` : "select 2–6 runs to compare";
  }

  function editor(run) {
    const notes = h("textarea", { class: "notes-input", rows: 3, placeholder: "notes" }, run.notes || "");
    const tags = h("input", { class: "tags-input", type: "text", placeholder: "tags, comma separated", value: (run.tags || []).join(", ") });
    const status = h("span", { class: "muted" });
    const box = h("td", { colspan: head.length },
      h("div", { class: "editor" }, notes, tags,
        h("button", { class: "primary save-notes", onclick: async () => {
          const body = { notes: notes.value, tags: tags.value.split(",").map((t) => t.trim()).filter(Boolean) };
          status.textContent = "saving…";
          try {
            await api.updateRun(run.id, body);
            status.textContent = "saved";
            refresh();
          } catch (err) {
            status.textContent = "";
            showError(box, err, "save notes/tags");
          }
        } }, "Save"),
        h("button", { onclick: () => toggleEditor(run) }, "Close"), status));
    return h("tr", { class: "editor-row", "data-editor-for": run.id }, box);
  }

  function toggleEditor(run) {
    const entry = rows.get(run.id);
    if (!entry) return;
    if (entry.editor) {
      entry.editor.remove();
      entry.editor = null;
    } else {
      entry.editor = editor(run);
      entry.tr.after(entry.editor);
    }
  }

  async function remove(run) {
    if (!window.confirm(`Delete run ${run.id} "${run.name}" and its files?`)) return;
    try {
      await api.deleteRun(run.id);
      selected.delete(run.id);
      updateSelection();
      refresh();
    } catch (err) {
      showError(errors, err, `delete run ${run.id}`);
    }
  }

  function cells(run) {
    const s = run.summary || {};
    return [
      h("td", { class: "name" }, h("a", { href: `#/runs/${run.id}` }, run.name || `run ${run.id}`),
        run.group_id ? h("a", { class: "tag tune-link", href: `#/tunes/${run.group_id}`, title: "a trial of this tune" }, `tune #${run.group_id}`) : null,
        run.notes ? h("div", { class: "notes muted", title: run.notes }, run.notes) : null),
      h("td", { "data-label": "preset" }, run.preset || "–"),
      h("td", { "data-label": "status" }, statusBadge(run.status)),
      h("td", { "data-label": "started" }, fmtTime(run.started_at || run.created_at)),
      h("td", { "data-label": "duration" }, fmtDuration(runDuration(run))),
      h("td", { class: "num", "data-label": "steps" }, `${s.steps_done ?? 0}/${s.max_steps ?? "?"}`),
      h("td", { class: "num", "data-label": "final loss" }, fmtNum(s.final_loss)),
      h("td", { class: "num", "data-label": "peak VRAM" }, fmtMB(s.peak_vram_mb)),
      h("td", { class: "num", "data-label": "mean step" }, fmtMs(s.mean_step_time_ms)),
      h("td", { class: "num", "data-label": "spill" }, fmtBytes(s.spill_bytes)),
      h("td", { "data-label": "tags" }, h("span", {}, (run.tags || []).map((t) => h("span", { class: "tag" }, t)))),
      h("td", {}, h("div", { class: "actions" },
        h("button", { class: "small", title: "notes and tags", onclick: () => toggleEditor(run) }, "Notes"),
        // A queued or running run is stopped first (its page), never deleted from under its worker.
        FINISHED.has(run.status)
          ? h("button", { class: "small danger", title: "delete run", onclick: () => remove(run) }, "Delete")
          : null)),
    ];
  }

  function render(runs) {
    count.textContent = `${runs.length} run${runs.length === 1 ? "" : "s"}`;
    empty.hidden = runs.length > 0;
    const seen = new Set();
    let prev = null;
    for (const run of runs) {
      seen.add(run.id);
      let entry = rows.get(run.id);
      if (!entry) {
        const box = h("input", { type: "checkbox", class: "select-run", "aria-label": `select run ${run.id}`, onchange: () => {
          if (box.checked) selected.add(run.id); else selected.delete(run.id);
          updateSelection();
        } });
        box.checked = selected.has(run.id);
        entry = { tr: h("tr", { "data-run-id": run.id }, h("td", { class: "select" }, box)), editor: null };
        rows.set(run.id, entry);
      }
      const tr = entry.tr;
      tr.dataset.status = run.status;
      while (tr.children.length > 1) tr.lastChild.remove();
      tr.append(...cells(run));
      const anchor = prev ? (prev.editor || prev.tr).nextSibling : tbody.firstChild;
      if (anchor !== tr) tbody.insertBefore(tr, anchor);
      if (entry.editor && tr.nextSibling !== entry.editor) tr.after(entry.editor);
      prev = entry;
    }
    for (const [id, entry] of rows) {
      if (seen.has(id)) continue;
      entry.tr.remove();
      if (entry.editor) entry.editor.remove();
      rows.delete(id);
      selected.delete(id);
    }
    updateSelection();
  }

  let stopped = false;
  let timer = null;
  let lastError = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const list = await api.runs(filters);
      if (stopped) return;
      if (lastError) { lastError.remove(); lastError = null; }
      render(list.data || []);
    } catch (err) {
      if (stopped) return;
      if (lastError) lastError.remove();
      lastError = showError(errors, err, "loading runs");
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }

  api.presets().then((list) => {
    const names = (list.data || []).map((p) => p.name);
    presetSel.append(...names.map((n) => h("option", { value: n }, n)));
    presetSel.value = filters.preset;
  }).catch((err) => showError(errors, err, "loading presets"));

  refresh();
  return () => { stopped = true; clearTimeout(timer); clearTimeout(tagTimer); };
}

