// The New run page's pipeline folder panel: type the folder of a diffusers pipeline (as
// downloaded from the Hub), Inspect (POST /api/pipelines/inspect) shows what was found --
// family, each component's class, parameter count and dtype, the blocks the weight runtime
// will stream and their size -- and "Use this folder" puts it into the config as model.path.

import { api } from "../../api.js";
import { fill, h, showError } from "../../ui.js";

const MB = 1024 * 1024;

function count(n) {
  if (n == null) return "";
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(2)} M`;
  return n.toLocaleString("en-US");
}

function megabytes(bytes) {
  if (bytes == null) return "";
  return bytes >= MB ? `${(bytes / MB).toFixed(1)} MB` : `${(bytes / 1024).toFixed(1)} KB`;
}

/** What `inspect` found, as a summary line, a components table and the streamed blocks. */
function found(info) {
  const blocks = info.blocks || [];
  return h("div", { id: "pipeline-found" },
    h("p", { class: "pipeline-summary" },
      h("strong", { id: "pipeline-family" }, info.family), ` (${info.pipeline_class}) `,
      info.trainable ? h("span", { class: "badge", "data-status": "succeeded" }, "trainable")
        : h("span", { class: "badge", "data-status": "failed" }, "not trainable yet")),
    h("div", { class: "table-wrap" },
      h("table", { class: "runs-table", id: "pipeline-components" },
        h("thead", {}, h("tr", {}, ["component", "class", "parameters", "dtype", "size"].map((t) => h("th", {}, t)))),
        h("tbody", {}, (info.components || []).map((c) => h("tr", { "data-component": c.name },
          h("td", {}, c.name), h("td", {}, c.class_name), h("td", { class: "num" }, count(c.parameters)),
          h("td", {}, c.dtype || ""), h("td", { class: "num" }, megabytes(c.nbytes))))))),
    h("p", { id: "pipeline-blocks" },
      `${blocks.length} blocks streamed by the weight runtime, largest ${megabytes(info.largest_block_bytes)}, `
      + `total ${megabytes(info.blocks_total_bytes)}`),
    h("details", {}, h("summary", {}, "block list"),
      h("ul", { class: "pipeline-block-list" }, blocks.map((b) => h("li", {}, `${b.name}: ${megabytes(b.nbytes)}`)))));
}

/**
 * @param {{onUse: (path: string, expert: string|null) => void, initial?: string}} opts
 * @returns {HTMLElement}
 */
export function pipelinePanel({ onUse, initial }) {
  // Wan 2.2's two experts: a run trains one (model.expert).
  const expertSel = h("select", { id: "pipeline-expert", hidden: true });
  const input = h("input", { id: "pipeline-path", type: "text", placeholder: "/path/to/FLUX.1-dev (model_index.json inside)", value: initial || "" });
  const errors = h("div", { class: "page-errors", id: "pipeline-errors" });
  const result = h("div", { id: "pipeline-result" });
  const useBtn = h("button", {
    id: "use-pipeline",
    disabled: true,
    onclick: () => onUse(input.value.trim(), expertSel.hidden ? null : expertSel.value),
  }, "Use this folder");
  const inspectBtn = h("button", { id: "inspect-pipeline", onclick: inspect }, "Inspect");

  async function inspect() {
    fill(errors);
    fill(result);
    useBtn.disabled = true;
    const path = input.value.trim();
    if (!path) {
      showError(errors, new Error("type the pipeline folder's path"), "inspect");
      return;
    }
    inspectBtn.disabled = true;
    try {
      const info = await api.inspectPipeline({ path });
      fill(result, found(info));
      const experts = info.experts || [];
      fill(expertSel, experts.map((e) => h("option", { value: e }, `expert: ${e}`)));
      expertSel.hidden = experts.length === 0;
      useBtn.disabled = !info.trainable;
    } catch (err) {
      showError(errors, err, "inspect");
    } finally {
      inspectBtn.disabled = false;
    }
  }

  input.addEventListener("keydown", (e) => { if (e.key === "Enter") inspect(); });
  return h("div", { class: "pipeline-panel" },
    h("h2", {}, "Pipeline folder"),
    h("div", { class: "toolbar" }, input, inspectBtn, expertSel, useBtn),
    errors, result);
}
