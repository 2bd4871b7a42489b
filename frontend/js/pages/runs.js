// Runs page: the table of runs with filters, selection for Compare, delete, notes and tags.
// The list is polled every POLL_MS and rows are updated in place (keyed by run id), so a
// selection or a half-typed note survives the refresh.
// Filters (status, preset, a search over names and tags) and the sort column are applied here,
// to the whole list, and kept in the URL (#/runs?status=…&q=…&sort=…&dir=…): a reload or a
// shared link shows the same rows, and "0 of N runs" says when the filters hide every run.

import { FINISHED, STATUSES, api } from "../api.js";
import {
  clearErrors, fill, fmtBytes, fmtDuration, fmtMB, fmtMs, fmtNum, fmtTime, h, runDuration, showError, statusBadge, toDate,
} from "../ui.js";

const POLL_MS = 3000;
const MAX_COMPARE = 6;

// Sortable columns: the key in the URL, the header, and the value a run sorts by (null last).
const COLUMNS = [
  { key: "name", label: "name", value: (r) => (r.name || "").toLowerCase() },
  { key: "preset", label: "preset", value: (r) => r.preset || null },
  { key: "status", label: "status", value: (r) => r.status },
  { key: "started", label: "started", value: (r) => toDate(r.started_at || r.created_at)?.getTime() ?? null },
  { key: "duration", label: "duration", value: (r) => runDuration(r) },
  { key: "steps", label: "steps", value: (r) => r.summary?.steps_done ?? null },
  { key: "loss", label: "final loss", value: (r) => r.summary?.final_loss ?? null },
  { key: "vram", label: "peak VRAM", value: (r) => r.summary?.peak_vram_mb ?? null },
  { key: "step", label: "mean step", value: (r) => r.summary?.mean_step_time_ms ?? null },
  { key: "spill", label: "spill", value: (r) => r.summary?.spill_bytes ?? null },
];

/** `runs` ordered by column `key` (`dir` "asc" or "desc"); runs without a value go last, ties
 * keep the newest first. */
export function sortRuns(runs, key, dir) {
  const col = COLUMNS.find((c) => c.key === key);
  if (!col) return runs;
  const sign = dir === "desc" ? -1 : 1;
  return runs.map((r) => [r, col.value(r)]).sort(([a, va], [b, vb]) => {
    const none = (v) => v === null || v === undefined || Number.isNaN(v);
    if (none(va) || none(vb)) return none(va) - none(vb) || b.id - a.id;
    if (va < vb) return -sign;
    if (va > vb) return sign;
    return b.id - a.id;
  }).map(([r]) => r);
}

/** True when `run`'s name or one of its tags holds `text` (any case). */
export function matches(run, text) {
  if (!text) return true;
  const needle = text.toLowerCase();
  return [run.name || "", ...(run.tags || [])].some((s) => s.toLowerCase().includes(needle));
}

/** The run's own model and data folders under its preset's name ("model FLUX.1-dev · data
 * photos", the full paths in the title): a run of the demo preset on a user's pipeline and
 * images is not the demo. Null when the run names no folder. */
function folders(run) {
  const named = ["model", "data"].map((k) => [k, run.config?.[k]?.path]).filter(([, p]) => typeof p === "string" && p);
  if (!named.length) return null;
  const base = (p) => p.replace(/\/+$/, "").split("/").pop() || p;
  return h("div", { class: "muted run-folders", title: named.map(([k, p]) => `${k}: ${p}`).join("\n") },
    named.map(([k, p]) => `${k} ${base(p)}`).join(" · "));
}

