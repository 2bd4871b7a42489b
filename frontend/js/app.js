// Page wiring: the system strip and a hash router (#/runs, #/new, #/runs/ID, #/compare?ids=1,2,
// #/tunes, #/tunes/ID).
// Each page module exports `mount(root, route) -> unmount()`; the router unmounts the previous
// page (closing its sockets and timers) before mounting the next one.

import { api } from "./api.js";
import { mountAssetStrip } from "./assets.js";
import { mountDiskBanner } from "./disk.js";
import { fill, fmtMB, h, parseHash, showError } from "./ui.js";
import * as runsPage from "./pages/runs.js";
import * as newRunPage from "./pages/newrun.js";
import * as runPage from "./pages/run.js";
import * as comparePage from "./pages/compare.js";
import * as tunePage from "./pages/tune.js";

const root = document.getElementById("page");
let unmount = null;

function pick(parts) {
  if (parts[0] === "runs" && parts[1]) return { page: runPage, nav: "runs" };
  if (parts[0] === "new") return { page: newRunPage, nav: "new" };
  if (parts[0] === "compare") return { page: comparePage, nav: "compare" };
  if (parts[0] === "tunes") return { page: tunePage, nav: "tunes" };
  return { page: runsPage, nav: "runs" };
}

function route() {
  const { parts, params } = parseHash();
  const { page, nav } = pick(parts);
  if (unmount) {
    try {
      unmount();
    } catch (exc) {
      console.error("unmount failed", exc);
    }
  }
  unmount = null;
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", a.dataset.nav === nav);
  }
  fill(root);
  try {
    unmount = page.mount(root, { parts, params }) || null;
  } catch (exc) {
    showError(root, exc, "page failed to load");
    console.error(exc);
  }
}

// The Ray cluster a --executor ray server submits to: nodes alive, GPUs (and CPUs) used/total.
function clusterItem(item, c) {
  if (!c.reachable) return item("Ray", `unreachable at ${c.address}`, "cluster");
  const gpus = c.gpus_total ? `GPUs ${c.gpus_used}/${c.gpus_total} used` : "no GPUs";
  return item("Ray", `${c.nodes_alive} node${c.nodes_alive === 1 ? "" : "s"}, ${gpus}, CPUs ${c.cpus_used}/${c.cpus_total} used`, "cluster");
}

async function loadSystem() {
  const strip = document.getElementById("system-strip");
  try {
    const s = await api.system();
    const item = (label, value, key) =>
      h("span", { class: "sys-item", "data-key": key }, h("span", { class: "sys-label" }, label), " ", value ?? "–");
    fill(
      strip,
      item("device", `${s.device_name || s.device}${s.device && s.device_name ? ` (${s.device})` : ""}`, "device"),
      item("VRAM", s.vram_total_mb ? fmtMB(s.vram_total_mb) : "none", "vram"),
      item("RAM", fmtMB(s.ram_total_mb), "ram"),
      item("torch", s.torch_version, "torch"),
      s.cuda_version ? item("CUDA", s.cuda_version, "cuda") : null,
      item("workbench", s.version, "version"),
      s.cluster ? clusterItem(item, s.cluster) : null,
    );
    if (s.cluster) setTimeout(loadSystem, 10000);  // free GPUs change as runs come and go
  } catch (err) {
    fill(strip);
    showError(strip, err, "system info");
  }
}

// Errors that escape a page (a rejected promise nobody awaited) still reach the user.
window.addEventListener("unhandledrejection", (event) => {
  showError(document.getElementById("global-errors"), event.reason || new Error("unknown error"), "unexpected");
});

window.addEventListener("hashchange", route);
loadSystem();
const diskBanner = h("div", { id: "disk-banner", class: "disk-banner", role: "alert", hidden: true });
document.getElementById("system-strip").after(diskBanner);
mountDiskBanner(diskBanner);
mountAssetStrip(document.getElementById("asset-strip"));
route();
