// The run page's samples card: samples by the step they were drawn at (`step-NNNNNN-ii.png`
// before and during training, `sample-ii.png` at the end), shown one step at a time with a
// slider, the newest by default. A later step shows each prompt's step-0 image (the model
// before training) beside it.

import { api } from "../../api.js";
import { sampleStep, stepText } from "../../samples.js";
import { clearErrors, fill, h, showError } from "../../ui.js";

export class SamplesCard {
  /**
   * @param {object} view the page's `{run}` (the API's Run, once loaded)
   * @param {HTMLElement} errors where API errors are shown
   */
  constructor(view, errors) {
    this.view = view;
    this.errors = errors;
    this.names = new Set();
    this.steps = new Map(); // step (Infinity: the final samples) -> [{name, caption}]
    this.gallery = h("div", { class: "gallery", id: "samples" });
    this.slider = h("input", { type: "range", id: "sample-step", min: "0", max: "0", step: "1", value: "0" });
    this.label = h("span", { id: "sample-step-label", class: "muted" });
    this.sliderRow = h("div", { class: "sample-controls", hidden: true }, h("label", { for: "sample-step" }, "step"), this.slider, this.label);
    this.card = h("section", { class: "card", id: "samples-card", hidden: true }, h("h2", {}, "Samples"), this.sliderRow, this.gallery);
    this.slider.addEventListener("input", () => this.show(Number(this.slider.value)));
  }

  show(index) {
    const { run } = this.view;
    const steps = [...this.steps.keys()].sort((a, b) => a - b);
    const step = steps[index];
    const last = run && run.summary ? run.summary.steps_done : null;
    this.label.textContent = `${stepText(step, last)} · ${index + 1} of ${steps.length}`;
    const before = step !== 0 && this.steps.has(0) ? this.steps.get(0) : [];
    const image = (name, caption, at, cls) => {
      const url = api.artifactUrl(run.id, name);
      return h("a", { href: url, target: "_blank", class: cls },
        h("img", { src: url, alt: `${caption || name}, ${stepText(at, last)}`, loading: "lazy" }),
        before.length ? h("span", { class: "sample-at" }, stepText(at, last)) : null);
    };
    this.gallery.classList.toggle("paired", before.length > 0);
    fill(this.gallery, ...(this.steps.get(step) || []).map(({ name, caption }) => {
      const prompt = name.slice(name.lastIndexOf("-")); // "-ii.png": the prompt's index
      const first = before.find((s) => s.name.endsWith(prompt));
      return h("figure", { dataset: { step: String(step) } },
        h("div", { class: "sample-pair" },
          first ? image(first.name, caption, 0, "sample-before") : null,
          image(name, caption, step, "sample-now")),
        h("figcaption", {}, caption || name));
    }));
  }

  add(name, caption) {
    if (this.names.has(name)) return;
    this.names.add(name);
    this.card.hidden = false;
    const step = sampleStep(name);
    if (!this.steps.has(step)) this.steps.set(step, []);
    this.steps.get(step).push({ name, caption });
    this.steps.get(step).sort((a, b) => (a.name < b.name ? -1 : 1));
    const count = this.steps.size;
    const slider = this.slider;
    const atEnd = Number(slider.value) >= Number(slider.max);
    slider.max = String(count - 1);
    this.sliderRow.hidden = count < 2;
    if (atEnd) slider.value = String(count - 1); // follow the newest unless the user moved
    this.show(Number(slider.value));
  }

  /** The images among the run's artifacts (GET /api/runs/{id}/artifacts). */
  async load() {
    try {
      const list = await api.artifacts(this.view.run.id);
      clearErrors(this.errors, "samples");
      for (const item of list.data || []) {
        const name = typeof item === "string" ? item : item.name;
        if (name && /\.(png|jpe?g|webp|gif)$/i.test(name)) this.add(name, item.prompt);
      }
    } catch (err) {
      showError(this.errors, err, "samples");
    }
  }
}
