"""Calibration from finished runs: what a run measured next to what its plan predicted, and
the ratios later plans for the same device and family apply.

A run's prediction is the plan of the config it started with (the one ``config.json`` holds)
on the device profile it ran on. The figures compared, per run:

- ``peak_vram_mb``: the training stage's peak (the summary's ``peak_vram_mb``) against the
  plan's larger of the trace step's and the steady state's peak (the run's peak is over all of
  its steps, the trace step included).
- ``step_ms``: the summary's mean step time against the plan's mean over as many steps as the
  run did (its first step is the trace step, the rest steady).
- ``host_ram_mb``: the largest process RSS of the run's step records against the plan's host
  RAM peak (the plan counts pinned buffers, block masters and tracked bytes, not the Python
  process, the text encoder or the allocator's caches: the ratio carries those).
- ``pinned_mb``: the largest ``pinned_mb`` of the step records against the plan's pinned bytes.

With weight streaming, what the run's last step moved beside what the plan's steady step moves
(``TRANSFERS``): block loads, H2D MB, prefetch misses (uses that loaded their block on demand)
and host waits (uses that waited on a copy in flight), from its last ``stagehand/step`` record.
These are counts the schedule decides, not scales: they are shown, and take no part in the
ratios later plans apply (a difference is the plan's schedule differing from the run's).

A ratio is ``measured / predicted``. A later plan multiplies its figures by the median of the
ratios of the newest runs of its device and family (``combine``: ``RUNS`` at most), each figure
by its own, and says which runs the ratios came from (``apply``). A ratio outside
``RATIO_BOUNDS`` is refused, not averaged in: see NOTE [ Ratios the model can be off by ]. A
median of fewer than ``FULL_RUNS`` runs is damped toward 1: see NOTE [ A lone ratio ].

NOTE [ Ratios the model can be off by ]
The model is off by a bounded factor for the figures it models; a ratio far outside that bound
says the measurement or the profile was disturbed, not the model: a CPU profile measured while
the machine was loaded predicted 683 ms for a run that took 32 ms (x0.047), and every later plan
of that device came out 21x too fast. Measured so far (docs/plan.md): VRAM
x0.83-0.92 on CPU, peaks of tune trials within 6.4%; step time x1.85-2.95 on a loaded 2-core
machine (the trainer's data, loss and telemetry are not modelled); pinned x1.0. The bounds
leave room for that and refuse what no model error explains: VRAM and pinned within 2x, step
time within 5x. Host RAM has no bound: its ratio carries the Python process (RSS of ~700 MB
against a tiny model's few MB), which the model does not count. The median of several runs then
damps the noise that stays inside the bounds (one run's step ratio is as noisy as its steps).

NOTE [ A lone ratio ]
The median damps a disturbance only once there are runs to outvote it: with one or two runs a
disturbance under the bounds was applied in full (one run at x4.9 scaled every later plan by
x4.9). So the median of ``n`` runs is shrunk toward 1, the model's own figure, geometrically:
``median ** min(1, n / FULL_RUNS)``. Geometric because a ratio is a factor: x4.9 and x1/4.9 are
equally far from 1 and are damped alike (one run: x1.70 and x0.59; two runs: x2.88 and x0.35);
from ``FULL_RUNS`` runs on, where a median outvotes one disturbed run, it applies in full. The
plan shows both, the median and the factor applied (``describe``, ``calibration.medians``).
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

from stagehand.config.memory import MB

FIGURES = ("peak_vram_mb", "step_ms", "host_ram_mb", "pinned_mb")
RATIO_BOUNDS: dict[str, tuple[float, float] | None] = {
    "peak_vram_mb": (0.5, 2.0),
    "step_ms": (0.2, 5.0),
    "host_ram_mb": None,
    "pinned_mb": (0.5, 2.0),
}
"""Figure -> (lowest, highest) ratio a later plan takes from a run; None: no bound. See NOTE
[ Ratios the model can be off by ]."""
RUNS = 5
"""Newest runs of a device and family whose ratios a plan takes the median of."""
FULL_RUNS = 3
"""Runs from which a figure's median applies in full; fewer are damped toward 1 (NOTE [ A lone
ratio ]): the fewest whose median one disturbed run cannot move outside the others' range."""


TRANSFERS = {
    "block_loads_per_step": ("block_loads_per_step", "blocks_loaded", 1),
    "h2d_mb_per_step": ("h2d_bytes_per_step", "h2d_bytes", MB),
    "misses_per_step": ("misses_per_step", "prefetch_misses", 1),
    "waits_per_step": ("waits_per_step", "host_waits", 1),
}
"""Figure -> (its key in the plan's ``transfers``, its key in a ``stagehand/step`` record, the
unit it is divided by)."""


