// Small DOM and formatting helpers shared by the pages (no framework: elements are built here).

/**
 * Creates an element: h("a", {href: "#/runs", class: "x"}, "text", child).
 * Attributes starting with "on" are listeners; `dataset` takes an object; null children skip.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "class") el.className = value;
    else if (key === "value") el.value = value;
    else if (key === "checked") el.checked = Boolean(value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Removes every child of `el` and appends `children`. */
export function fill(el, ...children) {
  el.replaceChildren();
  for (const child of children.flat()) if (child) el.append(child);
  return el;
}

export function fmtMB(mb) {
  if (mb === null || mb === undefined || Number.isNaN(mb)) return "–";
  if (Math.abs(mb) >= 1024) return `${(mb / 1024).toFixed(2)} GB`;
  return `${mb.toFixed(mb >= 100 ? 0 : 1)} MB`;
}

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  if (bytes > 0 && bytes < 2 ** 20) return `${(bytes / 1024).toFixed(bytes < 10240 ? 1 : 0)} KB`;
  return fmtMB(bytes / 2 ** 20);
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  if (ms >= 1000) return `${(ms / 1000).toFixed(2)} s`;
  return `${ms.toFixed(ms >= 100 ? 0 : 1)} ms`;
}

export function fmtNum(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toString();
}

/** Seconds -> "1h 02m", "3m 20s", "12s". */
export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds) || seconds < 0) return "–";
  const s = Math.round(seconds);
  if (s >= 3600) return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  if (s >= 60) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

/** The API's timestamps may be unix seconds or ISO strings; both become Date. */
export function toDate(value) {
  if (value === null || value === undefined || value === "") return null;
  if (typeof value === "number") return new Date(value * 1000);
  const d = new Date(value);
  return Number.isNaN(d.getTime()) ? null : d;
}

export function fmtTime(value) {
  const d = toDate(value);
  if (!d) return "–";
  const today = new Date();
  const sameDay = d.toDateString() === today.toDateString();
  const time = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  return sameDay ? time : `${d.toLocaleDateString()} ${time}`;
}

/** Run duration: finished - started, or now - started while running. */
export function runDuration(run) {
  const start = toDate(run.started_at);
  if (!start) return null;
  const end = toDate(run.finished_at) || new Date();
  return (end - start) / 1000;
}

export function statusBadge(status) {
  return h("span", { class: `badge badge-${status}`, "data-status": status }, status);
}

/**
 * Shows an ApiError (or any Error) in `container` as a visible, dismissable message, keyed by
 * `prefix` (what was being done): a second error of the same kind replaces the first rather than
 * stacking, and `clearErrors(container, prefix)` takes it away once that works again. The box
 * lists the fields the error names (`data-fields`), so fixing a field can clear it
 * (`clearErrors(container, null, field)`).
 */
export function showError(container, err, prefix = "") {
  const text = typeof err.describe === "function" ? err.describe() : sentence(err.message || String(err));
  const details = Array.isArray(err.details) && err.details.length > 1
    ? h("ul", {}, err.details.map((d) => h("li", {}, typeof d === "object" ? `${d.field ?? ""}: ${d.message ?? JSON.stringify(d)}` : String(d))))
    : null;
  const fields = [err.field, ...(Array.isArray(err.details) ? err.details.map((d) => d && d.field) : [])]
    .filter(Boolean).map(fieldPath);
  const box = h(
    "div",
    { class: "error-box", role: "alert", dataset: { key: prefix, fields: [...new Set(fields)].join(" ") } },
    h("button", { class: "close", title: "dismiss", onclick: () => box.remove() }, "×"),
    h("strong", {}, prefix ? `${prefix}: ` : "Error: "),
    text,
    details,
  );
  clearErrors(container, prefix);
  container.prepend(box);
  return box;
}

/** Removes the error boxes of `container` shown for `prefix` (any, when null) and, when
 * `field` is given, only those naming that field (a config path, "overrides." or not). */
export function clearErrors(container, prefix = null, field = null) {
  for (const box of container.querySelectorAll(":scope > .error-box")) {
    if (prefix !== null && box.dataset.key !== prefix) continue;
    if (field !== null && !box.dataset.fields.split(" ").includes(fieldPath(field))) continue;
    box.remove();
  }
}

/** A field's config path as the error names it, without the request body's head. */
function fieldPath(field) {
  return String(field).replace(/^(overrides|config|limits)\./, "");
}

/** `text` as a sentence: a capital first letter (unless it starts with a field path) and a
 * full stop. */
export function sentence(text) {
  let out = String(text).trim();
  if (/^[a-z]+ /.test(out)) out = out[0].toUpperCase() + out.slice(1);
  return /[.!?)]$/.test(out) ? out : `${out}.`;
}

/** Get/set a value in a nested object by a dotted JSON path ("memory.stagehand.x", "a[0]"). */
export function splitPath(path) {
  return path.replace(/\[(\d+)\]/g, ".$1").split(".").filter(Boolean);
}

export function getPath(obj, path) {
  let cur = obj;
  for (const key of splitPath(path)) {
    if (cur === null || cur === undefined || typeof cur !== "object") return undefined;
    cur = cur[key];
  }
  return cur;
}

export function setPath(obj, path, value) {
  const keys = splitPath(path);
  let cur = obj;
  keys.slice(0, -1).forEach((key) => {
    if (cur[key] === null || cur[key] === undefined || typeof cur[key] !== "object") cur[key] = {};
    cur = cur[key];
  });
  cur[keys[keys.length - 1]] = value;
}

/** Leaves of `b` that differ from `a`, as a nested object (arrays compared whole). */
export function deepDiff(a, b) {
  const out = {};
  for (const [key, value] of Object.entries(b || {})) {
    const base = a ? a[key] : undefined;
    if (value && typeof value === "object" && !Array.isArray(value) && base && typeof base === "object" && !Array.isArray(base)) {
      const sub = deepDiff(base, value);
      if (Object.keys(sub).length) out[key] = sub;
    } else if (JSON.stringify(value) !== JSON.stringify(base)) {
      out[key] = value;
    }
  }
  return out;
}

export function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/runs";
  const [path, queryString = ""] = raw.split("?");
  return { parts: path.split("/").filter(Boolean), params: new URLSearchParams(queryString) };
}
