"""Real models for the real-size row: their config (real or scaled tiny), random weights saved
sharded, inputs at their training size, and the preset memory sections scaled to the size.

``REAL_MODELS["flux-dev"]`` is FLUX.1-dev's transformer (``workbench.plan.reference``'s
``FLUX_DEV_CONFIG``: 19 double + 38 single blocks, 11.90B parameters), trained with LoRA r16 on
``to_q/to_k/to_v/to_out.0`` at 1024 px: a 128 x 128 latent, i.e. 4096 image tokens after
FLUX's 2 x 2 packing, and 512 T5 text tokens (the pipeline default).

``size="tiny"`` is the same config scaled: every block of the real model is kept (the block
count and order are what streaming, the Conductor and layer offload see), only the widths
shrink (24 heads of 128 -> 2 heads of 32 with the rotary axes scaled alike, text and pooled
widths 4096/768 -> 64/32), with a 16 x 16 latent and 16 text tokens. The code path is the
one the real size runs; a CPU test runs it. Memory sections taken from presets (MB figures
sized for the real blocks) are scaled by the ratio of the largest block's bytes
(``section_scale``), so a section that has room at real size has room at tiny size.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stagehand.config.memory import MemoryConfig
from stagehand.strategy.auto import has_auto
from stagehand.weights.registry import find_blocks
from workbench.contract.package_data import PRESETS_DIR
from workbench.plan.inventory import add_lora, inventory, meta_model
from workbench.plan.reference import FLUX_DEV_CONFIG, FLUX_LORA_TARGETS, T5_TOKENS
from workbench.plan.sections import auto_section
from workbench.worker.assets import example_inputs
from workbench.worker.diffusers_classes import diffusers_class

SIZES = ("real", "tiny")


@dataclass(frozen=True)
class RealModel:
    """One real model: its diffusers class, config, LoRA targets and training inputs."""

    name: str
    class_name: str
    config: dict[str, Any]
    tiny: dict[str, Any]
    """Config fields replaced at ``size="tiny"`` (widths only; block counts stay)."""
    lora_targets: list[str]
    lora_rank: int
    latent_hw: tuple[int, int]
    text_tokens: int
    tiny_latent_hw: tuple[int, int] = (16, 16)
    tiny_text_tokens: int = 16
    preset: str = ""
    """The preset whose ``memory`` section is the model's own row (``presets/NAME.json``)."""

    def model_config(self, size: str) -> dict[str, Any]:
        """The config at ``size`` (``"real"`` or ``"tiny"``).

        Raises:
            ValueError: ``size`` is neither.
        """
        check_size(size)
        config = copy.deepcopy(self.config)
        if size == "tiny":
            config.update(self.tiny)
        return config

    def inputs_shape(self, size: str) -> tuple[tuple[int, int], int]:
        """``(latent_hw, text_tokens)`` at ``size``."""
        check_size(size)
        if size == "real":
            return self.latent_hw, self.text_tokens
        return self.tiny_latent_hw, self.tiny_text_tokens


REAL_MODELS: dict[str, RealModel] = {
    "flux-dev": RealModel(
        name="flux-dev",
        class_name="FluxTransformer2DModel",
        config=FLUX_DEV_CONFIG,
        tiny={
            "attention_head_dim": 32,
            "num_attention_heads": 2,
            "axes_dims_rope": (4, 14, 14),  # (16, 56, 56) x 32/128: sums to the head dim
            "joint_attention_dim": 64,
            "pooled_projection_dim": 32,
        },
        lora_targets=FLUX_LORA_TARGETS,
        lora_rank=16,
        latent_hw=(128, 128),  # 1024 px / 8 (VAE); 2 x 2 packing -> 4096 image tokens
        text_tokens=T5_TOKENS,
        preset="flux-dev-24gb",
    ),
}


