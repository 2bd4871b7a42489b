"""The weight and activation runtimes' settings for ``memory.strategy: "layer_offload"``
(``layer_offload_section``), derived from the model's blocks and the ``memory`` section; the
strategy itself is ``runtime.strategy.layer_offload.LayerOffloadStrategy``."""

from __future__ import annotations

import math
from typing import Any

import torch

from runtime.config import (
    MB,
    ActivationStagehandConfig,
    MemoryConfig,
    StagehandConfig,
    StagehandSection,
)
from runtime.weights.registry import find_blocks

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


def _block_mb(model: torch.nn.Module, pattern: str | None) -> int:
    largest = max(
        sum(p.numel() * p.element_size() for p in module.parameters())
        for _, module in find_blocks(model, pattern)
    )
    return max(1, math.ceil(largest / MB))


def _ceiling_mb(model: torch.nn.Module, cuda: bool, device: torch.device) -> float:
    # The weight runtime's high watermark. The resident count, not a byte budget, decides what
    # stays (NOTE [ Resident set ]), so this only bounds the async prefetch: the card on CUDA,
    # on CPU what keeping every block resident would take. Both are finite figures the
    # dashboard can draw as the "high" line of the VRAM chart (an infinite one would flatten it).
    if cuda:
        return torch.cuda.get_device_properties(device).total_memory / MB
    tensors = [*model.parameters(), *model.buffers()]
    return max(1.0, math.ceil(sum(t.numel() * t.element_size() for t in tensors) / MB))


def layer_offload_section(
    model: torch.nn.Module, memory: MemoryConfig, *, device: torch.device | str
) -> StagehandSection:
    """The weight and activation runtimes' settings for ``memory`` (see the module docstring).

    Weights: one slab holds the largest block, two slabs (one copy in flight while the next is
    staged), module-backed (the seed's plain layer-level CPU/GPU movement), low watermark 0 (a
    finished non-resident block is always evicted), high watermark at the ceiling above,
    prefetch window 1 with async offloading else 0. Activations: the seed's pool; watermarks
    0 (offloading) or never reached (keep).

    Raises:
        pydantic.ValidationError: an override makes a setting invalid (names the field).
        runtime.weights.BlockDiscoveryError: the model has no blocks.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    given = memory.stagehand
    if given is not None and not given.weight_streaming:
        raise ValueError(
            "memory.stagehand.weight_streaming is false, but layer_offload streams the offloaded "
            'blocks\' weights: use strategy "stagehand" for activation spill alone'
        )
    overrides = {
        f: getattr(given, f) for f in _WEIGHT_FIELDS if given and f in given.model_fields_set
    }
    slab = overrides.get("pinned_slab_mb") or _block_mb(model, overrides.get("block_pattern"))
    weights: dict[str, Any] = {
        "pinned_slab_mb": slab,
        "pinned_pool_mb": 2 * slab,
        "max_inflight_transfers": 2,
        "prefetch_window_blocks": 1 if memory.enable_async_offloading else 0,
        "file_backed": False,
        "vram_high_watermark_mb": _ceiling_mb(model, cuda, device),
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
