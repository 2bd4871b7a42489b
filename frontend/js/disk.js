// The data dir's disk: a banner under the top bar saying "disk full at PATH" while the server's
// writes fail for a full disk (GET /api/system/disk), gone once they work again. Checked every
// 10 s (every 3 s while full) and at once when any request answers 507 (api.js dispatches
// DISK_FULL_EVENT), so a failed save shows why right away.

import { api, DISK_FULL_EVENT } from "./api.js";
import { fill, fmtBytes, h } from "./ui.js";

const CLEAR_S = 10;
const FULL_S = 3;

function freeText(bytes) {
  return typeof bytes === "number" && bytes < 1024 ? `${bytes} bytes` : fmtBytes(bytes);
}

/** Keeps `banner` (hidden while writes work) in step with the server's disk condition. */
export function mountDiskBanner(banner) {
  let timer = null;

  async function check() {
    clearTimeout(timer);
    let full = false;
    try {
      const disk = await api.disk();
      full = disk.full;
      banner.hidden = !full;
      if (full) {
        fill(
          banner,
          h("strong", {}, `disk full at ${disk.path}`),
          ` — ${freeText(disk.free_bytes)} free. Runs, presets and notes cannot be saved until space is freed there; a run whose worker ended is recorded then.`,
        );
      }
    } catch (err) {
      console.warn("disk status", err);  // the system strip shows a server that is down
    }
    timer = setTimeout(check, (full ? FULL_S : CLEAR_S) * 1000);
  }

  window.addEventListener(DISK_FULL_EVENT, check);
  check();
}
