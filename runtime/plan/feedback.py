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

A ratio is ``measured / predicted``; a later plan multiplies its figures by it (``apply``),
each figure by its own, and says which run the ratios came from.
"""

from __future__ import annotations

import copy
from typing import Any

from runtime.config import MB

FIGURES = ("peak_vram_mb", "step_ms", "host_ram_mb", "pinned_mb")


def predicted_figures(plan: dict[str, Any], steps_done: int | None) -> dict[str, float]:
    """The plan's figures (``Plan.to_dict``) for a run of ``steps_done`` steps (MB, ms)."""
    n = max(int(steps_done or 1), 1)
    ms = plan["step_ms"]
    return {
        "peak_vram_mb": max(plan["peak_bytes"].values()) / MB,
        "step_ms": (ms["trace_step"] + (n - 1) * ms["total"]) / n,
        "host_ram_mb": plan["host"]["ram_peak_bytes"] / MB,
        "pinned_mb": plan["host"]["pinned_bytes"] / MB,
    }


def measured_figures(
    summary: dict[str, Any], rss_mb: float | None, pinned_mb: float | None
) -> dict[str, float | None]:
    """A run's figures: its summary (``RunSummary``) and the largest RSS and pinned MB of its
    trainer step records."""
    return {
        "peak_vram_mb": summary.get("peak_vram_mb"),
        "step_ms": summary.get("mean_step_time_ms"),
        "host_ram_mb": rss_mb,
        "pinned_mb": pinned_mb,
    }


def ratios(predicted: dict[str, float], measured: dict[str, float | None]) -> dict[str, float]:
    """``measured / predicted`` per figure, where both are numbers above zero."""
    out = {}
    for key in FIGURES:
        p, m = predicted.get(key), measured.get(key)
        if isinstance(p, (int, float)) and isinstance(m, (int, float)) and p > 0 and m > 0:
            out[key] = m / p
    return out


def apply(plan: dict[str, Any], calibration: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (``Plan.to_dict``) with ``calibration``'s ratios applied: device bytes (peaks,
    band, curve, the knob's peak) times the VRAM ratio, every step time (the curve's times too)
    times the step ratio,
    host RAM and pinned bytes times theirs; ``fits`` is decided again on the scaled peaks.
    ``calibration`` is a stored row (``run_id``, ``device``, ``family``, ``ratios``); the
    result's ``calibration`` says which run the ratios came from and keeps the figures before.
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
    out["calibration"] = {
        "run_id": calibration["run_id"],
        "device": calibration["device"],
        "family": calibration["family"],
        "ratios": r,
        "uncalibrated": before,
    }
    return out


def describe(calibration: dict[str, Any] | None) -> str | None:
    """One line: ``calibrated by run #N on cpu/flux: VRAM x1.004, step x0.91, ...``."""
    if not calibration:
        return None
    names = {"peak_vram_mb": "VRAM", "step_ms": "step", "host_ram_mb": "host RAM"}
    names["pinned_mb"] = "pinned"
    parts = [f"{names[k]} x{v:.3f}" for k, v in calibration["ratios"].items()]
    where = f"{calibration['device']}/{calibration['family']}"
    return f"calibrated by run #{calibration['run_id']} on {where}: " + ", ".join(parts)


def family_of(config: dict[str, Any]) -> str:
    """The family a calibration is keyed by: the preset's ``model_type`` (else its factory)."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    return str(config.get("model_type") or model.get("factory") or "unknown")


PROFILE_NAMES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "h100 pcie": "h100-pcie",
    "h100": "h100",
}
"""Device-name parts to profiles, the first that matches wins (an "NVIDIA H100 PCIe" is the
PCIe profile, any other H100 the SXM5 one)."""


def profile_name(device: str | None, device_name: str | None) -> str | None:
    """The device profile a run ran on: ``cpu`` for a CPU run, a named GPU profile when the
    CUDA device's name matches one (``NVIDIA GeForce RTX 4090`` -> ``rtx4090``), else None."""
    if not device:
        return None
    if device == "cpu":
        return "cpu"
    text = (device_name or "").lower()
    for key, name in PROFILE_NAMES.items():
        if key in text:
            return name
    return None
