// REST client for the backend (docs/contracts.md "REST API").
//
// Every failure becomes an ApiError carrying the backend's one error body
// {"error": {code, message, field, details}}; network failures and non-JSON bodies are mapped
// onto the same shape so callers have exactly one thing to show. Nothing here swallows errors.

/** Dispatched on `window` when a request answers 507 (the data dir's disk is full). */
export const DISK_FULL_EVENT = "workbench:disk-full";

export class ApiError extends Error {
  /**
   * @param {number} status HTTP status (0 when the request never got an answer)
   * @param {{code: string, message: string, field: string|null, details: Array}} body
   */
  constructor(status, body) {
    super(body.message);
    this.name = "ApiError";
    this.status = status;
    this.code = body.code;
    this.field = body.field ?? null;
    this.details = Array.isArray(body.details) ? body.details : [];
  }

  /**
   * One sentence for a banner that names the field, then the status and code in brackets:
   * "overrides.max_steps is 0; expected greater than 0. (HTTP 422, validation_error)",
   * "Run 3 is succeeded; limits apply to running runs. (HTTP 409, conflict)".
   */
  describe() {
    const status = this.status ? `HTTP ${this.status}, ` : "";
    return `${this.sentence()} (${status}${this.code})`;
  }

  /** The message as a sentence naming the field: "FIELD: found 0, expected greater than 0"
   * (the backend's config checks) reads "FIELD is 0; expected greater than 0", pydantic's
   * "FIELD: Input should be…" reads "FIELD should be…", "FIELD: Field required" reads "FIELD is
   * required"; another message that does not name its field gets "(field FIELD)". */
  sentence() {
    let text = this.message.trim();
    const f = this.field;
    if (f && text.startsWith(`${f}: `)) {
      const rest = text.slice(f.length + 2);
      if (/^Input should /.test(rest)) text = `${f} should ${rest.slice("Input should ".length)}`;
      else if (/^Field required/.test(rest)) text = `${f} is required`;
      else if (/^Extra inputs are not permitted/.test(rest)) text = `${f} is not a known field`;
      else if (/^found .*, expected /.test(rest)) text = rest.replace(/^found (.*?), expected (.*)$/, `${f} is $1; expected $2`);
      else text = `${f}: ${rest}`;
    } else {
      if (/^[a-z]+ /.test(text)) text = text[0].toUpperCase() + text.slice(1);
      if (f && !text.includes(f)) text = `${text.replace(/[.]$/, "")} (field ${f})`;
    }
    return /[.!?)]$/.test(text) ? text : `${text}.`;
  }
}

/** Normalises any response body into the contract's error object. */
function errorBody(status, payload, fallbackText) {
  const err = payload && typeof payload === "object" ? payload.error : null;
  if (err && typeof err === "object" && typeof err.message === "string") {
    return {
      code: String(err.code ?? "error"),
      message: err.message,
      field: err.field ?? null,
      details: err.details ?? [],
    };
  }
  // FastAPI's own {"detail": ...} (e.g. a route the backend did not wrap) is still shown.
  if (payload && payload.detail !== undefined) {
    const detail = payload.detail;
    const message = typeof detail === "string" ? detail : JSON.stringify(detail);
    return { code: `http_${status}`, message, field: null, details: Array.isArray(detail) ? detail : [] };
  }
  return {
    code: `http_${status}`,
    message: fallbackText || `request failed with HTTP ${status}`,
    field: null,
    details: [],
  };
}

