// Live telemetry of one run over WebSocket `/api/runs/{id}/stream?since=SEQ`
// (docs/contracts.md): frames are {"records": [...]} and {"run": {...}}.
//
// The stream owns the resume point: it remembers the highest `seq` delivered and, when the
// socket drops, reconnects with exponential backoff asking for `since=<that seq>`, so every
// record reaches the page exactly once (duplicates from an overlapping replay are dropped
// here, not in the charts).

const BACKOFF_START_MS = 500;
const BACKOFF_MAX_MS = 10000;
// docs: backend/workbench/api/stream.py. 4400 bad request, 4401 token, 4404 no such run: retrying cannot
// help. 4408: this client fell too far behind; reconnecting with `since` is the cure.
const FATAL_CLOSE_CODES = new Set([4400, 4401, 4404]);
const TOO_SLOW = 4408;

/** Connection states; `onState` receives one of these with a detail object. */
export const StreamState = Object.freeze({
  CONNECTING: "connecting", // first socket opening
  LIVE: "live", // open and caught up
  CATCHING_UP: "catching-up", // reopened after a drop, replaying what was missed
  RECONNECTING: "reconnecting", // closed unexpectedly, waiting for the next attempt
  CLOSED: "closed", // closed by us, or the run finished and the server closed it
});

export class RunStream {
  /**
   * @param {string|number} runId
   * @param {object} handlers
   * @param {(records: object[]) => void} handlers.onRecords new records in seq order, each once
   * @param {(run: object) => void} [handlers.onRun] run row on status changes
   * @param {(state: string, detail: object) => void} [handlers.onState]
   * @param {number} [since] last seq already drawn (0 = from the start)
   * @param {(run: object|null) => boolean} [isFinished] no reconnect once this says true
   */
  constructor(runId, handlers, since = 0, isFinished = () => false) {
    this.runId = runId;
    this.handlers = handlers;
    this.lastSeq = since;
    this.isFinished = isFinished;
    this.attempt = 0;
    this.ws = null;
    this.timer = null;
    this.stopped = false;
    this.lastRun = null;
    this.lastError = null;
    this.state = null;
    this.stateLog = [];
  }

  start() {
    this.stopped = false;
    this._open(StreamState.CONNECTING);
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.ws) {
      this.ws.onclose = null;
      this.ws.close();
      this.ws = null;
    }
    this._setState(StreamState.CLOSED, { lastSeq: this.lastSeq });
  }

  /** Drops the socket as a network failure would (used by the reconnect test). */
  simulateDrop() {
    if (this.ws) this.ws.close(4000, "simulated drop");
  }

  _url() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    return `${proto}//${location.host}/api/runs/${encodeURIComponent(this.runId)}/stream?since=${this.lastSeq}`;
  }

  _setState(state, detail) {
    this.state = state;
    // Bounded log of transitions: what the page (and the reconnect test) can look back on.
    this.stateLog.push(state);
    if (this.stateLog.length > 50) this.stateLog.shift();
    if (this.handlers.onState) this.handlers.onState(state, detail || {});
  }

  _open(state) {
    this._setState(state, { lastSeq: this.lastSeq, attempt: this.attempt });
    let ws;
    try {
      ws = new WebSocket(this._url());
    } catch (exc) {
      this._scheduleReconnect(`cannot open socket: ${exc.message}`);
      return;
    }
    this.ws = ws;
    let gotFrame = false;
    ws.onmessage = (event) => {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        this._setState(this.state, { error: `bad frame: ${String(event.data).slice(0, 80)}` });
        return;
      }
      if (!gotFrame) {
        gotFrame = true;
        this.attempt = 0;
      }
      if (frame.error) {
        // The server explains itself before closing (4400/4401/4404/4408).
        this.lastError = frame.error;
        this._setState(this.state, { error: `${frame.error.code}: ${frame.error.message}`, lastSeq: this.lastSeq });
        return;
      }
      if (frame.run) {
        this.lastRun = frame.run;
        if (this.handlers.onRun) this.handlers.onRun(frame.run);
      }
      if (Array.isArray(frame.records) && frame.records.length) {
        const fresh = frame.records.filter((r) => typeof r.seq === "number" && r.seq > this.lastSeq);
        if (fresh.length) {
          this.lastSeq = fresh[fresh.length - 1].seq;
          this.handlers.onRecords(fresh);
        }
      }
      if (this.state !== StreamState.LIVE) this._setState(StreamState.LIVE, { lastSeq: this.lastSeq });
    };
    ws.onclose = (event) => {
      this.ws = null;
      if (this.stopped) return;
      if (FATAL_CLOSE_CODES.has(event.code)) {
        const err = this.lastError;
        this._setState(StreamState.CLOSED, {
          lastSeq: this.lastSeq,
          error: err ? `${err.code}: ${err.message}` : `stream closed with code ${event.code}`,
        });
        return;
      }
      if (event.code === TOO_SLOW) this.attempt = 0; // nothing wrong with the network: retry at once
      if (this.isFinished(this.lastRun)) {
        this._setState(StreamState.CLOSED, { lastSeq: this.lastSeq, finished: true });
        return;
      }
      this._scheduleReconnect(`socket closed (code ${event.code}${event.reason ? `: ${event.reason}` : ""})`);
    };
    ws.onerror = () => {
      // onclose follows and schedules the retry; nothing to add here.
    };
  }

  _scheduleReconnect(reason) {
    this.attempt += 1;
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_START_MS * 2 ** (this.attempt - 1));
    // Jitter so that several open tabs do not reconnect in lockstep.
    const delay = Math.round(base * (0.8 + 0.4 * Math.random()));
    this._setState(StreamState.RECONNECTING, {
      reason,
      attempt: this.attempt,
      delayMs: delay,
      lastSeq: this.lastSeq,
    });
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      if (!this.stopped) this._open(StreamState.CATCHING_UP);
    }, delay);
  }
}