def damped(median: float, runs: int) -> float:
    """The factor a plan applies for the ``median`` ratio of ``runs`` runs: ``median`` shrunk
    toward 1 in log space by ``runs / FULL_RUNS`` (NOTE [ A lone ratio ])."""
    return median ** min(1.0, runs / FULL_RUNS)


def predicted_figures(plan: dict[str, Any], steps_done: int | None) -> dict[str, float]:
    """The plan's figures (``Plan.to_dict``) for a run of ``steps_done`` steps (MB, ms)."""
    n = max(int(steps_done or 1), 1)
    ms = plan["step_ms"]
    out = {
        "peak_vram_mb": max(plan["peak_bytes"].values()) / MB,
        "step_ms": (ms["trace_step"] + (n - 1) * ms["total"]) / n,
        "host_ram_mb": plan["host"]["ram_peak_bytes"] / MB,
        "pinned_mb": plan["host"]["pinned_bytes"] / MB,
    }
    moved = plan.get("transfers")
    if moved and n > 1 and _streams(plan):  # a run's last step is a steady one from step 2 on
        out.update({k: moved[key] / unit for k, (key, _, unit) in TRANSFERS.items()})
    return out


def _streams(plan: dict[str, Any]) -> bool:
    memory = plan.get("memory") or {}
    section = memory.get("stagehand") or {}
    strategy = memory.get("strategy")
    return strategy == "layer_offload" or (
        strategy == "stagehand" and section.get("weight_streaming", True)
    )


def measured_figures(
    summary: dict[str, Any],
    rss_mb: float | None,
    pinned_mb: float | None,
    last_step: dict[str, Any] | None = None,
) -> dict[str, float | None]:
    """A run's figures: its summary (``RunSummary``), the largest RSS and pinned MB of its
    trainer step records and, given its last step's ``stagehand/step`` record, what that step
    moved (``TRANSFERS``)."""
    out = {
        "peak_vram_mb": summary.get("peak_vram_mb"),
        "step_ms": summary.get("mean_step_time_ms"),
        "host_ram_mb": rss_mb,
        "pinned_mb": pinned_mb,
    }
    if last_step:
        for figure, (_, key, unit) in TRANSFERS.items():
            if isinstance(last_step.get(key), (int, float)):
                out[figure] = last_step[key] / unit
    return out


def ratios(predicted: dict[str, float], measured: dict[str, float | None]) -> dict[str, float]:
    """``measured / predicted`` per figure, where both are numbers above zero."""
    out = {}
    for key in FIGURES:
        p, m = predicted.get(key), measured.get(key)
        if isinstance(p, (int, float)) and isinstance(m, (int, float)) and p > 0 and m > 0:
            out[key] = m / p
    return out


def out_of_bounds(figure: str, ratio: float) -> bool:
    """Whether ``ratio`` of ``figure`` is outside ``RATIO_BOUNDS`` (a disturbed measurement)."""
    bounds = RATIO_BOUNDS.get(figure)
    return bounds is not None and not bounds[0] <= ratio <= bounds[1]


