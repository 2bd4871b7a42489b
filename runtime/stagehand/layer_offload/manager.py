"""``LayerOffloadManager``: the seed's LayerOffloadConductor on the weight runtime's mechanisms.

Source: the Flux 2048 px layer-offload case study. The manager owns no copy
mechanism of its own: the blocks are the weight runtime's (``WeightRuntime``: block registry,
pinned pool, H2D transfer engine, ``DeviceMemory`` budget, ``stagehand/block`` telemetry), driven
with the layer-offload policy instead of traced streaming:

- resident set: the first ``N - floor(fraction x N)`` blocks are loaded at set-up and never
  evicted (``WeightRuntime.make_resident``; NOTE [ Resident set ] in ``schedule.py``);
- before each offloaded layer it is loaded (the runtime's forward pre-hook, in forward and in a
  checkpoint recomputation, and ``_BackwardBegin`` before the layer's backward);
- after each layer it is evicted at once: the low watermark is 0 and the prefetch window 0, so
  the runtime's ``_done`` (forward hook in forward; in backward when the next layer's backward
  begins, NOTE [ Backward block boundaries ]) always evicts. With ``enable_async_offloading`` the
  window is 1: the next offloaded layer in call order (``LayerOrderScheduler``: layer order,
  learned from a step whose calls left it, NOTE [ Layer order ]) is copied while this one
  computes, at the cost of one more layer on the device; the same blocks are loaded and
  evicted as with the window at 0 (NOTE [ Layer-order window ] in ``schedule.py``);
- stale-layer eviction in ``before_layer`` (below).

# NOTE [ Stale layers ]
The seed evicted in ``after_layer``; a non-reentrant checkpoint recomputation that stops early
(``_StopRecomputationError`` once every saved tensor was recomputed: the default) never reaches
``after_layer``, so the recomputed layer stayed on the device. Here eviction after a layer's
backward is tied to the autograd boundaries (the next layer's ``_BackwardBegin``, or the end of
the backward phase), which early stop does not skip, so that path leaves nothing behind; ``before_layer`` still evicts every loaded non-resident
block other than the one about to run and the prefetched next one (``evict_stale``), so a use
whose end never came (an exception mid-block, a partial backward) cannot accumulate layers.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagehand.common.device import uses_cuda
from stagehand.common.memory import DeviceMemory
from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import StagehandConfig
from stagehand.layer_offload.checkpoint_layer import (
    OffloadCheckpointLayer,
    SharedTensors,
    install,
    uninstall,
)
from stagehand.layer_offload.schedule import LayerOrderScheduler, resident_count
from stagehand.weights import WeightRuntime


class LayerOffloadManager:
    """Resident set, layer-order loads and evictions, and the ``OffloadCheckpointLayer`` wrappers.

    Args:
        model: the model; its blocks are found by ``find_blocks`` (``config.block_pattern``).
        config: the weight runtime's settings (``layer_offload_config`` derives them).
        fraction: ``memory.layer_offload_fraction``, the fraction of blocks offloaded.
        checkpointing: wrap each layer in non-reentrant checkpointing (diffusers' own
            checkpointing is switched off while installed, so a layer is never recomputed twice).
        device, memory, telemetry, mode, checkpoint_dir: as ``WeightRuntime``.

    Raises:
        ValueError: ``fraction`` outside [0, 1] (names ``layer_offload_fraction``); the weight
            runtime's set-up errors (``stagehand.weights.errors``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: StagehandConfig,
        *,
        fraction: float,
        checkpointing: bool,
        device: torch.device | str,
        memory: DeviceMemory | None = None,
        telemetry: Telemetry | None = None,
        mode: str = "training",
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        resident_count(fraction, 0)  # the field is checked before anything is built
        self.model = model
        self.device = torch.device(device)
        self.fraction = fraction
        self.checkpointing = checkpointing and mode == "training"
        self.weights = WeightRuntime(
            model,
            config,
            device=self.device,
            memory=memory,
            telemetry=telemetry,
            mode=mode,
            checkpoint_dir=checkpoint_dir,
        )
        n = len(self.weights.blocks)
        self.n_resident = resident_count(fraction, n)
        self.weights.scheduler = LayerOrderScheduler(
            n,
            config.prefetch_window_blocks,
            training=mode == "training",
            blocks=self.weights.blocks,
            step_open=lambda: self.weights.steps.open,
        )
        self.stats = {"stale_evictions": 0, "after_layer_forward": 0, "after_layer_recompute": 0}
        """Counters over the manager's life: stale blocks evicted, ``after_layer`` calls."""
        self.on_device_max = 0
        """Most non-resident blocks on the device seen by ``before_layer`` (stale ones included)."""
        self._seen = SharedTensors()
        self._gc_flags: list[tuple[nn.Module, bool]] = []
        self._installed: list[tuple[nn.Module, str, nn.Module]] = []
        self._closed = False
        try:
            self.weights.make_resident(range(self.n_resident))
            if self.checkpointing:
                self._gc_flags = [
                    (m, m.gradient_checkpointing)
                    for m in model.modules()
                    if isinstance(getattr(m, "gradient_checkpointing", None), bool)
                ]
                for m, _ in self._gc_flags:
                    m.gradient_checkpointing = False
            non_blocking = uses_cuda(self.device)
            self._installed = install(
                model,
                [(b.name, b.module) for b in self.weights.blocks],
                lambda index, block: OffloadCheckpointLayer(
                    block,
                    index,
                    device=self.device,
                    before_layer=self.before_layer,
                    after_layer=self.after_layer,
                    checkpointing=self.checkpointing,
                    shared=partial(self.shared, owner=index),
                    non_blocking=non_blocking,
                ),
            )
        except BaseException:
            self.close()
            raise

    @property
    def blocks(self) -> list[Any]:
        return self.weights.blocks

    def pageable_copies(self) -> int:
        """Host inputs the layer wrappers moved from pageable memory, over the manager's life
        (``OffloadCheckpointLayer.pageable_copies``; 0 on a CPU device)."""
        return sum(
            parent._modules[key].pageable_copies
            for parent, key, _ in self._installed
            if isinstance(parent._modules[key], OffloadCheckpointLayer)
        )

    def offloaded_on_device(self) -> list[int]:
        """Indices of non-resident blocks loaded now."""
        return [b.index for b in self.weights.blocks if b.on_device and not b.resident]

    # -- callbacks (OffloadCheckpointLayer) -------------------------------------------------------
    def before_layer(self, index: int, recompute: bool) -> None:
        """Evict stale layers (NOTE [ Stale layers ]); the layer itself is loaded by the weight
        runtime's pre-hook right after."""
        self.on_device_max = max(self.on_device_max, len(self.offloaded_on_device()))
        self.stats["stale_evictions"] += len(self.weights.evict_stale({index}))

    def after_layer(self, index: int, recompute: bool) -> None:
        """Count; eviction is the runtime's (it does not depend on this call, which an early
        stopped recomputation skips)."""
        self.stats["after_layer_recompute" if recompute else "after_layer_forward"] += 1

    def shared(self, tensor: torch.Tensor, owner: int | None = None) -> bool:
        """True when ``tensor`` was already passed to a layer of this forward other than layer
        ``owner`` (see NOTE [ Checkpoint inputs as activations ] in ``checkpoint_layer.py``)."""
        return self._seen(tensor, owner)

    def forward_begin(self) -> None:
        """A new forward: no tensor is shared yet."""
        self._seen.clear()

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Put the original blocks back, restore diffusers' checkpointing flags and close the
        weight runtime (resident weights again, pool freed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        uninstall(self._installed)
        self._installed = []
        for module, flag in self._gc_flags:
            module.gradient_checkpointing = flag
        self._gc_flags = []
        self._seen.clear()
        self.weights.close()
