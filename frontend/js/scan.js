// The dataset scan (backend/workbench/worker/scan.py) as the New run page (POST /api/data/scan) and the
// run page (the worker's trainer/dataset_scan record) show it: usable samples, every file left
// out with its reason (bad ones first), caption warnings, and why a run cannot start.

import { h } from "./ui.js";

/** "9 samples · 8 files left out (4 bad) · 2 warnings" */
export function scanSummary(scan) {
  const skipped = scan.skipped || [];
  const bad = skipped.filter((s) => s.bad).length;
  const warnings = (scan.warnings || []).length;
  const parts = [`${scan.usable} sample${scan.usable === 1 ? "" : "s"}`];
  parts.push(`${skipped.length} file${skipped.length === 1 ? "" : "s"} left out${bad ? ` (${bad} bad)` : ""}`);
  if (warnings) parts.push(`${warnings} warning${warnings === 1 ? "" : "s"}`);
  if (scan.captions_defaulted) parts.push(`${scan.captions_defaulted} with data.default_caption`);
  return parts.join(" · ");
}

/** Whether the user should see the scan before a run starts on it (bad files or warnings). */
export function noteworthy(scan) {
  return Boolean(scan.problem) || (scan.skipped || []).some((s) => s.bad) || (scan.warnings || []).length > 0;
}

/**
 * The scan as an element: summary line, the problem (a run would fail), and a table of the
 * files left out and the warnings (open when `open` or when there is a problem).
 */
export function scanView(scan, { open = false } = {}) {
  if (scan.usable === null || scan.usable === undefined) {
    return h("div", { class: "scan", "data-usable": "" }, h("p", { class: "muted scan-note" }, scan.note || "not scanned"));
  }
  const rows = [
    ...(scan.skipped || []).filter((s) => s.bad).map((s) => ({ file: s.file, what: s.reason, kind: "bad" })),
    ...(scan.warnings || []).map((w) => ({ file: w.file, what: w.message, kind: "warning" })),
    ...(scan.skipped || []).filter((s) => !s.bad).map((s) => ({ file: s.file, what: s.reason, kind: "left-out" })),
  ];
  const label = { bad: "left out (bad)", warning: "warning", "left-out": "left out" };
  return h("div", { class: `scan${scan.problem ? " scan-failed" : ""}`, "data-usable": String(scan.usable) },
    h("p", { class: "scan-summary" }, scanSummary(scan), scan.folder ? " from " : "", scan.folder ? h("code", {}, scan.folder) : null),
    scan.problem ? h("pre", { class: "scan-problem" }, scan.problem) : null,
    rows.length
      ? h("details", { class: "scan-details", open: open || Boolean(scan.problem) },
        h("summary", {}, `files left out and warnings (${rows.length})`),
        h("table", { class: "scan-table" },
          h("thead", {}, h("tr", {}, h("th", {}, "file"), h("th", {}, ""), h("th", {}, "why"))),
          h("tbody", {}, rows.map((r) => h("tr", { class: `scan-${r.kind}`, "data-file": r.file },
            h("td", {}, h("code", {}, r.file)), h("td", { class: "scan-kind" }, label[r.kind]), h("td", {}, r.what))))))
      : null);
}

/** A video run's frames per clip as its trainer/run_started record gives them: the value and
 * where it came from ("data.frames", or why the default was chosen from the clips). */
export function framesView(rec) {
  return h("p", { id: "data-frames" }, h("strong", {}, `${rec.frames} frame${rec.frames === 1 ? "" : "s"} per clip`),
    ` (${rec.frames_from})`);
}
