"""The plan as a text table: what ``workbench plan`` and ``python -m workbench.plan.reference``
print (MiB = 2**20 bytes, GiB = 2**30 bytes; transfers in GB = 1e9 bytes, as link rates are
given in GB/s; ms)."""

from __future__ import annotations

import json
from typing import Any

from stagehand.config.memory import MB
from workbench.plan.feedback import describe

GIB = 2**30
GB = 1e9


def table(plan: dict[str, Any]) -> str:
    """The plan as a text table (module docstring for the units)."""
    dev, model, ms = plan["device"], plan["model"], plan["step_ms"]
    vram = dev["vram_bytes"]
    lines = [
        f"plan: {plan['preset']} on {dev['name']} ({dev['source']})",
        f"  model        {model['model_class']} {model['dtype']}: {model['n_blocks']} blocks, "
        f"{model['block_bytes'] / MB:.1f} MiB in blocks (largest "
        f"{model['largest_block_bytes'] / MB:.1f} MiB), {model['resident_bytes'] / MB:.1f} MiB "
        f"resident, LoRA {model['lora_bytes'] / MB:.1f} MiB, AdamW "
        f"{model['optimizer_bytes'] / MB:.1f} MiB, saved activations "
        f"{model['saved_activation_bytes'] / MB:.1f} MiB",
    ]
    lines.insert(1, profile_line(dev))
    shapes = plan.get("inputs") or {}
    if shapes:
        lines.append(
            "  inputs       " + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items() if v)
        )
    peak = plan["peak_bytes"]
    cap = f" of {vram / MB:.0f} MiB" if vram else ""
    lines.append(
        f"  peak VRAM    {peak['steady'] / MB:.2f} MiB steady, {peak['trace_step'] / MB:.2f} MiB "
        f"trace step{cap} ({plan['vram_source']})"
    )
    low, high = plan["steady_band_bytes"]
    lines.append(f"  steady band  {low / MB:.2f} - {high / MB:.2f} MiB")
    host = plan["host"]
    lines.append(
        f"  host         RAM peak {host['ram_peak_bytes'] / MB:.0f} MiB (worker baseline "
        f"{host.get('worker_baseline_bytes', 0) / MB:.0f} MiB, pinned "
        f"{host['pinned_bytes'] / MB:.0f} MiB, of it host cache "
        f"{host.get('host_cache_bytes', 0) / MB:.0f} MiB; block masters "
        f"{host['block_masters_bytes'] / MB:.0f} MiB), spilled activations "
        f"{host['spilled_activation_bytes'] / MB:.1f} MiB/step"
    )
    lines.append(
        f"  step time    {ms['total']:.1f} ms = compute {ms['compute']:.1f} + exposed H2D "
        f"{ms['exposed_h2d']:.1f} + spill {ms['spill']:.1f} (H2D total {ms['h2d']:.1f}, "
        f"stalls {ms['stall']:.1f}; "
        f"trace step {ms['trace_step']:.1f}) at efficiency {plan['efficiency']}"
    )
    auto = plan.get("auto_watermarks")
    if auto:
        act, caps = auto.get("activation_mb"), auto.get("conductor_caps_mb")
        device = auto["device_bytes"]
        lines.append(
            f"  auto         weights {auto['high_mb']:.0f}/{auto['low_mb']:.0f} MiB"
            + (f", activations {act[0]:.0f}/{act[1]:.0f}" if act else "")
            + (f", Conductor caps {caps[0]:.0f}/{caps[1]:.0f}" if caps else "")
            + (
                f" (device {device / MB:.0f} - activation peak "
                f"{auto['activation_peak_bytes'] / MB:.0f} - trainable "
                f"{auto['trainable_bytes'] / MB:.0f} - window {auto['window_bytes'] / MB:.0f} - "
                f"margin {auto['margin_bytes'] / MB:.0f} MiB; low a window below)"
                if device
                else " (a tracked device without a cap: no limit)"
            )
        )
    t, bound = plan.get("transfers"), plan.get("bound_ms")
    if t:
        lines.extend(transfer_lines(t, bound, plan))
    quant = plan.get("quant_error")
    if quant:
        lines.extend(quant_lines(quant))
    cal = plan.get("calibration")
    if cal:
        lines.append(f"  calibration  {describe(cal)}")
    if plan["fits"]:
        lines.append("  fits: yes")
    elif plan["knob"]:
        knob = {k: v for k, v in plan["knob"].items() if k != "peak_bytes"}
        lines.append(
            f"  fits: NO; fits with {json.dumps(knob)} "
            f"(peak {plan['knob']['peak_bytes'] / MB:.1f} MiB)"
        )
    else:
        lines.append("  fits: NO; no knob tried makes it fit")
    return "\n".join(lines)


