// What every figure of the dashboard shares: Plotly's config (its toolbar), the base layout, the
// title band clear of the toolbar, the legend below the plot, the note of an empty chart, limit
// markers, whole-step ticks, and the escaping of the text given to Plotly.

/**
 * `text` as Plotly shows it literally. Plotly reads titles, legend names, hover text and
 * shape labels as pseudo-HTML (`<a href>` becomes a link, `<b>` bold) and decodes entities
 * after the tags: escaping &, < and > keeps run names, block names and record fields as text.
 * Every string given to Plotly goes through here (ChartPanel does it for titles, trace names
 * and marker labels).
 */
export function plotText(text) {
  return String(text ?? "").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

export const BASE_LAYOUT = {
  margin: { l: 58, r: 58, t: 36, b: 78 },
  height: 310,
  legend: { orientation: "h", x: 0, y: -0.3, yanchor: "top", traceorder: "normal", font: { size: 11 } },
  font: { family: "system-ui, -apple-system, Segoe UI, sans-serif", size: 12, color: "#1d2733" },
  paper_bgcolor: "#ffffff",
  plot_bgcolor: "#ffffff",
  xaxis: { gridcolor: "#e8ecf1", zeroline: false, automargin: true },
  yaxis: { gridcolor: "#e8ecf1", zeroline: false, automargin: true, rangemode: "tozero" },
  hovermode: "x unified",
  uirevision: "keep", // user zoom survives updates
};

/** Screens this narrow (a phone) draw charts without Plotly's toolbar (app.css's breakpoint). */
const NARROW = "(max-width: 700px)";

// A double-click asks for autorange (ChartPanel then draws its window, or everything), never
// Plotly's "reset" to whatever range the chart was first drawn with. The toolbar shows while the
// pointer is over a chart, and never on a narrow screen: a touch screen has no hover, and
// Plotly shows a "hover" toolbar there all the time, over the title. Read at each draw.
export const PLOT_CONFIG = {
  responsive: true, displaylogo: false, doubleClick: "autosize", modeBarButtonsToRemove: ["lasso2d", "select2d"],
  get displayModeBar() {
    return window.matchMedia(NARROW).matches ? false : "hover";
  },
};

// Plotly's toolbar takes the top ~24 px of a figure, on its right: a chart panel's title sits
// below that band (TITLE_TOP px down, the plot MARGIN_TOP px down), so no title is covered.
const TITLE_TOP = 28;
export const MARGIN_TOP = 52;
const TITLE_CHAR_PX = 7.5; // a 14 px title's mean character width
const TITLE_LINE_PX = 18;

/**
 * A chart panel's title, for a figure `width` px wide, below the toolbar's band: a title too long
 * for one line (a phone's chart, a title with figures) is broken before its last " (".
 * @returns {{title: object, extra: number}} Plotly's title, and the px its second line adds
 */
export function titleFit(title, width) {
  const cut = title.lastIndexOf(" (");
  const wrap = cut > 0 && title.length * TITLE_CHAR_PX > (width || 600) - 16;
  const text = wrap ? `${plotText(title.slice(0, cut))}<br>${plotText(title.slice(cut + 1))}` : plotText(title);
  return {
    title: {
      text, font: { size: 14 }, x: 0.01, xanchor: "left", yref: "container", y: 1, yanchor: "top", pad: { t: TITLE_TOP },
    },
    extra: wrap ? TITLE_LINE_PX : 0,
  };
}

/**
 * Tick spacing of an axis of whole numbers (steps) `span` wide on `px` pixels: 1, 2 or 5 x 10^k,
 * never under 1 (Plotly's own spacing puts ticks at half steps on a short run), at most one
 * tick per 80 px as Plotly does.
 */
export function wholeTicks(span, px) {
  const want = span / Math.max(3, Math.min(10, Math.floor(px / 80)));
  const base = 10 ** Math.floor(Math.log10(Math.max(want, 1)));
  return [1, 2, 5, 10].map((m) => m * base).find((d) => d >= want) ?? 1;
}

/**
 * Legend at the bottom of the figure, below the x-axis title, with room for as many rows as
 * a chart `width` px wide needs (a phone wraps 4 traces onto 2-4 rows).
 */
export function legendFit(width, count) {
  width = width || 600;
  const perRow = Math.max(1, Math.floor((width - 30) / 135));
  const rows = Math.ceil(count / perRow);
  return {
    legend: { ...BASE_LAYOUT.legend, yref: "container", y: 0, yanchor: "bottom" },
    margin: { ...BASE_LAYOUT.margin, b: 56 + rows * 20 },
    height: 250 + rows * 20,
  };
}

export function emptyNote(text) {
  return {
    text, xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
    font: { size: 13, color: "#8592a3" }, name: "empty-note",
  };
}

// Markers are shapes with their own label: an annotation in data coordinates would widen the
// autorange by the width of its text. A marker in the right third of `xRange` ([lo, hi], the
// data's x extent) puts its label on its left, where it is not cut by the plot's edge. Labels
// whose text would meet (a refusal and a limit change a few seconds apart) go into lanes above
// the plot: a marker in lane k has its line, and its label, k lanes (MARKER_LANE_PX each)
// higher, and the figure's top margin grows by the lanes used (labels stay clear of the data).
const MARKER_CHAR_PX = 6.2; // a 10 px label's widest mean character width
const MARKER_LANE_PX = 14; // a 10 px label's line, with room
const MARKER_LANES = 4; // past this many, labels share the highest lane
const MARKER_GAP_PX = 6;

/**
 * The lane of each marker's label (0: on the plot's top edge), for labels drawn on `view`
 * ({lo, hi, width}: the x range shown and the plot's width in px): a label goes into the lowest
 * lane where it meets no other label, no line of a marker in a higher lane crosses it, and its
 * own line crosses no label below it. Labels that read rightwards are placed from the right
 * (those that read leftwards from the left), so that a later label sits above the lines it spans.
 * @param {Array<{x: number, label: string}>} markers
 * @param {string[]} anchors "left" or "right" per marker: the side of its line its label reads
 * @returns {number[]} a lane per marker, in `markers`' order
 */
export function markerLanes(markers, anchors, view) {
  const lanes = markers.map(() => 0);
  if (!view || !(view.hi > view.lo) || !(view.width > 0)) return lanes;
  const px = (x) => ((x - view.lo) / (view.hi - view.lo)) * view.width;
  const placed = []; // {at, left, right, lane} px
  const key = (i) => (anchors[i] === "right" ? markers[i].x : -markers[i].x);
  const order = markers.map((_, i) => i).sort((a, b) =>
    (anchors[a] === "right") - (anchors[b] === "right") || key(a) - key(b));
  for (const i of order) {
    const at = px(markers[i].x);
    const width = String(markers[i].label).length * MARKER_CHAR_PX + 2 * MARKER_GAP_PX;
    const [left, right] = anchors[i] === "right" ? [at - width, at] : [at, at + width];
    const clash = (lane) => placed.some((p) =>
      (p.lane === lane && left < p.right && p.left < right)
      || (p.lane > lane && left <= p.at && p.at <= right)
      || (p.lane < lane && p.left <= at && at <= p.right));
    let lane = 0;
    while (lane < MARKER_LANES - 1 && clash(lane)) lane += 1;
    placed.push({ at, left, right, lane });
    lanes[i] = lane;
  }
  return lanes;
}

/**
 * The markers as Plotly line shapes with their labels, in lanes where they would meet
 * (`markerLanes`).
 * @param {Array<{x: number, label: string, color: string, dash?: string}>} markers
 * @param {number[]|null} xRange [lo, hi] of the data: a label in its right third reads leftwards
 * @param {{lo: number, hi: number, width: number, height: number}|null} view the x range shown
 *   and the plot's size in px; null: every label in the lowest lane, uncut
 * @returns {{shapes: object[], top: number}} the shapes, and the px the lanes above the lowest
 *   take (to add to the figure's top margin)
 */
export function markerShapes(markers, xRange = null, view = null) {
  const [lo, hi] = xRange || [0, 0];
  const anchors = markers.map((m) => (hi > lo && m.x > lo + (2 / 3) * (hi - lo) ? "right" : "left"));
  const known = view && view.hi > view.lo && view.width > 0 && view.height > 0;
  // A label longer than the room beside its line (a refusal's reason on a phone) is cut there.
  const labels = markers.map((m, i) => {
    if (!known) return m.label;
    const at = ((m.x - view.lo) / (view.hi - view.lo)) * view.width;
    const room = anchors[i] === "right" ? at : view.width - at;
    const chars = Math.max(12, Math.floor(room / MARKER_CHAR_PX));
    return m.label.length > chars ? `${m.label.slice(0, chars - 1)}…` : m.label;
  });
  const lanes = known ? markerLanes(markers.map((m, i) => ({ ...m, label: labels[i] })), anchors, view) : markers.map(() => 0);
  const shapes = markers.map((m, i) => ({
    type: "line", xref: "x", yref: "paper", x0: m.x, x1: m.x, y0: 0,
    y1: lanes[i] ? 1 + (lanes[i] * MARKER_LANE_PX) / view.height : 1,
    line: { color: m.color, width: 1.5, dash: m.dash || "dash" },
    label: {
      text: plotText(labels[i]), textangle: 0, textposition: "end", xanchor: anchors[i],
      font: { size: 10, color: m.color },
    },
  }));
  return { shapes, top: Math.max(0, ...lanes) * MARKER_LANE_PX };
}
