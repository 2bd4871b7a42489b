// The New run page's JSON editor: the whole config being edited (`doc.config`), as text.

import { h } from "../../ui.js";

export class JsonEditor {
  /**
   * @param {object} doc the page's `{config}`: the config being edited
   * @param {function(): void} onParsed called once the text became `doc.config`
   */
  constructor(doc, onParsed) {
    this.doc = doc;
    this.onParsed = onParsed;
    this.area = h("textarea", { id: "config-json", class: "json-editor", spellcheck: "false", rows: 24 });
    this.error = h("div", { class: "field-error", id: "config-json-error" });
    this.valid = true; // false while the text is not a JSON object (the config is the last one that was)
    this.area.addEventListener("input", () => this.parse());
  }

  show() {
    this.area.value = JSON.stringify(this.doc.config, null, 2);
    this.valid = true;
    this.area.classList.remove("invalid");
  }

  /** The text into `doc.config`; false (and the reason shown) when it is not a JSON object. */
  parse() {
    try {
      const parsed = JSON.parse(this.area.value);
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("the config must be a JSON object");
      this.doc.config = parsed;
      this.error.textContent = "";
      this.valid = true;
      this.area.classList.remove("invalid");
      this.onParsed();
      return true;
    } catch (exc) {
      this.error.textContent = `JSON: ${exc.message}`;
      this.valid = false;
      this.area.classList.add("invalid");
      return false;
    }
  }
}
