"""The weight runtime's counters: one step's work as a dataclass (``StepCounts``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Totals:
    """Figures counted over the runtime's life, read at a step's start and when reported: the
    step's share is the difference."""

    h2d_bytes: int = 0
    """Bytes of block weights copied to the device (``TransferEngine.h2d_bytes``)."""
    d2h_bytes: int = 0
    """Bytes copied back to the host at evictions: trainable gradients, weights an optimizer
    step changed on the device, and module-backed weights of blocks left on the device between
    steps (``TransferEngine.d2h_bytes``)."""
    file_reads: int = 0
    """Tensors read from the safetensors files (``SafetensorsCheckpoint.reads``)."""
    file_read_bytes: int = 0
    """Bytes read from the safetensors files (``SafetensorsCheckpoint.read_bytes``)."""
    pageable_copies: int = 0
    """Asynchronous copies a pageable host buffer made synchronous (0 expected)."""
    host_waits: int = 0
    """Host waits on copies not finished yet (``TransferEngine.host_waits``)."""
    host_cache_hits: int = 0
    """Loads copied straight from a block image (``HostCache.hits``)."""
    file_reads_avoided: int = 0
    """Checkpoint tensors those loads did not read (``HostCache.reads_avoided``)."""
    resident_blocks: int = 0
    """Blocks on the device now (loaded or loading, layer offload's resident set included): a
    state, not a count, reported as it is rather than as a difference."""

    @classmethod
    def read(cls, source: Any, transfer: Any, cache: Any, blocks: Iterable[Any]) -> Totals:
        """The figures now of a weight runtime's checkpoint (``source``, None: module-backed),
        ``TransferEngine``, ``HostCache`` and blocks."""
        return cls(
            h2d_bytes=transfer.h2d_bytes,
            d2h_bytes=transfer.back.bytes,
            file_reads=source.reads if source is not None else 0,
            file_read_bytes=source.read_bytes if source is not None else 0,
            pageable_copies=transfer.stream.pageable_copies + transfer.back.stream.pageable_copies,
            host_waits=transfer.host_waits,
            host_cache_hits=cache.hits,
            file_reads_avoided=cache.reads_avoided,
            resident_blocks=sum(block.on_device for block in blocks),
        )


@dataclass
class StepCounts:
    """The weight runtime's work in one step (a new one at each step's start)."""

    blocks_loaded: int = 0
    """Blocks whose H2D copy was issued (demand loads and prefetches)."""
    blocks_evicted: int = 0
    prefetch_hits: int = 0
    """Uses that found the block prefetched."""
    prefetch_misses: int = 0
    """Uses that had to load the block on demand."""
    prefetch_skipped: int = 0
    """Prefetches not issued: the high watermark, no slab or slot, or the Conductor said no."""
    stall_time_ms: float = 0.0
    """Host time the compute waited for demand loads (ms)."""
    copy_waits: int = 0
    """Uses whose compute waited on their prefetched block's copy, still in flight when the
    compute reached the use (``ComputeWaits``: measured on the device on CUDA)."""
    copy_wait_ms: float = 0.0
    """The device's time in those waits (ms; CUDA only, 0.0 elsewhere)."""
    at_begin: Totals = field(default_factory=Totals)
    """The life figures when the step began."""

    def counters(self, now: Totals) -> dict[str, int]:
        """The strategy's counters (``stagehand.strategy.base.COUNTERS``) this part has, with the
        life figures ``now``."""
        begin = self.at_begin
        return {
            "blocks_loaded": self.blocks_loaded,
            "blocks_evicted": self.blocks_evicted,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "file_reads": now.file_reads - begin.file_reads,
            "h2d_bytes": now.h2d_bytes - begin.h2d_bytes,
            "resident_blocks": now.resident_blocks,
            "pageable_copies": now.pageable_copies - begin.pageable_copies,
            "host_waits": now.host_waits - begin.host_waits,
        }

    def record(self, now: Totals) -> dict[str, Any]:
        """The counts of a ``stagehand/step`` record (docs/contracts.md): ``counters`` plus
        ``prefetch_skipped``, ``stall_time_ms``, ``copy_waits``, ``copy_wait_ms``,
        ``d2h_bytes``, ``file_read_bytes``, ``host_cache_hits`` and ``file_reads_avoided``."""
        begin = self.at_begin
        return {
            **self.counters(now),
            "prefetch_skipped": self.prefetch_skipped,
            "stall_time_ms": self.stall_time_ms,
            "copy_waits": self.copy_waits,
            "copy_wait_ms": self.copy_wait_ms,
            "d2h_bytes": now.d2h_bytes - begin.d2h_bytes,
            "file_read_bytes": now.file_read_bytes - begin.file_read_bytes,
            "host_cache_hits": now.host_cache_hits - begin.host_cache_hits,
            "file_reads_avoided": now.file_reads_avoided - begin.file_reads_avoided,
        }
