"""The weight and activation runtimes' settings for ``memory.strategy: "layer_offload"``:
``layer_offload_section`` derives them from the model's blocks and the ``memory`` section through
``section_for``, which the planner calls with the same figures read from a model on ``meta``; the
strategy itself is ``stagehand.strategy.layer_offload.LayerOffloadStrategy``."""

from __future__ import annotations

import math
from typing import Any

import torch

from stagehand.config.memory import (
    MB,
    ActivationStagehandConfig,
    MemoryConfig,
    StagehandConfig,
    StagehandSection,
)
from stagehand.weights.registry import find_blocks

NO_BUDGET_MB = 1e9
"""Activation watermarks that are never reached (keep every saved tensor)."""

_WEIGHT_FIELDS = (
    "pinned_pool_mb",
    "pinned_slab_mb",
    "max_inflight_transfers",
    "prefetch_window_blocks",
    "block_pattern",
    "file_backed",
    "slab_acquire_timeout_s",
    "allow_pageable_fallback",
    "resident_trainable_max_fraction",
    "block_events",
    "vram_high_watermark_mb",
)


def _largest_block_bytes(model: torch.nn.Module, pattern: str | None) -> int:
    return max(
        sum(p.numel() * p.element_size() for p in module.parameters())
        for _, module in find_blocks(model, pattern)
    )


def ceiling_mb(weight_bytes: int, device_bytes: int | None) -> float:
    """The weight runtime's high watermark (MB): ``device_bytes`` (the card's memory on CUDA),
    or on a CPU device (``None``) what keeping every weight resident takes (``weight_bytes``:
    parameters and buffers), in whole MB."""
    # The resident count, not a byte budget, decides what stays (NOTE [ Resident set ]), so
    # this only bounds the async prefetch. Both are finite figures the dashboard can draw as
    # the "high" line of the VRAM chart (an infinite one would flatten it).
    if device_bytes is not None:
        return device_bytes / MB
    return max(1.0, math.ceil(weight_bytes / MB))


def _ceiling_mb(model: torch.nn.Module, cuda: bool, device: torch.device) -> float:
    if cuda:
        return ceiling_mb(0, torch.cuda.get_device_properties(device).total_memory)
    tensors = [*model.parameters(), *model.buffers()]
    return ceiling_mb(sum(t.numel() * t.element_size() for t in tensors), None)


def layer_offload_section(
    model: torch.nn.Module, memory: MemoryConfig, *, device: torch.device | str
) -> StagehandSection:
    """The weight and activation runtimes' settings for ``memory`` on ``model``: the largest
    block and the ceiling measured on the model, then ``section_for`` (the planner calls that
    with the same figures read from a model on ``meta``).

    Raises:
        pydantic.ValidationError: an override makes a setting invalid (names the field).
        ValueError: ``memory.stagehand.weight_streaming`` is false.
        stagehand.weights.BlockDiscoveryError: the model has no blocks.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    given = memory.stagehand
    pattern = given.block_pattern if given is not None else None
    return section_for(
        memory,
        largest_block_bytes=_largest_block_bytes(model, pattern),
        ceiling_mb=_ceiling_mb(model, cuda, device),
        cuda=cuda,
    )


def section_for(
    memory: MemoryConfig, *, largest_block_bytes: int, ceiling_mb: float, cuda: bool
) -> StagehandSection:
    """The settings for ``memory`` (see the module docstring), given the largest block's
    parameter bytes (LoRA included: the slab is that, in whole MB) and the weight runtime's
    ceiling (``ceiling_mb``, its high watermark).

    Weights: one slab holds the largest block, two slabs (one copy in flight while the next is
    staged), module-backed (the seed's plain layer-level CPU/GPU movement), low watermark 0 (a
    finished non-resident block is always evicted), high watermark at the ceiling, prefetch
    window 1 with async offloading else 0. Activations: the seed's pool; watermarks 0
    (offloading) or never reached (keep).

    Raises:
        pydantic.ValidationError: an override makes a setting invalid (names the field).
        ValueError: ``memory.stagehand.weight_streaming`` is false.
    """
    given = memory.stagehand
    if given is not None and not given.weight_streaming:
        raise ValueError(
            "memory.stagehand.weight_streaming is false, but layer_offload streams the offloaded "
            'blocks\' weights: use strategy "stagehand" for activation spill alone'
        )
    overrides = {
        f: getattr(given, f) for f in _WEIGHT_FIELDS if given and f in given.model_fields_set
    }
    slab = overrides.get("pinned_slab_mb") or max(1, math.ceil(largest_block_bytes / MB))
    weights: dict[str, Any] = {
        "pinned_slab_mb": slab,
        "pinned_pool_mb": 2 * slab,
        "max_inflight_transfers": 2,
        "prefetch_window_blocks": 1 if memory.enable_async_offloading else 0,
        "file_backed": False,
        "vram_high_watermark_mb": ceiling_mb,
        **overrides,
        "vram_low_watermark_mb": 0.0,
    }
    offload = memory.enable_activation_offloading
    act: dict[str, Any] = {
        "vram_high_watermark_mb": 0.0 if offload else NO_BUDGET_MB,
        "vram_low_watermark_mb": 0.0 if offload else NO_BUDGET_MB,
        "predictive_restore": memory.enable_async_offloading,
        "max_inflight_d2h": 2 if cuda and memory.enable_async_offloading else 1,
    }
    if not offload:  # nothing spills: no host pool
        act.update(pinned_pool_classes_mb=(1,), slabs_per_class=(0,), pinned_growth_budget_mb=0)
    if given is not None and given.activation_stagehand is not None:
        a = given.activation_stagehand
        act.update({f: getattr(a, f) for f in a.model_fields_set})
    StagehandConfig.model_validate(weights)  # errors name the field before anything is built
    return StagehandSection(
        **weights,
        activation_stagehand=ActivationStagehandConfig(**act),
        conductor_config=given.conductor_config if given is not None else None,
    )
