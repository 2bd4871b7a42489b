"""The weight runtime's pipeline settings a preset leaves out (``null``), from the blocks and the
device: prefetch window, H2D copies in flight, slab and pool size, reader threads. The runtime
(``WeightRuntime``) and the planner (``backend/workbench/plan/simulate.py``, ``tune.py``) resolve them
with the same function, so a plan simulates the pipeline a run gets.

# NOTE [ Pipeline depth ]
CUDA: copies run on the copy engine beside the compute. To keep the engine fed, the blocks
ahead of use should hold about ``AHEAD_BYTES`` (1 GiB: ~20 ms of a PCIe gen5 x16 link at
~50 GB/s, ~40 ms at gen4, longer than a Python block boundary or a GC pause): the window is
``ceil(AHEAD_BYTES / largest block)``, 2 to ``MAX_WINDOW``, at most the blocks less one, and
the window's blocks (plus the one in use) within ``VRAM_SHARE`` of the card. FLUX.1-dev's
649 MiB double blocks get 2 on an 80 GB card (the window of before: peak VRAM unchanged), 1 on a
12 GB one; a model of 20 MB blocks 8.
Copies in flight are twice the window: a copy holds its slot until it completes on the device,
and it is queued after the compute issued before it, so while the host runs ahead of the GPU
(no host wait in the hot path) slots are held by copies that only wait for queued compute; with
as many slots as window blocks the next prefetch would be skipped and become a demand load (the
H100 run of ``test_h2d_copies_overlap_compute_without_host_syncs``). Slots cost no VRAM (loaded
blocks are bounded by the window and the watermarks). One slab holds the largest block (no
direct-path allocation), the pool one slab per copy in flight plus one for a demand load.
With SquareQ a slab stages a block's 8-bit image, not its compute-dtype buffer: slab and pool
follow the staged bytes (``staged_sizes``); the window still counts the device buffers.
Readers: half the cores, 2 to 8 (one block's read is shared by all of them, ``readers.py``;
page cache -> pinned reads on an H100 host scaled 4.4 -> 13.9 -> 22.8 GB/s on 1, 4, 8 threads,
measured). CPU: copies are synchronous, so depth buys nothing and only holds
memory: the previous defaults (window 2, 2 in flight, 1024 MB slabs, 8192 MB pool allocated on
use, no reader thread).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import nn

from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights.registry import ALIGN

AHEAD_BYTES = 1024 * MB
MAX_WINDOW = 8
VRAM_SHARE = 0.10
"""Share of the card the window's blocks (and the one in use) may take."""


@dataclass(frozen=True)
class Pipeline:
    """Derived settings, named as the ``StagehandConfig`` fields they fill."""

    prefetch_window_blocks: int
    max_inflight_transfers: int
    pinned_slab_mb: int
    pinned_pool_mb: int
    reader_threads: int


CPU = Pipeline(2, 2, 1024, 8192, 0)
"""A CPU device's settings (NOTE [ Pipeline depth ])."""


def pipeline(
    block_bytes: Sequence[int],
    *,
    cuda: bool,
    vram_bytes: int = 0,
    cpus: int | None = None,
    staged: Sequence[int] | None = None,
) -> Pipeline:
    """The settings for blocks of ``block_bytes`` (bytes each, aligned layout) on a CUDA card of
    ``vram_bytes`` (0: unknown) with ``cpus`` cores (None: this machine's), or on the CPU.
    ``staged``: each block's bytes staged per load when they differ (``staged_sizes``); the
    slab holds the largest (None: ``block_bytes``)."""
    if not cuda or not block_bytes:
        return CPU
    largest = max(block_bytes)
    window = min(MAX_WINDOW, max(2, math.ceil(AHEAD_BYTES / largest)))
    if vram_bytes:
        window = min(window, max(1, int(VRAM_SHARE * vram_bytes) // largest - 1))
    window = min(window, max(1, len(block_bytes) - 1))
    inflight = 2 * window
    slab = max(1, math.ceil(max(staged or block_bytes) / MB))
    cores = cpus if cpus is not None else os.cpu_count() or 2
    return Pipeline(window, inflight, slab, (inflight + 1) * slab, min(8, max(2, cores // 2)))


def block_bytes(found: Sequence[tuple[str, nn.Module]]) -> list[int]:
    """Each block's bytes in its aligned layout (``registry.build_layout``), every parameter
    counted (adapters kept resident included: a slab a little larger, never smaller)."""
    return [
        sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in module.parameters())
        for _, module in found
    ]


def staged_sizes(squareq: bool, images: Sequence[int]) -> list[int] | None:
    """The ``staged`` sizes of ``pipeline``/``resolve``: with SquareQ on, each block's bytes
    staged per load (``images``: ``Block.staged_bytes`` in the runtime, ``BlockInfo.image_bytes``
    in the planner: the 8-bit image, or the layout's bytes when nothing in it is quantizable);
    off, None (the slab holds the largest of the blocks' ``block_bytes``)."""
    return list(images) if squareq and images else None


def resolve(
    config: StagehandConfig,
    sizes: Sequence[int],
    *,
    staged: Sequence[int] | None = None,
    **device,
) -> StagehandConfig:
    """``config`` with its ``None`` pipeline fields derived (``pipeline(sizes, **device,
    staged=staged)``); given fields are kept. On CUDA a slab given without a pool: a pool of as many such slabs
    as the derived one has; a pool given without a slab: the derived slab, at most the pool."""
    derived = asdict(pipeline(sizes, staged=staged, **device))
    update = {name: value for name, value in derived.items() if getattr(config, name) is None}
    slab, pool = config.pinned_slab_mb, config.pinned_pool_mb
    if slab is not None and pool is None and device.get("cuda"):
        update["pinned_pool_mb"] = slab * (derived["pinned_pool_mb"] // derived["pinned_slab_mb"])
    if pool is not None and slab is None:
        update["pinned_slab_mb"] = min(pool, derived["pinned_slab_mb"])
    return config.model_copy(update=update) if update else config
