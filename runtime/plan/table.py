"""The plan as a text table: what ``workbench plan`` and ``python -m runtime.plan.reference``
print (MB of 2**20 bytes, ms)."""

from __future__ import annotations

import json
from typing import Any

from runtime.config import MB


def table(plan: dict[str, Any]) -> str:
    """The plan as a text table (MB of 2**20 bytes, ms)."""
    dev, model, ms = plan["device"], plan["model"], plan["step_ms"]
    vram = dev["vram_bytes"]
    lines = [
        f"plan: {plan['preset']} on {dev['name']} ({dev['source']})",
        f"  model        {model['model_class']} {model['dtype']}: {model['n_blocks']} blocks, "
        f"{model['block_bytes'] / MB:.1f} MB in blocks (largest "
        f"{model['largest_block_bytes'] / MB:.1f} MB), {model['resident_bytes'] / MB:.1f} MB "
        f"resident, LoRA {model['lora_bytes'] / MB:.1f} MB, AdamW "
        f"{model['optimizer_bytes'] / MB:.1f} MB, saved activations "
        f"{model['saved_activation_bytes'] / MB:.1f} MB",
    ]
    shapes = plan.get("inputs") or {}
    if shapes:
        lines.append(
            "  inputs       " + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items() if v)
        )
    peak = plan["peak_bytes"]
    cap = f" of {vram / MB:.0f} MB" if vram else ""
    lines.append(
        f"  peak VRAM    {peak['steady'] / MB:.2f} MB steady, {peak['trace_step'] / MB:.2f} MB "
        f"trace step{cap} ({plan['vram_source']})"
    )
    low, high = plan["steady_band_bytes"]
    lines.append(f"  steady band  {low / MB:.2f} - {high / MB:.2f} MB")
    host = plan["host"]
    lines.append(
        f"  host         RAM peak {host['ram_peak_bytes'] / MB:.0f} MB (pinned "
        f"{host['pinned_bytes'] / MB:.0f} MB, of it host cache "
        f"{host.get('host_cache_bytes', 0) / MB:.0f} MB; block masters "
        f"{host['block_masters_bytes'] / MB:.0f} MB), spilled activations "
        f"{host['spilled_activation_bytes'] / MB:.1f} MB/step"
    )
    lines.append(
        f"  step time    {ms['total']:.1f} ms = compute {ms['compute']:.1f} + exposed H2D "
        f"{ms['exposed_h2d']:.1f} + spill {ms['spill']:.1f} (H2D total {ms['h2d']:.1f}, "
        f"stalls {ms['stall']:.1f}; "
        f"trace step {ms['trace_step']:.1f}) at efficiency {plan['efficiency']}"
    )
    cal = plan.get("calibration")
    if cal:
        from runtime.plan.feedback import describe

        lines.append(f"  calibration  {describe(cal)}")
    if plan["fits"]:
        lines.append("  fits: yes")
    elif plan["knob"]:
        knob = {k: v for k, v in plan["knob"].items() if k != "peak_bytes"}
        lines.append(
            f"  fits: NO; fits with {json.dumps(knob)} "
            f"(peak {plan['knob']['peak_bytes'] / MB:.1f} MB)"
        )
    else:
        lines.append("  fits: NO; no knob tried makes it fit")
    return "\n".join(lines)
