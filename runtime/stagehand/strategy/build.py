"""``build_strategy``: the preset's ``memory`` section to a strategy object."""

from __future__ import annotations

from pathlib import Path

import torch

from stagehand.common.device import own_storage
from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import MemoryConfig
from stagehand.strategy.base import MemoryStrategy
from stagehand.strategy.composed import StagehandStrategy
from stagehand.strategy.layer_offload import LayerOffloadStrategy


def build_strategy(
    model: torch.nn.Module,
    memory: MemoryConfig | dict,
    *,
    device: torch.device | str,
    telemetry: Telemetry | None = None,
    checkpoint_dir: str | Path | None = None,
    mode: str = "training",
    activation_peak: int = 0,
) -> MemoryStrategy:
    """The strategy named by ``memory.strategy`` for ``model``.

    - ``"none"``: ``MemoryStrategy``, the plain model (the baseline), moved to ``device`` with
      its weights in ordinary allocations (``own_storage``).
    - ``"stagehand"``: ``StagehandStrategy`` (weight streaming, activation spill and the
      Conductor, each as ``memory.stagehand`` says: ``weight_streaming: false`` gives activation
      spill alone).
    - ``"layer_offload"``: ``LayerOffloadStrategy`` (the first ``(1 - layer_offload_fraction)
      x N`` blocks resident, the rest loaded before and evicted after each layer, checkpointed
      layers with activations moved to the host between them; ``runtime/stagehand/layer_offload``,
      ``stagehand.strategy.layer_offload``).

    ``checkpoint_dir`` is the model's safetensors folder (sharded or not); with it, frozen block
    weights stream from the files (file-backed) instead of being kept in host RAM.
    ``mode`` is ``"training"`` or ``"inference"`` (stage-1 text encoding).
    ``activation_peak``: the planned activation peak (bytes) that ``"auto"`` fields of
    ``memory.stagehand`` resolve with at build (``workbench.plan.activation_peak.planned_activation_peak``; 0: none
    planned), until the trace step measures it.

    Raises:
        pydantic.ValidationError: ``memory`` is not a valid memory section.
        ValueError: bad ``mode`` or a set-up error of a runtime (naming the field).
        NotImplementedError: the strategy is not available in this build.
    """
    if not isinstance(memory, MemoryConfig):
        memory = MemoryConfig.model_validate(memory)
    if memory.strategy == "none":
        own_storage(model, device)  # NOTE [ Exact numbers ] in runtime/stagehand/__init__.py
        return MemoryStrategy(model, device=device, telemetry=telemetry)
    if memory.strategy == "stagehand":
        return StagehandStrategy(
            model,
            memory.stagehand,
            device=device,
            telemetry=telemetry,
            checkpoint_dir=checkpoint_dir,
            mode=mode,
            activation_peak=activation_peak,
        )
    if memory.strategy == "layer_offload":
        return LayerOffloadStrategy(
            model,
            memory,
            device=device,
            telemetry=telemetry,
            checkpoint_dir=checkpoint_dir,
            mode=mode,
        )
    raise NotImplementedError(f"memory.strategy {memory.strategy!r} is not built yet")
