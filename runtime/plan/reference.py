"""Plans of the real models the seeds measured, built from their config values on ``meta``.

``FLUX_DEV_CONFIG`` is FLUX.1-dev's ``transformer/config.json`` (diffusers'
``FluxTransformer2DModel`` defaults, which are FLUX.1-dev's: 19 double-stream and 38
single-stream blocks, 24 heads of 128, T5 width 4096, CLIP pooled width 768, 64 packed latent
channels, guidance embedding). ``python -m runtime.plan.reference`` prints its plans next to the
seeds' measured figures (``shared/seeds/case-study-flux-2048-layer-offload.md``: 4.15 GB
allocated, 32 s/step at 2048 px on an RTX 3090 with layer offload 0.9).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from runtime.plan.inventory import add_lora, meta_model
from runtime.plan.plan import Plan, plan_model
from runtime.plan.profiles import profile

FLUX_DEV_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

FLUX_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""Attention projections (the seed lists "LoRA adapters (rank 16) ~30 MB" without its targets;
these give 35.6 MB at rank 16 in bf16)."""

T5_TOKENS = 512
"""FLUX.1-dev's pipeline default ``max_sequence_length``."""

SEED_FLUX_2048 = {"device": "rtx3090", "allocated_gb": 4.15, "reserved_gb": 4.46, "step_s": 32.0}


def streaming_memory(high_mb: float, low_mb: float, spill_mb: float | None) -> dict[str, Any]:
    """A ``memory`` section: weight streaming with checkpointed blocks and, with ``spill_mb``,
    activation spill from that watermark (the flux-dev-24gb preset's shape)."""
    section: dict[str, Any] = {
        "pinned_pool_mb": 5248,
        "pinned_slab_mb": 656,
        "vram_high_watermark_mb": high_mb,
        "vram_low_watermark_mb": low_mb,
        "prefetch_window_blocks": 2,
        "max_inflight_transfers": 2,
    }
    if spill_mb is not None:
        section["activation_stagehand"] = {
            "enabled": True,
            "vram_high_watermark_mb": spill_mb,
            "vram_low_watermark_mb": spill_mb * 0.75,
        }
    return {"strategy": "stagehand", "gradient_checkpointing": True, "stagehand": section}


def flux_dev_plan(
    device: str, resolution: int, memory: dict[str, Any], rank: int = 16, **overrides: float
) -> Plan:
    """The plan of a FLUX.1-dev LoRA (bf16) at ``resolution`` px, batch 1, 512 text tokens."""
    from runtime.assets import example_inputs

    model = meta_model("FluxTransformer2DModel", FLUX_DEV_CONFIG, torch.bfloat16)
    add_lora(model, rank, FLUX_LORA_TARGETS)
    side = resolution // 8
    inputs = example_inputs(model, latent_hw=(side, side), text_len=T5_TOKENS, device="meta")
    return plan_model(
        model, inputs, memory, profile(device, **overrides), name=f"flux-dev {resolution}px"
    )


def main(argv: list[str] | None = None) -> int:
    from runtime.plan.cli import table

    cases = [
        ("rtx4090", 2048, streaming_memory(3000, 2000, 2000), "2048 px, seed-like budget"),
        ("rtx3090", 2048, streaming_memory(3000, 2000, 2000), "2048 px, the seed's card"),
        ("rtx4090", 1024, streaming_memory(18000, 14000, 16000), "1024 px, flux-dev-24gb"),
    ]
    for device, resolution, memory, label in cases:
        print(f"== {label}")
        print(table(flux_dev_plan(device, resolution, memory).to_dict()))
    seed = SEED_FLUX_2048
    print(
        f"seed (layer offload 0.9, {seed['device']}): {seed['allocated_gb']} GB allocated, "
        f"{seed['reserved_gb']} GB reserved, {seed['step_s']} s/step"
    )
    plan = flux_dev_plan(seed["device"], 2048, cases[1][2])
    tflops = step_flops(plan) / seed["step_s"] / 1e12
    peak = plan.profile.tflops
    print(
        f"the seed's step is {step_flops(plan):.3e} FLOPs (forward, recomputation, backward): "
        f"{tflops:.1f} TFLOPs sustained, {tflops / peak:.0%} of the {seed['device']}'s {peak}"
    )
    return 0


def step_flops(plan: Plan) -> float:
    """FLOPs of one checkpointed LoRA step: forward, the recomputation and backward."""
    inv = plan.inventory
    forward = inv.outside_flops + sum(b.forward_flops for b in inv.blocks)
    return forward * (2 + inv.backward_ratio[0])


if __name__ == "__main__":
    sys.exit(main())
