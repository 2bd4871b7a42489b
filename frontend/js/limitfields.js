// The live limits as the dashboard shows them. Which fields there are, their config paths and
// which are watermarks come from the server (runtime/stagehand/config/limits.py): `LIMIT_PATHS` and
// `LIMIT_PAIRS` of /static/js/contract.js, or a run's GET /api/runs/{id}/limits. Here only what
// each field is called.

import { LIMIT_PAIRS, LIMIT_PATHS } from "./contract.js";

// What each LiveLimits field is called, and a hint; a field missing here shows its name.
const LABELS = {
  vram_high_watermark_mb: ["VRAM high watermark (MB)", "Prefetch stops where a load would cross it."],
  vram_low_watermark_mb: ["VRAM low watermark (MB)", "Blocks are evicted until usage is under it."],
  prefetch_window_blocks: ["Prefetch window (blocks)", "Blocks loaded ahead of use; 0 turns prefetch off."],
  max_inflight_transfers: ["In-flight block H2D copies", "Block copies host → device at once."],
  activation_vram_high_watermark_mb: ["Spill high watermark (MB)", "Activations spill to the host above it."],
  activation_vram_low_watermark_mb: ["Spill low watermark (MB)", "Spilling stops below it."],
  max_inflight_d2h: ["Spill in-flight D2H", "Spill copies device → host at once."],
  max_inflight_h2d: ["Restore in-flight H2D", "Restore copies host → device at once."],
};

/** `[{field, path, label, hint, int}]` for the server's `{paths, pairs}` (contract.js's when not
 * given), in its order: watermarks are MB, the other fields whole numbers. */
export function limitFields({ paths, pairs } = { paths: LIMIT_PATHS, pairs: LIMIT_PAIRS }) {
  const watermarks = new Set(pairs.flat());
  return Object.entries(paths).map(([field, path]) => {
    const [label, hint] = LABELS[field] || [field, ""];
    return { field, path, label, hint, int: !watermarks.has(field) };
  });
}
