"""The host side of a weight runtime's set-up: the pinned pool, the checkpoint files, the blocks
and their layouts, the resident parameters, SquareQ's 8-bit images and the host cache, built in
the order each needs the one before (``open_host_side``, called by ``StagehandRuntime``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from runtime.config import MB, StagehandConfig
from runtime.squareq import SquareQ
from runtime.weights.convert import check_sizes, place_resident, register_blocks
from runtime.weights.host_cache import HostCache, weights_mode
from runtime.weights.pool import PinnedPool
from runtime.weights.registry import Block
from runtime.weights.sources import SafetensorsCheckpoint


@dataclass
class HostSide:
    pool: PinnedPool
    source: SafetensorsCheckpoint | None
    """The checkpoint the blocks read (SquareQ's 8-bit copy when it is on), None: module-backed."""
    blocks: list[Block]
    resident_bytes: int
    """Bytes of the parameters outside the blocks, placed on the device for the whole run."""
    squareq: SquareQ
    cache: HostCache
    mode_reason: tuple[str, str]
    """``(weights_mode, weights_mode_reason)`` of the ``stagehand/step`` records."""


def open_host_side(
    model: nn.Module,
    found: list[tuple[str, nn.Module]],
    config: StagehandConfig,
    device: torch.device,
    cuda: bool,
    mode: Literal["training", "inference"],
    checkpoint_dir: str | Path | None,
) -> HostSide:
    """Build the host side of ``model``'s weight runtime: ``found`` are its blocks
    (``find_blocks``), ``config`` the resolved section.

    Raises: ``UnmatchedParameterError``, ``ParameterMismatchError``, ``BlockTooLargeError``,
    ``PoolConfigError`` (``runtime.weights.errors``), SquareQ's configuration errors.
    """
    pool = PinnedPool(
        int(config.pinned_pool_mb * MB),
        int(config.pinned_slab_mb * MB),
        pin=cuda,
        timeout_s=config.slab_acquire_timeout_s,
        allow_pageable=config.allow_pageable_fallback,
        device=device if cuda else None,
    )
    source = SafetensorsCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    blocks = register_blocks(
        model,
        found,
        source,
        config.file_backed and source is not None,
        cuda,
        mode == "inference",
        config.resident_trainable_max_fraction,
    )
    resident_bytes = place_resident(model, blocks, source, device)
    squareq, source = SquareQ.attach(blocks, source, config.squareq)
    check_sizes(blocks, pool, device)
    cache = HostCache.for_run(config.host_cache_mb, cuda, device, pool.locked_bytes)
    for block in blocks:  # module-backed frozen blocks: one (locked) image each
        cache.register(block)
    mode_reason = weights_mode(blocks, cache, config.host_cache_mb, cuda)
    return HostSide(pool, source, blocks, resident_bytes, squareq, cache, mode_reason)
