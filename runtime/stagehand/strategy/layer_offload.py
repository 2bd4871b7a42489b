"""``LayerOffloadStrategy`` (``memory.strategy: "layer_offload"``): the seed's Flux 2048 run.

Source: the Flux 2048 px layer-offload case study. The composed strategy's phases,
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
from pathlib import Path
from typing import Any

import torch

from stagehand.activations import ActivationRuntime
from stagehand.common.phases import Phase
from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import MemoryConfig, StagehandSection
from stagehand.layer_offload.manager import LayerOffloadManager
from stagehand.layer_offload.section import layer_offload_section
from stagehand.strategy.composed import StagehandStrategy
from stagehand.strategy.parts import ActivationsPart, WeightsPart


class LayerOffloadPart(WeightsPart):
    """The weight runtime under the layer-offload schedule (``LayerOffloadManager``): the
    manager's per-step tensor ids are dropped before each forward and after each step, and the
    VRAM watermarks are not live limits (layers are kept by ``layer_offload_fraction``)."""

    name = "layer_offload"

    def __init__(self, manager: LayerOffloadManager) -> None:
        super().__init__(manager.weights)
        self.manager = manager
        self._pageable_at_begin = 0

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._pageable_at_begin = self.manager.pageable_copies()

    def counters(self) -> dict[str, int]:
        """The weight runtime's counters; ``pageable_copies`` adds the layer wrappers' host
        inputs moved from pageable memory this step."""
        counters = super().counters()
        moved = self.manager.pageable_copies() - self._pageable_at_begin
        counters["pageable_copies"] = counters.get("pageable_copies", 0) + moved
        return counters

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
        stagehand.weights.StagehandSetupError: block discovery or pool set-up failed.
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
