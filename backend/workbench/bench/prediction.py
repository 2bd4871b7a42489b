"""The planner's prediction of a real-size row, put beside the row's measurement.

The planner (``plan``) simulates the row's own ``memory`` section on the row's model
at the row's size (its inventory measured on ``meta``, ``realmodel.model_inventory``) and on a
profile of the machine the row ran on: the blocks it keeps resident, the loads, H2D bytes,
demand loads (misses) and waits of a steady step, its step time and its peak. A row whose
section still says ``"auto"`` (a real-size row on the run's own card) is planned with the
planner's activation estimate, which the row's run resolves with at build too
(``realsize.row_activation_peak``), and again with its measured peak after the trace step:
from then on the two may keep different blocks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from workbench.bench.realmodel import model_inventory
from workbench.plan.plan import EFFICIENCY, Plan, check_memory
from workbench.plan.profiles import cpu_profile, profile
from workbench.plan.sections import weight_section
from workbench.plan.simulate import Simulation

PROFILE_NAMES = {"H100 PCIe": "h100-pcie", "H100": "h100", "H200": "h100", "4090": "rtx4090"}
"""Named GPU profiles by a part of the device's name (the H200 computes as an H100 SXM; its
memory and link come from the probe and the card)."""


def bench_profile(device: str, probe: dict[str, Any], card_bytes: int | None) -> Any:
    """The planner's ``DeviceProfile`` of the machine a row ran on: on a CPU ``cpu_profile()``
    (measured once per process, a few seconds); on CUDA the named profile of its GPU (an
    H100 SXM's when the name is not known) with the probe's pinned H2D and page-cache rates
    (GB/s) and ``card_bytes`` (the emulated card, bytes) or the device's own memory."""

    if torch.device(device).type != "cuda":
        return cpu_profile()
    name = probe.get("name", "")
    key = next((v for k, v in PROFILE_NAMES.items() if k in name), "h100")
    vram = card_bytes or torch.cuda.get_device_properties(torch.device(device)).total_memory
    changes: dict[str, Any] = {"vram_bytes": int(vram)}
    if probe.get("h2d_pinned_gbps"):
        changes["h2d_gbps"] = probe["h2d_pinned_gbps"]
    if probe.get("pagecache_to_pinned_8t_gbps"):
        changes["read_gbps"] = probe["pagecache_to_pinned_8t_gbps"]
    return replace(profile(key), **changes)


def row_prediction(
    model: str, size: str, memory: dict[str, Any], device_profile: Any, steps: int = 3
) -> dict:
    """What the planner predicts for one row: ``memory`` (the row's section, as it ran)
    simulated on ``model`` at ``size`` on ``device_profile`` for ``steps`` steps from a cold
    start (the row's warm-up and measured steps: its counters are its last step's, and a step
    right after the trace may still differ from the steady ones), the last reported.

    Returns a dict: ``resident_blocks`` (on the device through the whole step),
    ``on_device_blocks`` (at the step's end: the runtime's ``resident_blocks`` counter),
    ``streamed_blocks``, ``block_loads_per_step``,
    ``h2d_bytes_per_step`` (bytes), ``misses_per_step`` (demand loads), ``waits_per_step``
    (uses that waited on an in-flight copy), ``window_blocks`` (the prefetch window the step ran
    with: NOTE [ Window growth ]), ``stall_ms``, ``step_ms``, ``compute_ms``,
    ``peak_bytes`` (device bytes; tracked bytes on a CPU) and ``watermarks_mb`` (the weight
    runtime's ``[high, low]`` the simulation ran with; None without weight streaming).

    Raises:
        PlanInputError: the section is one the planner refuses (naming the field).
    """

    config = check_memory(memory)
    sh = config.stagehand
    inv = model_inventory(
        model,
        size,
        sh.block_pattern if sh is not None else None,
        sh.resident_trainable_max_fraction if sh is not None else 0.1,
    )
    efficiency = EFFICIENCY["cpu" if device_profile.tracked else "gpu"]
    sim = Simulation(inv, config, device_profile, efficiency=efficiency)
    results = sim.run(max(1, steps))
    plan = Plan(model, device_profile, inv, memory, results, True, None, efficiency)
    moved, steady = plan.transfers(), plan.steady
    section = weight_section(inv, config, device_profile)
    streams = config.strategy != "none" and section is not None and section.weight_streaming
    return {
        "resident_blocks": moved["resident_blocks"],
        "on_device_blocks": sum(1 for b in sim.blocks if b.on_device) if sim.streaming else 0,
        "streamed_blocks": moved["streamed_blocks"],
        "block_loads_per_step": steady.blocks_loaded,
        "h2d_bytes_per_step": steady.h2d_bytes,
        "misses_per_step": steady.misses,
        "waits_per_step": steady.waits,
        "window_blocks": steady.window,
        "stall_ms": round(steady.stall_ms, 3),
        "step_ms": round(steady.step_ms, 3),
        "compute_ms": round(steady.compute_ms, 3),
        "peak_bytes": max(s.peak_bytes for s in results),
        "steps": len(results),
        "watermarks_mb": [
            round(section.vram_high_watermark_mb, 3),
            round(section.vram_low_watermark_mb, 3),
        ]
        if streams
        else None,
    }