def profile_line(dev: dict[str, Any]) -> str:
    """The device profile's figures (``DeviceProfile.to_dict``), and for a stored CPU profile
    each measurement's cost per operation: how far apart the measurements its median is of
    were (NOTE [ One CPU profile per machine ] in ``profiles.py``)."""
    line = (
        f"  profile      {dev['tflops']:g} TFLOPs, H2D {dev['h2d_gbps']:g} GB/s, memory "
        f"{dev.get('mem_gbps') or 0:g} GB/s"
    )
    if dev.get("tracked"):
        line += f", {dev['op_us']:g} us/op, {dev['load_us']:g} us/load"
    measured = dev.get("measured")
    if measured:
        ops = ", ".join(f"{v:g}" for v in measured["values"]["op_us"] if v is not None)
        line += f" (us/op measured: {ops}; {measured['count']} of {measured['wanted']} stored)"
    return line


SOURCES = {
    "host_cache": "host cache (pinned H2D)",
    "page_cache": "page cache through the readers",
    "disk": "disk through the readers (--disk-gbps)",
    "tracked": "host copies (CPU device, calibrated)",
}


def transfer_lines(t: dict[str, Any], bound: dict[str, Any] | None, plan: dict) -> list[str]:
    """What a steady step moves, its residency, and the bound (``Plan.transfers``)."""
    dev = plan["device"]
    loads = ", ".join(f"{SOURCES.get(k, k)} {n}" for k, n in t["loads_by_source"].items())
    moved = t["h2d_bytes_per_step"]
    window = t.get("window_blocks", 0)
    lines = [
        f"  H2D/step     {moved / GB:.2f} GB ({moved / GIB:.2f} GiB) in "
        f"{t['block_loads_per_step']} block loads, steady (trace step "
        f"{t['trace_step_h2d_bytes'] / GB:.2f} GB); loads from: {loads or 'none'}",
        f"  misses/step  {t.get('misses_per_step', 0)} demand loads, "
        f"{t.get('waits_per_step', 0)} waits on a copy in flight, prefetch window "
        f"{window} block{'' if window == 1 else 's'}",
        f"  residency    {t['resident_blocks']} blocks resident "
        f"({t['resident_block_bytes'] / GIB:.2f} GiB), {t['streamed_blocks']} streamed "
        f"({t['streamed_block_bytes'] / GIB:.2f} GiB)",
    ]
    if t["read_bytes_per_step"]:
        rate = dev.get("disk_gbps") or dev.get("read_gbps")
        lines.append(
            f"  file reads   {t['read_bytes_per_step'] / GB:.2f} GB/step at {rate} GB/s "
            f"({'disk' if dev.get('disk_gbps') else 'page cache'}), before their H2D copies"
        )
    if bound:
        x = f" (x{bound['x_bound']:.2f})" if bound.get("x_bound") else ""
        lines.append(
            f"  bound        max(compute {bound['compute']:.1f} ms, H2D {moved / GB:.2f} GB / "
            f"{dev['h2d_gbps']} GB/s = {bound['h2d']:.1f} ms) = {bound['bound']:.1f} ms; "
            f"plan {plan['step_ms']['total']:.1f} ms{x}"
        )
    return lines


def quant_lines(q: dict[str, Any]) -> list[str]:
    """SquareQ's quantization error (``workbench.plan.quant_error.measure``): relative RMS error
    ``||w - deq(q(w))|| / ||w||`` in percent, per quantized linear weight."""
    head = f"  SquareQ      {q['format']}: "
    if not q.get("measured"):
        return [head + q["reason"]]
    where = (
        "read from the SquareQ cache"
        if q.get("cached")
        else f"quantized now in {q['quantize_s']:.2f} s"
    )
    stored = q.get("prequantized_layers", 0)
    pre = (
        f"; {stored} layers stored in 8 bits in the checkpoint (no source to compare)"
        if stored
        else ""
    )
    if not q.get("quantized_layers"):
        return [head + f"no layer quantized{pre} ({where})"]
    worst = ", ".join(f"{name} {100 * err:.3f}%" for name, err in q["worst_layers"])
    return [
        head + f"{q['quantized_layers']} layers, relative RMS error mean "
        f"{100 * q['rel_rms_mean']:.3f}%, worst {100 * q['rel_rms_max']:.3f}% "
        f"({q['worst_layer']}){pre}; {where}",
        f"               five worst: {worst}",
    ]
