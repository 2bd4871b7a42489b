"""``"auto"`` weight watermarks in a plan: the weight runtime's rule (NOTE [ Auto watermarks ]
in ``runtime/weights/auto.py``) fed with the plan's own figures.

The activation peak is the plan's: one simulated run with every block kept (watermarks at the
device's memory) and no activation spill, i.e. what the step's activations need at most; the
trainable bytes are the LoRA's weights, gradients and AdamW moments; the prefetch window is
the largest ``prefetch_window_blocks`` blocks (the window the runtime derives when the preset
leaves it out); the device is the profile's memory, or the Conductor's soft cap when enabled
and lower.
"""

from __future__ import annotations

import copy
from typing import Any

from runtime.config import MB
from runtime.plan.inventory import Inventory, PlanInputError
from runtime.plan.profiles import DeviceProfile

FIELDS = ("vram_high_watermark_mb", "vram_low_watermark_mb")
CAPS = ("vram_soft_cap_mb", "vram_hard_cap_mb")
"""The Conductor's caps; ``"auto"`` there leaves the card's memory as the budget."""


def auto_fields(memory: dict[str, Any]) -> list[str]:
    """The weight watermark fields of ``memory`` that say ``"auto"``."""
    sh = memory.get("stagehand") if isinstance(memory, dict) else None
    if not isinstance(sh, dict):
        return []
    return [f for f in FIELDS if sh.get(f) == "auto"]


def _conductor(memory: dict[str, Any]) -> dict[str, Any]:
    sh = memory.get("stagehand") if isinstance(memory, dict) else None
    cond = sh.get("conductor_config") if isinstance(sh, dict) else None
    return cond if isinstance(cond, dict) else {}


def placeholders(memory: dict[str, Any]) -> dict[str, Any]:
    """``memory`` with its ``"auto"`` watermarks and Conductor caps set to numbers, to
    validate the rest of it before the rule's figures are known."""
    caps = [c for c in CAPS if _conductor(memory).get(c) == "auto"]
    fields = auto_fields(memory)
    if not fields and not caps:
        return memory
    out = copy.deepcopy(memory)
    for f in fields:
        out["stagehand"][f] = 1e6
    for c in caps:
        out["stagehand"]["conductor_config"][c] = 1e6
    return out


def device_budget(memory: dict[str, Any], profile: DeviceProfile) -> int:
    """Bytes the runtimes may use: the profile's memory, or the Conductor's soft cap when it
    is enabled and lower.

    Raises:
        PlanInputError: the profile has no memory figure (a CPU device without ``--vram-gb``).
    """
    device = profile.vram_bytes
    if not device:
        raise PlanInputError(
            'memory.stagehand.vram_high_watermark_mb: "auto" needs the device\'s memory; '
            "give the CPU device a tracked budget (--vram-gb) or MB values"
        )
    cond = _conductor(memory)
    soft = cond.get("vram_soft_cap_mb") if cond.get("enabled") else None
    if isinstance(soft, (int, float)) and soft > 0:
        device = min(device, int(soft * MB))
    return device


def resolve_auto(
    memory: dict[str, Any], inv: Inventory, profile: DeviceProfile, efficiency: float
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(memory with the "auto" watermarks replaced by MB, the figures of the rule)``; the
    figures are None when no field says ``"auto"``.

    Raises:
        PlanInputError: no device memory, or a budget too small for the window (the rule's
            message, naming every figure).
    """
    from runtime.plan.plan import check_memory, simulate
    from runtime.plan.simulate import weight_section
    from runtime.weights.auto import auto_watermarks, margin_bytes

    fields = auto_fields(memory)
    if not fields:
        return placeholders(memory), None
    device = device_budget(memory, profile)
    probe = placeholders(memory)
    sh = probe["stagehand"]
    for f in FIELDS:
        sh[f] = device / MB
    if isinstance(sh.get("activation_stagehand"), dict):
        sh["activation_stagehand"]["enabled"] = False
    config = check_memory(probe)
    activation_peak = max(
        s.activation_peak_bytes for s in simulate(inv, config, profile, efficiency)
    )
    window_blocks = weight_section(inv, config, profile).prefetch_window_blocks
    window = sum(sorted((b.nbytes for b in inv.blocks), reverse=True)[:window_blocks])
    trainable = 2 * inv.lora_bytes + inv.optimizer_bytes
    margin = margin_bytes(device, cuda=not profile.tracked)
    try:
        high, low = auto_watermarks(device, activation_peak, trainable, window, margin)
    except ValueError as exc:
        raise PlanInputError(f"memory.stagehand.{fields[0]}: {exc}") from None
    out = placeholders(memory)
    values = {"vram_high_watermark_mb": high / MB, "vram_low_watermark_mb": low / MB}
    for f in fields:
        out["stagehand"][f] = round(values[f], 1)
    figures = {
        "device_bytes": device,
        "activation_peak_bytes": activation_peak,
        "trainable_bytes": trainable,
        "window_bytes": window,
        "margin_bytes": margin,
        "high_mb": round(high / MB, 1),
        "low_mb": round(low / MB, 1),
    }
    return out, figures