def check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def real_model(name: str) -> RealModel:
    """``REAL_MODELS[name]``.

    Raises:
        ValueError: no such model (the message lists the known names).
    """
    if name not in REAL_MODELS:
        raise ValueError(f"--model must be one of {sorted(REAL_MODELS)}, got {name!r}")
    return REAL_MODELS[name]


def largest_block_bytes(spec: RealModel, size: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Parameter bytes of the model's largest block at ``size``, measured on ``meta`` once per
    process for each class and config (every ``row_memory`` of a tiny row scales by it; a
    meta FLUX.1-dev takes a second or two to build)."""
    config = json.dumps(spec.model_config(size), sort_keys=True)
    return _largest_block_bytes(spec.class_name, config, dtype)


@functools.cache
def _largest_block_bytes(class_name: str, config: str, dtype: torch.dtype) -> int:
    model = meta_model(class_name, json.loads(config), dtype)
    blocks = find_blocks(model, None)
    return max(sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in blocks)


def section_scale(spec: RealModel, size: str) -> float:
    """Factor from real-size MB figures to ``size``'s: the ratio of the largest blocks."""
    if size == "real":
        return 1.0
    return largest_block_bytes(spec, size) / largest_block_bytes(spec, "real")


CARD_BYTES = 24 * 2**30
"""The card a tiny row's ``"auto"`` figures are resolved for (then scaled): a 24 GiB card."""


def model_inventory(
    name: str, size: str, block_pattern: str | None = None, resident_fraction: float = 0.1
) -> Any:
    """The planner's ``Inventory`` of ``REAL_MODELS[name]`` at ``size`` with its LoRA and its
    training inputs, measured on ``meta`` (``workbench.plan.inventory.inventory``). A meta
    forward and backward of 57 blocks takes 10 to 40 s of one core, so it is measured once
    per process for each set of arguments, however they are passed: ``("flux-dev", "real")``
    and a section's ``("flux-dev", "real", None, 0.1)`` are one measurement (a cache keyed on
    the call as written measured them twice).

    Raises:
        ValueError: unknown model or size.
    """
    return _model_inventory(name, size, block_pattern, float(resident_fraction))


@functools.cache
def _model_inventory(
    name: str, size: str, block_pattern: str | None, resident_fraction: float
) -> Any:
    spec = real_model(name)
    model = meta_model(spec.class_name, spec.model_config(size), torch.bfloat16)
    add_lora(model, spec.lora_rank, spec.lora_targets)
    latent_hw, text_len = spec.inputs_shape(size)
    inputs = example_inputs(model, latent_hw=latent_hw, text_len=text_len, device="meta")
    return inventory(
        model,
        inputs,
        block_pattern=block_pattern,
        resident_trainable_max_fraction=resident_fraction,
    )


def card_section(
    spec: RealModel, memory: dict[str, Any], card_bytes: int = CARD_BYTES
) -> dict[str, Any]:
    """``memory`` with its ``"auto"`` stagehand fields in MB as the planner resolves them for a
    real-size run of ``spec`` (LoRA attached, training inputs) on a ``card_bytes`` card
    (``workbench.plan.sections.auto_section``: the strategy's rule with the planner's activation
    peak, trainable bytes and window): what a tiny row scales, since a tiny model on the CPU
    has no card of its own, and what a real-size row on an emulated smaller card
    (``--card-gb``) runs with, so the row keeps the blocks the plan keeps.

    Raises:
        ValueError: the card is too small for the window (the rule names the figures).
    """

    config = MemoryConfig.model_validate(copy.deepcopy(memory))
    section = config.stagehand
    if not has_auto(section):
        return copy.deepcopy(memory)
    fraction = section.resident_trainable_max_fraction
    inv = model_inventory(spec.name, "real", section.block_pattern, fraction)
    resolved = auto_section(
        inv, section, checkpointing=config.gradient_checkpointing, card_bytes=card_bytes
    ).model_dump()

    def numbers(given: dict[str, Any], done: dict[str, Any]) -> dict[str, Any]:
        return {
            k: numbers(v, done[k]) if isinstance(v, dict) else done[k] if v == "auto" else v
            for k, v in given.items()
        }

    stagehand = numbers(memory["stagehand"], resolved)
    if "conductor_config" in stagehand:  # Rule 1's threshold goes with "auto" (NOTE there)
        threshold = resolved["conductor_config"]["backward_pressure_threshold"]
        stagehand["conductor_config"]["backward_pressure_threshold"] = threshold
    return {**memory, "stagehand": stagehand}


def scale_section(section: Any, factor: float) -> Any:
    """A copy of a memory section with every ``*_mb`` number multiplied by ``factor`` (nested
    dicts included; lists such as ``pinned_pool_classes_mb`` element-wise). The weight pool's
    slab, whole MB by its schema, is rounded up (at least 1 MB: it must hold the largest
    block) and the pool keeps its number of slabs."""
    if not isinstance(section, dict):
        return copy.deepcopy(section)
    out: dict[str, Any] = {}
    for key, value in section.items():
        if factor != 1.0 and key.endswith("_mb") and isinstance(value, (int, float)):
            out[key] = value * factor
        elif factor != 1.0 and key.endswith("_mb") and isinstance(value, list):
            out[key] = [v * factor for v in value]
        else:
            out[key] = scale_section(value, factor)
    if factor != 1.0 and "pinned_slab_mb" in section:
        slabs = (
            section.get("pinned_pool_mb", section["pinned_slab_mb"]) // section["pinned_slab_mb"]
        )
        out["pinned_slab_mb"] = max(1, math.ceil(section["pinned_slab_mb"] * factor))
        out["pinned_pool_mb"] = out["pinned_slab_mb"] * max(1, slabs)
    return out


def preset_memory(name: str) -> dict[str, Any]:
    """The ``memory`` section of ``presets/NAME.json``.

    Raises:
        FileNotFoundError: no such preset file.
        KeyError: the preset has no ``memory`` section.
    """
    path = PRESETS_DIR / f"{name}.json"
    data = json.loads(path.read_text())
    if "memory" not in data:
        raise KeyError(f"{path}: no 'memory' section")
    return data["memory"]


def build_weights(
    spec: RealModel, folder: str | Path, size: str, device: str, shard_gb: float = 5.0
) -> dict[str, Any]:
    """Build the model at ``size`` on ``device`` with random bf16 weights (normal, std 0.02,
    seed 0; buffers zero), save it to ``folder`` as sharded safetensors (``shard_gb`` GB per
    shard at real size, 200 KB at tiny so a tiny folder is sharded too) and free it.

    Returns ``{"params": int, "param_bytes": int, "build_s": float}``.
    """

    t0 = time.perf_counter()
    model = meta_model(spec.class_name, spec.model_config(size), torch.bfloat16)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
        for buffer in model.buffers():
            buffer.zero_()
    params = sum(p.numel() for p in model.parameters())
    shard = f"{int(shard_gb * 1000)}MB" if size == "real" else "200KB"
    model.save_pretrained(str(folder), max_shard_size=shard)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"params": params, "param_bytes": 2 * params, "build_s": time.perf_counter() - t0}


def load_lora_model(spec: RealModel, folder: str | Path) -> torch.nn.Module:
    """The saved model (bf16) with LoRA (rank ``spec.lora_rank``, alpha = rank) on
    ``spec.lora_targets``, gradient checkpointing on, in train mode; base weights frozen.
    peft draws ``lora_A`` from torch's global generator: seeded (0) so two loads are equal."""
    from peft import LoraConfig

    cls = diffusers_class(spec.class_name)
    model = cls.from_pretrained(str(folder), torch_dtype=torch.bfloat16)
    model.requires_grad_(False)
    rank = spec.lora_rank
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=spec.lora_targets))
    model.enable_gradient_checkpointing()
    return model.train()
