"""Plans of the real models the seeds measured, built from their config values on ``meta``.

``FLUX_DEV_CONFIG`` is FLUX.1-dev's ``transformer/config.json`` (diffusers'
``FluxTransformer2DModel`` defaults, which are FLUX.1-dev's: 19 double-stream and 38
single-stream blocks, 24 heads of 128, T5 width 4096, CLIP pooled width 768, 64 packed latent
channels, guidance embedding). ``LTX2_CONFIG`` is LTX-2's transformer as diffusers 0.42's
``LTX2VideoTransformer3DModel`` defaults give it (48 blocks; video 32 heads of 128, audio 32
heads of 64; Gemma 3 captions 3840 wide): built on ``meta`` it has 18.876B parameters, and a
rank-32 LoRA on every linear layer of its blocks is 2,688 tensors of 588 MiB, the seed's
"18.88B" and "589 MB (2,688 tensors)" (the LTX-2 bf16 on 24 GB case study); the
checkpoint's own ``config.json`` is not in this repository.

``python -m workbench.plan.reference`` prints the plans next to the seeds' measured figures
(Flux 2048 px, layer offload 0.9 on an RTX 3090: 4.15 GB allocated, 32 s/step; LTX-2 512 px x
17 frames: 17.2 GB allocated steady, 20.1 GB peak, 9.3-9.8 s/step).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from workbench.plan.inventory import add_lora, meta_model
from workbench.plan.plan import Plan, check_memory, plan_model, simulate
from workbench.plan.profiles import profile
from workbench.plan.table import table
from workbench.worker.assets import example_inputs
from workbench.worker.pipelines.ltx2 import LTX2PipelineFamily

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
    activation spill from that watermark (the flux-dev-24gb preset's shape: pool, slab, window
    and copies in flight left out, derived from the blocks and the card as a run derives them)."""
    section: dict[str, Any] = {"vram_high_watermark_mb": high_mb, "vram_low_watermark_mb": low_mb}
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

    model = meta_model("FluxTransformer2DModel", FLUX_DEV_CONFIG, torch.bfloat16)
    add_lora(model, rank, FLUX_LORA_TARGETS)
    side = resolution // 8
    inputs = example_inputs(model, latent_hw=(side, side), text_len=T5_TOKENS, device="meta")
    return plan_model(
        model, inputs, memory, profile(device, **overrides), name=f"flux-dev {resolution}px"
    )


LAYER_OFFLOAD_0_9 = {
    "strategy": "layer_offload",
    "gradient_checkpointing": True,
    "enable_activation_offloading": True,
    "enable_async_offloading": True,
    "layer_offload_fraction": 0.9,
}
"""``presets/flux-2048-layer-offload.json``'s memory section (the seed's run)."""

LTX2_CONFIG: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": (8, 32, 32),
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "num_layers": 48,
    "caption_channels": 3840,
}
"""The values that give LTX-2's shapes (diffusers 0.42 defaults; see the module docstring)."""

SEED_LTX2 = {
    "allocated_steady_gb": 17.2,
    "peak_gb": 20.1,
    "step_s": (9.3, 9.8),
    "lora_tensors": 2688,
}
"""``case-study-ltx2-bf16-24gb.md``: 512 px, 17 frames, rank 32, bf16, 24 GB card."""

LTX2_TEXT_TOKENS = 1024
"""The pipeline's default caption length (the ltx2-24gb preset's)."""


def ltx2_seed_memory() -> dict[str, Any]:
    """The seed's ``memory`` section: file-backed streaming at 20000/16000 MB, prefetch 2,
    slab 1024 MB in an 8192 MB pool, checkpointing on, no activation spill."""
    return {
        "strategy": "stagehand",
        "gradient_checkpointing": True,
        "stagehand": {
            "pinned_pool_mb": 8192,
            "pinned_slab_mb": 1024,
            "vram_high_watermark_mb": 20000,
            "vram_low_watermark_mb": 16000,
            "prefetch_window_blocks": 2,
            "max_inflight_transfers": 2,
        },
    }


