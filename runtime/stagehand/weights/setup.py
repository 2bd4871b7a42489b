"""The host side of a weight runtime's set-up: the pinned pool, the checkpoint files, the blocks
and their layouts, the resident parameters, SquareQ's 8-bit images and the host cache, built in
the order each needs the one before (``open_host_side``, called by ``WeightRuntime``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from stagehand.config.memory import MB, StagehandConfig
from stagehand.squareq import SquareQ
from stagehand.weights.convert import check_sizes, place_resident, register_blocks
from stagehand.weights.defaults import block_bytes, resolve, staged_sizes
from stagehand.weights.host_cache import HostCache, weights_mode
from stagehand.weights.pool import PinnedPool
from stagehand.weights.registry import Block
from stagehand.weights.sources import SafetensorsCheckpoint


@dataclass
class HostSide:
    config: StagehandConfig
    """The section with its pipeline fields resolved (``defaults.resolve``)."""
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
    vram_bytes: int,
    mode: Literal["training", "inference"],
    checkpoint_dir: str | Path | None,
) -> HostSide:
    """Build the host side of ``model``'s weight runtime: ``found`` are its blocks
    (``find_blocks``), ``config`` the preset's section; the pipeline fields it leaves out are
    derived from the blocks and the card (``vram_bytes``, 0 off CUDA) once SquareQ's images
    exist, the slab sized to the bytes staged (``defaults.staged_sizes``).

    Raises: ``UnmatchedParameterError``, ``ParameterMismatchError``, ``BlockTooLargeError``,
    ``PoolConfigError`` (``stagehand.weights.errors``), SquareQ's configuration errors.
    """
    source = SafetensorsCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    sizes = block_bytes(found)  # the modules as given, before their layouts are built
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
    squareq, source = SquareQ.attach(blocks, source, config.squareq, device=device)
    staged = staged_sizes(squareq.enabled, [b.staged_bytes for b in blocks])
    config = resolve(config, sizes, staged=staged, cuda=cuda, vram_bytes=vram_bytes)
    pool = PinnedPool(
        int(config.pinned_pool_mb * MB),
        int(config.pinned_slab_mb * MB),
        pin=cuda,
        timeout_s=config.slab_acquire_timeout_s,
        allow_pageable=config.allow_pageable_fallback,
        device=device if cuda else None,
    )
    check_sizes(blocks, pool, device)
    cache = HostCache.for_run(config.host_cache_mb, cuda, device, pool.locked_bytes)
    for block in blocks:  # module-backed frozen blocks: one (locked) image each
        cache.register(block)
    mode_reason = weights_mode(blocks, cache, config.host_cache_mb, cuda)
    return HostSide(config, pool, source, blocks, resident_bytes, squareq, cache, mode_reason)
