// The run page's records feed: every telemetry record (stored ones first, then the stream's)
// goes to the charts and the run's figures, then to the one handler its `source/kind` names.

import { addFigures } from "../../runfigures.js";

/**
 * Returns `onRecords(records)` for the page and the stream.
 * @param {object} view the page's `{charts, live}`: the charts (null until built) and what the
 *   records told (`live.figures` gathers the step records' figures)
 * @param {Object<string, function(object): boolean|void>} routes `"source/kind"` -> handler; a
 *   handler returns true when the header must be drawn again
 * @param {function(): void} onDirty draws the header, once per batch at most
 */
export function recordFeed(view, routes, onDirty) {
  return (records) => {
    let dirty = false;
    for (const rec of records) {
      if (view.charts) view.charts.ingest(rec);
      if (rec.kind === "step") dirty = addFigures(view.live.figures, rec) || dirty;
      const route = routes[`${rec.source}/${rec.kind}`];
      if (route) dirty = route(rec) === true || dirty;
    }
    if (dirty) onDirty();
  };
}