def ltx2_block_linears(model: torch.nn.Module) -> list[str]:
    """Names (within a block) of every linear layer of LTX-2's first block: video and audio
    self and text attention, the two cross-modal attentions and both feed-forwards (28)."""
    block = model.transformer_blocks[0]
    return sorted(n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear))


def ltx2_plan(
    device: str,
    memory: dict[str, Any],
    *,
    targets: str = "all",
    resolution: int = 512,
    frames: int = 17,
    rank: int = 32,
    **overrides: float,
) -> Plan:
    """The plan of an LTX-2 LoRA (bf16), batch 1: ``resolution`` px square, ``frames`` pixel
    frames, ``LTX2_TEXT_TOKENS`` caption tokens, the audio stream fed as the trainer feeds it.
    ``targets``: ``"all"`` (every linear of the blocks, as the seed's 2,688-tensor LoRA) or
    ``"video"`` (the trainer's ``LTX2PipelineFamily.lora_targets``). The transformer's inputs
    are ``LTX2PipelineFamily.transformer_kwargs`` on ``meta`` (the trainer's own call)."""
    from types import SimpleNamespace

    family = LTX2PipelineFamily()
    model = meta_model("LTX2VideoTransformer3DModel", LTX2_CONFIG, torch.bfloat16)
    names = ltx2_block_linears(model) if targets == "all" else list(family.lora_targets)
    add_lora(model, rank, names)
    temporal, spatial = LTX2_CONFIG["vae_scale_factors"][0], LTX2_CONFIG["vae_scale_factors"][1]
    latent = resolution // spatial
    latent_frames = (frames - 1) // temporal + 1
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x_t = torch.empty(1, LTX2_CONFIG["in_channels"], latent_frames, latent, latent, **meta)
    width = 2 * LTX2_CONFIG["caption_channels"]  # video and audio text side by side
    text = SimpleNamespace(
        hidden=torch.empty(1, LTX2_TEXT_TOKENS, width, **meta),
        mask=torch.ones(1, LTX2_TEXT_TOKENS, **meta),
    )
    inputs = family.transformer_kwargs(model, x_t, torch.empty(1, **meta), text, temporal)
    name = f"ltx2 {resolution}px x {frames} frames, LoRA {targets}"
    return plan_model(model, inputs, memory, profile(device, **overrides), name=name)


def main(argv: list[str] | None = None) -> int:
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
    for eff in (None, 0.68):
        print(f"== the seed's run: layer offload 0.9, 2048 px, {seed['device']}, efficiency {eff}")
        lo = flux_dev_plan(seed["device"], 2048, LAYER_OFFLOAD_0_9)
        if eff is not None:
            lo = plan_model_again(lo, eff)
        print(table(lo.to_dict()))
    s = SEED_LTX2
    for targets, extra in (("all", {}), ("video", {}), ("all", {"disk_gbps": 10.0})):
        print(f"== LTX-2, the seed's memory section, LoRA on {targets} linears, rtx4090 {extra}")
        print(table(ltx2_plan("rtx4090", ltx2_seed_memory(), targets=targets, **extra).to_dict()))
    print(
        f"seed (LTX-2, 24 GB card): {s['allocated_steady_gb']} GB allocated steady, "
        f"{s['peak_gb']} GB peak, {s['step_s'][0]}-{s['step_s'][1]} s/step"
    )
    return 0


def plan_model_again(plan: Plan, efficiency: float) -> Plan:
    """``plan`` re-simulated at another GPU efficiency (same inventory, memory, profile)."""

    steps = simulate(plan.inventory, check_memory(plan.memory), plan.profile, efficiency)
    return Plan(
        plan.preset, plan.profile, plan.inventory, plan.memory, steps, plan.fits, None, efficiency
    )


def step_flops(plan: Plan) -> float:
    """FLOPs of one checkpointed LoRA step: forward, the recomputation and backward."""
    inv = plan.inventory
    forward = inv.outside_flops + sum(b.forward_flops for b in inv.blocks)
    return forward * (2 + inv.backward_ratio[0])


if __name__ == "__main__":
    sys.exit(main())