def combine(calibrations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The calibration a plan applies, from stored rows of one device and family, newest first
    (``run_id``, ``device``, ``family``, ``ratios``; the first ``RUNS`` are used): per figure,
    the median of the runs' ratios within ``RATIO_BOUNDS``, damped toward 1 when fewer than
    ``FULL_RUNS`` runs gave it (``damped``). Returns ``{run_ids, device, family, ratios,
    medians, runs, refused: [{run_id, figure, ratio, bounds}]}`` (``ratios``: the factors
    applied; ``medians`` and ``runs``: each figure's median and how many runs it is of;
    ``run_ids``: the runs a ratio was taken from, newest first), or None when no ratio is
    left."""
    rows = calibrations[:RUNS]
    if not rows:
        return None
    taken: dict[str, list[float]] = {}
    used: list[int] = []
    refused = []
    for row in rows:
        for figure, ratio in row["ratios"].items():
            if figure not in FIGURES:
                continue
            if out_of_bounds(figure, ratio):
                bounds = list(RATIO_BOUNDS[figure] or ())
                refused.append(
                    {"run_id": row["run_id"], "figure": figure, "ratio": ratio, "bounds": bounds}
                )
                continue
            taken.setdefault(figure, []).append(ratio)
            if row["run_id"] not in used:
                used.append(row["run_id"])
    if not taken:
        return None
    medians = {f: statistics.median(taken[f]) for f in FIGURES if f in taken}
    return {
        "run_ids": used,
        "device": rows[0]["device"],
        "family": rows[0]["family"],
        "ratios": {f: damped(medians[f], len(taken[f])) for f in medians},
        "medians": medians,
        "runs": {f: len(taken[f]) for f in medians},
        "refused": refused,
    }


def apply(plan: dict[str, Any], calibration: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (``Plan.to_dict``) with ``calibration``'s ratios applied: device bytes (peaks,
    band, curve, the knob's peak) times the VRAM ratio, every step time (the curve's times too)
    times the step ratio,
    host RAM and pinned bytes times theirs; ``fits`` is decided again on the scaled peaks.
    ``calibration`` is ``combine``'s; the result's ``calibration`` is it plus the figures
    before (``uncalibrated``): which runs the ratios came from and which were refused.
    """
    r = calibration["ratios"]
    out = copy.deepcopy(plan)
    before = {
        "fits": plan["fits"],
        "peak_bytes": plan["peak_bytes"],
        "steady_band_bytes": plan["steady_band_bytes"],
        "step_ms": plan["step_ms"],
        "host": {k: plan["host"][k] for k in ("ram_peak_bytes", "pinned_bytes")},
    }
    vram = r.get("peak_vram_mb")
    if vram:
        out["peak_bytes"] = {k: round(v * vram) for k, v in plan["peak_bytes"].items()}
        out["steady_band_bytes"] = [round(v * vram) for v in plan["steady_band_bytes"]]
        out["curve"]["bytes"] = [round(v * vram) for v in plan["curve"]["bytes"]]
        if out.get("knob"):
            out["knob"]["peak_bytes"] = round(out["knob"]["peak_bytes"] * vram)
        cap = plan["device"]["vram_bytes"]
        out["fits"] = not cap or max(out["peak_bytes"].values()) <= cap
    step = r.get("step_ms")
    if step:
        out["step_ms"] = {k: round(v * step, 3) for k, v in plan["step_ms"].items()}
        out["curve"]["t_ms"] = [round(t * step, 4) for t in plan["curve"]["t_ms"]]
    for key, figure in (("ram_peak_bytes", "host_ram_mb"), ("pinned_bytes", "pinned_mb")):
        if r.get(figure):
            out["host"][key] = round(plan["host"][key] * r[figure])
    keys = ("run_ids", "device", "family", "medians", "runs", "refused")
    out["calibration"] = {**{k: calibration.get(k) for k in keys}, "ratios": r}
    out["calibration"]["uncalibrated"] = before
    return out


NAMES = {
    "peak_vram_mb": "VRAM",
    "step_ms": "step",
    "host_ram_mb": "host RAM",
    "pinned_mb": "pinned",
}


def describe(calibration: dict[str, Any] | None) -> str | None:
    """One line: ``calibrated by runs #7, #5 on cpu/flux (median): VRAM x1.004, step x1.698
    (median x4.900 of 1 run, damped toward 1 until 3); refused: run #6 step x0.047 (outside
    0.2-5)``."""
    if not calibration:
        return None
    medians, counts = calibration.get("medians") or {}, calibration.get("runs") or {}
    parts = []
    for k, v in calibration["ratios"].items():
        n = counts.get(k, FULL_RUNS)
        lone = f" (median x{medians.get(k, v):.3f} of {n} run{'s' if n > 1 else ''}, damped"
        lone += f" toward 1 until {FULL_RUNS})"
        parts.append(f"{NAMES[k]} x{v:.3f}" + (lone if n < FULL_RUNS else ""))
    ids = calibration["run_ids"]
    runs = ", ".join(f"#{i}" for i in ids)
    where = f"{calibration['device']}/{calibration['family']}"
    median = " (median)" if len(ids) > 1 else ""
    line = f"calibrated by run{'s' if len(ids) > 1 else ''} {runs} on {where}{median}: "
    line += ", ".join(parts)
    refused = [
        f"run #{r['run_id']} {NAMES[r['figure']]} x{r['ratio']:.3g} "
        f"(outside {r['bounds'][0]:g}-{r['bounds'][1]:g})"
        for r in calibration.get("refused") or []
    ]
    return line + ("; refused: " + ", ".join(refused) if refused else "")


def family_of(config: dict[str, Any]) -> str:
    """The family a calibration is keyed by: the preset's ``model_type`` (else its factory)."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    return str(config.get("model_type") or model.get("factory") or "unknown")
