"""``LayerOffloadStrategy`` (``memory.strategy: "layer_offload"``): the seed's Flux 2048 run.

Source: ``shared/seeds/case-study-flux-2048-layer-offload.md``. The composed strategy's phases,
router, Conductor wiring and live limits (``StagehandStrategy``) with two parts swapped in:

- weights: ``LayerOffloadManager`` (the weight runtime driven by the layer-offload policy:
  resident fraction, load before a layer, evict after, stale-layer eviction, the
  ``OffloadCheckpointLayer`` wrappers);
- activations: the activation runtime (``ActivationRuntime``) behind the same router. With
  ``enable_activation_offloading`` its watermarks are 0, so every checkpoint input (NOTE
  [ Checkpoint inputs as activations ]) goes to the host when the layer saves it and is restored,
  in reverse order and ahead of need, for the layer's recomputation: the seed's "activations
  shuttle CPU<->GPU between blocks" on the runtime that already has the size-class pinned pool,
  the D2H/H2D streams with events, the Conductor's D2H slots and ``activation_stagehand/step``
  telemetry, instead of a third copy mechanism. Without it the watermarks are infinite: every
  saved tensor is kept, and on CPU counted in the tracked figure, so peaks compare honestly.

``memory`` fields used: ``layer_offload_fraction``, ``gradient_checkpointing``,
``enable_activation_offloading``, ``enable_async_offloading`` (copies issued ahead of need:
the next layer's weights, ``restore_ahead`` activations; off: each copy when needed). An optional
``memory.stagehand`` section overrides, field by field, only what it sets: the weight runtime's
pool, transfer and file-backing fields, ``activation_stagehand`` and ``conductor_config``.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from runtime.common.phases import Phase
from runtime.common.telemetry import Telemetry
from runtime.config import (
    MB,
    ActivationStagehandConfig,
    MemoryConfig,
    StagehandConfig,
    StagehandSection,
)
from runtime.layer_offload.manager import LayerOffloadManager
from runtime.strategy.composed import StagehandStrategy
from runtime.strategy.parts import ActivationsPart, WeightsPart
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
        runtime.weights.BlockDiscoveryError: the model has no blocks.
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


class LayerOffloadPart(WeightsPart):
    """The weight runtime under the layer-offload schedule (``LayerOffloadManager``): the
    manager's per-step tensor ids are dropped before each forward and after each step, and the
    VRAM watermarks are not live limits (layers are kept by ``layer_offload_fraction``)."""

    name = "layer_offload"

    def __init__(self, manager: LayerOffloadManager) -> None:
        super().__init__(manager.weights)
        self.manager = manager

    def phase(
        self, phase: Phase, optimizer: torch.optim.Optimizer | None
    ) -> contextlib.AbstractContextManager[Any]:
        if phase is Phase.FORWARD:
            self.manager.forward_begin()
        return super().phase(phase, optimizer)

    def end_step(self) -> None:
        try:
            super().end_step()
        finally:
            self.manager.forward_begin()  # drop the step's tensor ids

    def check_limits(self, given: dict[str, Any], merged: dict[str, Any]) -> None:
        """Raises ``ValueError`` for ``vram_high_watermark_mb`` / ``vram_low_watermark_mb``."""
        if "vram_high_watermark_mb" in given or "vram_low_watermark_mb" in given:
            raise ValueError(
                "vram_high_watermark_mb / vram_low_watermark_mb: the layer_offload strategy "
                "keeps layers by memory.layer_offload_fraction, not by watermarks"
            )

    def close(self) -> None:
        """Put the original blocks back and close the weight runtime (``manager.close``)."""
        self.manager.close()


class LayerOffloadStrategy(StagehandStrategy):
    """Layer offload behind the ``MemoryStrategy`` phases (see the module docstring).

    Args:
        model: the model (LoRA attached, on the host); its blocks are wrapped until ``close``.
        memory: the preset's ``memory`` section (``MemoryConfig`` or its dict).
        device, telemetry, checkpoint_dir, mode: as ``StagehandStrategy``.

    Raises:
        pydantic.ValidationError: ``memory`` is invalid (``layer_offload_fraction`` outside
            [0, 1] names ``layer_offload_fraction``).
        ValueError: bad ``mode``; pools above the Conductor's ``pinned_budget_mb``; live
            limits setting the VRAM watermarks (``LayerOffloadPart``).
        runtime.weights.StagehandSetupError: block discovery or pool set-up failed.
    """

    name = "layer_offload"

    def __init__(
        self,
        model: torch.nn.Module,
        memory: MemoryConfig | dict,
        *,
        device: torch.device | str,
        telemetry: Telemetry | None = None,
        checkpoint_dir: str | Path | None = None,
        mode: str = "training",
    ) -> None:
        if not isinstance(memory, MemoryConfig):
            memory = MemoryConfig.model_validate(memory)
        self.memory_config = memory
        self.manager: LayerOffloadManager | None = None
        section = layer_offload_section(model, memory, device=device)
        super().__init__(
            model,
            section,
            device=device,
            telemetry=telemetry,
            checkpoint_dir=checkpoint_dir,
            mode=mode,
        )

    def _build_parts(
        self,
        model: torch.nn.Module,
        section: StagehandSection,
        checkpoint_dir: str | Path | None,
        mode: str,
    ) -> None:
        from runtime.activations import ActivationRuntime

        shared = {"device": self.device, "memory": self.memory, "telemetry": self.telemetry}
        self.manager = LayerOffloadManager(
            model,
            section,
            fraction=self.memory_config.layer_offload_fraction,
            checkpointing=self.memory_config.gradient_checkpointing,
            mode=mode,
            checkpoint_dir=checkpoint_dir,
            **shared,
        )
        self.weights = self.manager.weights
        self.parts.append(LayerOffloadPart(self.manager))
        if mode == "training":
            self.activations = ActivationRuntime(
                section.activation_stagehand, model=model, **shared
            )
            self.parts.append(ActivationsPart(self.activations))
