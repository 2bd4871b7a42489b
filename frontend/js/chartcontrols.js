// What a user gets above a chart: "log y" and the chart's data as a CSV file, and the CSV
// writing itself (numbers as the API sent them).

import { h } from "./ui.js";

/**
 * One CSV line: numbers as JavaScript writes them (every digit the API sent), text quoted
 * when it holds a comma, a quote or a line break.
 */
export function csvRow(cells) {
  return cells.map((v) => {
    if (v === null || v === undefined || (typeof v === "number" && Number.isNaN(v))) return "";
    const text = String(v);
    return /[",\n\r]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
  }).join(",");
}

/** Saves `text` as the file `filename` through the browser's download. */
export function download(filename, text, type = "text/csv") {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h("a", { href: url, download: filename, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 0);
}

/**
 * The controls above a chart: "log y" and "CSV" (the chart's data, downloaded as
 * `filename`), then `extra` elements (e.g. the loss chart's smoothing).
 */
export function chartTools(chart, filename, ...extra) {
  const id = chart.el.id;
  const log = h("input", { type: "checkbox", class: "log-y", id: `${id}-log`, onchange: () => chart.setLogY(log.checked) });
  return h("div", { class: "chart-tools" },
    ...extra,
    h("label", { class: "inline", for: `${id}-log` }, log, "log y"),
    h("button", { class: "small csv", id: `${id}-csv`, title: "download this chart's data as CSV", onclick: () => {
      chart.flush();
      download(filename, chart.csv());
    } }, "CSV"));
}
