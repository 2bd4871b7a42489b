// The New run page's field checks: the run request as it stands, asked of the server a moment
// after a field changes (POST /api/runs/check: the rules POST /api/runs applies, every problem
// at once, the folders' too), so that each field's error shows while it is typed, by the
// server's rules rather than a copy of them here. A folder field is checked once the user
// leaves it (a half-typed path is not an error yet). Nothing is asked while the page holds text
// it marked invalid: the request would carry the last good value, not what is typed.

import { api } from "../../api.js";

export const CHECK_MS = 350; // after the last keystroke

export class FieldChecks {
  /**
   * @param {object} opts
   * @param {function(): ({preset: string, overrides: object}|null)} opts.request the run
   *   request to check, or null when none can be sent (a field marked invalid, no preset)
   * @param {function(Array<{field: string, message: string}>): void} opts.onResult called with
   *   the problems of the request as it still stands (an answer to an older request is dropped)
   */
  constructor({ request, onResult }) {
    this.request = request;
    this.onResult = onResult;
    this.timer = null;
    this.asked = 0; // the number of the newest check sent
  }

  /** Checks the request `delay` ms from now (a later call moves it). */
  schedule(delay = CHECK_MS) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.now(), delay);
  }

  /** Drops the check scheduled (a field is being typed in; Start is sending the request). */
  cancel() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** Checks the request now; resolves once the answer (if still current) was handed on. */
  async now() {
    this.cancel();
    const body = this.request();
    if (!body) return;
    const asked = ++this.asked;
    let answer;
    try {
      answer = await api.checkRun(body);
    } catch {
      return; // no answer (a deleted preset, the server gone): Start says why, as before
    }
    const still = this.request();
    if (asked !== this.asked || JSON.stringify(still) !== JSON.stringify(body)) return;
    this.onResult(answer.problems || []);
  }
}
