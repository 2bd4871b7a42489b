// Sample images by the step they were drawn at: `step-NNNNNN-ii.png` during training
// (`samples.every`), `sample-ii.png` at the end. Shared by the run page and Compare.

/** The step a sample file was drawn at; Infinity for the final samples. */
export function sampleStep(name) {
  const m = /^step-(\d+)-/.exec(name);
  return m ? Number(m[1]) : Infinity;
}

/** "step 3", or "final (step 8)" when the run's last step is known. */
export function stepText(step, lastStep) {
  return step === Infinity ? `final${lastStep != null ? ` (step ${lastStep})` : ""}` : `step ${step}`;
}

/** The image files of an artifacts listing grouped by step: Map(step -> [names, sorted]). */
export function groupSamples(names) {
  const out = new Map();
  for (const name of names) {
    if (!/\.(png|jpe?g|webp|gif)$/i.test(name)) continue;
    const step = sampleStep(name);
    if (!out.has(step)) out.set(step, []);
    out.get(step).push(name);
  }
  for (const list of out.values()) list.sort();
  return out;
}

/** The prompt a sample file was drawn from: `prompts[ii]` of `…-ii.png` (the worker draws one
 * image per prompt of the run's `samples.prompts`, in order); undefined when not known. */
export function samplePrompt(name, prompts) {
  const m = /-(\d+)\.[a-z]+$/i.exec(name);
  return m && Array.isArray(prompts) ? prompts[Number(m[1])] : undefined;
}
