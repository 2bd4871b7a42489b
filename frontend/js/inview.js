// Whether an element is near the window, as the browser last observed it (IntersectionObserver):
// charts.js redraws a chart out of view for live points less often (OUT_OF_VIEW_MS).

/** Distance (px) from the window within which an element counts as in view: a chart scrolled
 * towards is drawn before it arrives. */
export const IN_VIEW_MARGIN_PX = 200;

/** How long (ms) after its last draw a chart out of view redraws for live points. A live run's
 * page at 1400x1000 shows 3 of its 9 charts; the 6 below redrew as often as those (~2.5 s).
 * Every 10 s: chromium 5.6-6.6 -> 3.9-5.4 CPU-s per 10 s of a live synthetic run's page here. */
export const OUT_OF_VIEW_MS = 10000;

/**
 * Calls `onChange(inView)` whenever `el` comes within IN_VIEW_MARGIN_PX of the window or leaves
 * it (first with its state once observed, a frame later).
 * @returns {IntersectionObserver|null} `disconnect()` ends it; null where the browser has no
 *   IntersectionObserver (the caller then keeps the element as in view)
 */
export function watchInView(el, onChange) {
  if (typeof IntersectionObserver === "undefined") return null;
  const observer = new IntersectionObserver(
    (entries) => onChange(entries[entries.length - 1].isIntersecting),
    { rootMargin: `${IN_VIEW_MARGIN_PX}px` },
  );
  observer.observe(el);
  return observer;
}