export function mount(root, { params }) {
  const selected = new Set();
  const rows = new Map(); // id -> {tr, editor}
  const errors = h("div", { class: "page-errors" });
  const filters = {
    status: params.get("status") || "",
    preset: params.get("preset") || "",
    q: params.get("q") || params.get("tag") || "",
    sort: COLUMNS.some((c) => c.key === params.get("sort")) ? params.get("sort") : "",
    dir: params.get("dir") === "desc" ? "desc" : "asc",
  };
  let allRuns = null; // the last list the backend gave, every run

  const statusSel = h("select", { id: "filter-status", "aria-label": "status", onchange: () => { filters.status = statusSel.value; show(); } },
    h("option", { value: "" }, "any status"), STATUSES.map((s) => h("option", { value: s }, s)));
  statusSel.value = filters.status;
  const presetSel = h("select", { id: "filter-preset", "aria-label": "preset", onchange: () => { filters.preset = presetSel.value; show(); } },
    h("option", { value: "" }, "any preset"));
  if (filters.preset) presetSel.append(h("option", { value: filters.preset }, filters.preset));
  presetSel.value = filters.preset;
  const tagInput = h("input", { id: "filter-tag", type: "search", placeholder: "search names and tags", "aria-label": "search names and tags", value: filters.q });
  let tagTimer = null;
  tagInput.addEventListener("input", () => {
    clearTimeout(tagTimer);
    tagTimer = setTimeout(() => { filters.q = tagInput.value.trim(); show(); }, 200);
  });
  const compareBtn = h("button", { id: "compare-selected", class: "primary", disabled: true, onclick: () => {
    location.hash = `#/compare?ids=${[...selected].join(",")}`;
  } }, "Compare selected");
  const selInfo = h("span", { class: "muted", id: "selection-info" }, "select 2–6 runs to compare");
  const count = h("span", { class: "muted", id: "runs-count" });
  const tbody = h("tbody", { id: "runs-body" });
  const empty = h("p", { class: "muted empty", id: "runs-empty", hidden: true });

  const head = ["", ...COLUMNS.map((c) => c.label), "tags", ""];
  const headCells = [h("th", {}), ...COLUMNS.map((c) => h("th", { dataset: { sort: c.key } },
    h("button", { class: "sort", type: "button", title: `sort by ${c.label}`, onclick: () => sortBy(c.key) }, c.label))),
  h("th", {}, "tags"), h("th", {})];
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
          h("thead", {}, h("tr", {}, headCells)), tbody)),
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
      h("td", { "data-label": "preset" }, run.preset || "–", folders(run)),
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

  /** A second click on the sorted column reverses it. */
  function sortBy(key) {
    filters.dir = filters.sort === key && filters.dir === "asc" ? "desc" : "asc";
    filters.sort = key;
    show();
  }

  function clearFilters() {
    Object.assign(filters, { status: "", preset: "", q: "" });
    statusSel.value = "";
    presetSel.value = "";
    tagInput.value = "";
    show();
  }

  /** The filters and sort in the address (replaceState: no new page, no history entry). */
  function keepInUrl() {
    const q = new URLSearchParams();
    for (const key of ["status", "preset", "q", "sort"]) if (filters[key]) q.set(key, filters[key]);
    if (filters.sort) q.set("dir", filters.dir);
    const hash = `#/runs${q.toString() ? `?${q}` : ""}`;
    if (location.hash !== hash) history.replaceState(null, "", hash);
  }

  /** The rows the filters let through, in the chosen order, and "k of N runs". */
  function show() {
    keepInUrl();
    for (const th of headCells.slice(1, COLUMNS.length + 1)) {
      const sorted = th.dataset.sort === filters.sort;
      th.setAttribute("aria-sort", sorted ? (filters.dir === "asc" ? "ascending" : "descending") : "none");
    }
    if (allRuns === null) return;
    const shown = sortRuns(allRuns.filter((r) =>
      (!filters.status || r.status === filters.status)
      && (!filters.preset || r.preset === filters.preset)
      && matches(r, filters.q)), filters.sort, filters.dir);
    const total = allRuns.length;
    const plural = total === 1 ? "run" : "runs";
    const filtered = filters.status || filters.preset || filters.q;
    count.textContent = filtered ? `${shown.length} of ${total} ${plural}` : `${total} ${plural}`;
    if (!total) fill(empty, "No runs yet. Start one from ", h("a", { href: "#/new" }, "New run"), ".");
    else if (!shown.length) {
      fill(empty, `0 of ${total} ${plural} match these filters. `,
        h("button", { class: "small", id: "clear-filters", onclick: clearFilters }, "Clear filters"));
    }
    empty.hidden = shown.length > 0;
    render(shown);
  }

  function render(runs) {
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
  async function refresh() {
    clearTimeout(timer);
    try {
      const list = await api.runs({});
      if (stopped) return;
      clearErrors(errors, "loading runs"); // the backend answers again
      allRuns = list.data || [];
      show();
    } catch (err) {
      if (stopped) return;
      showError(errors, err, "loading runs");
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }

  api.presets().then((list) => {
    const names = (list.data || []).map((p) => p.name).filter((n) => n !== filters.preset);
    presetSel.append(...names.map((n) => h("option", { value: n }, n)));
    presetSel.value = filters.preset;
  }).catch((err) => showError(errors, err, "loading presets"));

  refresh();
  return () => { stopped = true; clearTimeout(timer); clearTimeout(tagTimer); };
}