async function request(method, path, body) {
  const init = { method, headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (exc) {
    throw new ApiError(0, {
      code: "network_error",
      message: `${method} ${path} failed: ${exc.message}`,
      field: null,
      details: [],
    });
  }
  const text = await response.text();
  let payload = null;
  if (text) {
    try {
      payload = JSON.parse(text);
    } catch {
      payload = null;
    }
  }
  if (!response.ok) {
    // 507: a write failed for a full disk; the disk banner (disk.js) checks at once.
    if (response.status === 507) window.dispatchEvent(new Event(DISK_FULL_EVENT));
    throw new ApiError(response.status, errorBody(response.status, payload, text.slice(0, 300)));
  }
  if (text && payload === null) {
    throw new ApiError(response.status, {
      code: "bad_response",
      message: `${method} ${path} answered with non-JSON: ${text.slice(0, 120)}`,
      field: null,
      details: [],
    });
  }
  return payload;
}

function query(params) {
  const parts = [];
  for (const [key, value] of Object.entries(params || {})) {
    if (value === undefined || value === null || value === "") continue;
    parts.push(`${encodeURIComponent(key)}=${encodeURIComponent(value)}`);
  }
  return parts.length ? `?${parts.join("&")}` : "";
}

const enc = encodeURIComponent;

export const api = {
  system: () => request("GET", "/api/system"),
  /** `{full, path, free_bytes, since, failures, message}`: whether writes fail for a full disk. */
  disk: () => request("GET", "/api/system/disk"),
  /** The demo-asset build: `{state, running, stages: [{name, state, done, total, unit,
   * elapsed_s, estimate_s, kept, error}], failed_stage, error, estimate_s, blocked_presets}`. */
  assets: () => request("GET", "/api/assets"),
  /** Start, retry or resume the build (409 while one runs). */
  buildAssets: () => request("POST", "/api/assets/build"),

  presets: () => request("GET", "/api/presets"),
  preset: (name) => request("GET", `/api/presets/${enc(name)}`),
  createPreset: (name, config, description = "") => request("POST", "/api/presets", { name, config, description }),
  /** A user preset (403 read_only for a built-in one). */
  deletePreset: (name) => request("DELETE", `/api/presets/${enc(name)}`),

  /** @param {{status?: string, preset?: string, tag?: string}} filters */
  runs: (filters) => request("GET", `/api/runs${query(filters)}`),
  run: (id) => request("GET", `/api/runs/${enc(id)}`),
  /** @param {{preset: string, name?: string, overrides?: object}} body */
  createRun: (body) => request("POST", "/api/runs", body),
  /** @param {{notes?: string, tags?: string[]}} body */
  updateRun: (id, body) => request("PATCH", `/api/runs/${enc(id)}`, body),
  cancelRun: (id) => request("POST", `/api/runs/${enc(id)}/cancel`),
  /** The dataset scan a run would start with. @param {{preset: string, overrides?: object}} body */
  scanData: (body) => request("POST", "/api/data/scan", body),
  /** What POST /api/runs would refuse in a run request, every problem at once.
   * @param {{preset: string, overrides?: object}} body
   * @returns {Promise<{valid: boolean, problems: Array<{field: string, message: string}>}>} */
  checkRun: (body) => request("POST", "/api/runs/check", body),
  deleteRun: (id) => request("DELETE", `/api/runs/${enc(id)}`),

  /**
   * Telemetry records, oldest first.
   * @param {{since?: number, limit?: number, source?: string, kind?: string, buckets?: number}} params
   * @returns {Promise<{data: Array<object>, count: number, next_since: number|null}>}
   */
  telemetry: (id, params) => request("GET", `/api/runs/${enc(id)}/telemetry${query(params)}`),

  /** LiveLimits body (runtime/stagehand/config/memory.py); 409 when the run is not running. */
  setLimits: (id, limits) => request("PATCH", `/api/runs/${enc(id)}/limits`, limits),

  /** Live limits: `{preset, now, paths, pairs, history: [{seq, step, time, request_id, changed}]}`. */
  limits: (id) => request("GET", `/api/runs/${enc(id)}/limits`),
  /** The preset fields a run's own folder drops: `{bound: {"data.path": ["data.factory", …]}}`. */
  folderFields: () => request("GET", "/api/overrides/folders"),

  compare: (ids, metrics) =>
    request("GET", `/api/compare${query({ ids: ids.join(","), metrics: (metrics || []).join(",") })}`),

  artifacts: (id) => request("GET", `/api/runs/${enc(id)}/artifacts`),
  /** `{lora: [{name, size, modified, url}], checkpoints: [{name, step, size, modified}], resumable}` */
  outputs: (id) => request("GET", `/api/runs/${enc(id)}/outputs`),
  /** The end of the worker's own output: `{text}` (null when it wrote none). */
  workerLog: (id) => request("GET", `/api/runs/${enc(id)}/log`),
  /** Continue a run that stopped early from its last checkpoint (409 otherwise). */
  resumeRun: (id) => request("POST", `/api/runs/${enc(id)}/resume`),

  /** What a diffusers pipeline folder holds (family, components, streamed blocks). */
  inspectPipeline: (body) => request("POST", "/api/pipelines/inspect", body),
  plan: (body) => request("POST", "/api/plan", body),
  /** Whether the next plan on `cpu` measures this machine first: `{will_measure, measuring,
   * measurements, wanted, measure_s}`. */
  cpuProfile: () => request("GET", "/api/plan/cpu-profile"),
  /** A succeeded run's plan next to its measured figures (404 until the backend made it). */
  calibration: (id) => request("GET", `/api/runs/${enc(id)}/calibration`),
  /** @param {{preset: string, budget_mb: number, device?: string, trial_steps?: number}} body */
  createTune: (body) => request("POST", "/api/tunes", body),
  tune: (id) => request("GET", `/api/tunes/${enc(id)}`),
  tunes: () => request("GET", "/api/tunes"),
  cancelTune: (id) => request("POST", `/api/tunes/${enc(id)}/cancel`),
  /** @param {{run_id: number, name: string}} body */
  saveTunePreset: (id, body) => request("POST", `/api/tunes/${enc(id)}/preset`, body),
  artifactUrl: (id, name) => `/api/runs/${enc(id)}/artifacts/${enc(name)}`,
};

/** Run status names and groups (FINISHED: a run in one of these will not produce more records),
 * served by the server from backend/workbench/contract/status.py. */
export { ACTIVE, FINISHED, RESUMABLE, STATUSES } from "./contract.js";
