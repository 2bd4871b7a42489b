"""One simulated step's figures (``backend/workbench/plan/simulate.py``): what a plan reports of a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepResult:
    """One simulated step. Times in ms, bytes in bytes."""

    step_ms: float = 0.0
    compute_ms: float = 0.0
    h2d_ms: float = 0.0
    exposed_h2d_ms: float = 0.0
    stall_ms: float = 0.0
    spill_ms: float = 0.0
    """Host time of activation spills and restores (a CPU device only)."""
    peak_bytes: int = 0
    low_bytes: int = 1 << 62
    """Lowest usage between the step's first and last block use (the band's floor)."""
    blocks_loaded: int = 0
    misses: int = 0
    """Uses that found their block not loaded: a demand load (the runtime's prefetch misses)."""
    waits: int = 0
    """Uses whose block was still in flight: the host waited on its copy (``stall_ms``)."""
    copy_waits: int = 0
    """Those of ``waits`` whose block was prefetched, not loaded on demand: the runtime's
    ``copy_waits``, which grow the window (NOTE [ Window growth ])."""
    window: int = 0
    """The prefetch window the step ran with (blocks)."""
    h2d_bytes: int = 0
    spilled_bytes: int = 0
    loads_by_source: dict[str, int] = field(default_factory=dict)
    """Block loads per source (NOTE [ Where a load's bytes come from ]; ``tracked`` on CPU)."""
    read_bytes: int = 0
    """Bytes the reader threads read from files (page cache or disk) into slabs."""
    streamed_blocks: int = 0
    """Distinct blocks loaded in the step; the others stayed on the device through it."""
    resident_block_bytes: int = 0
    """Bytes of the blocks on the device through the whole step (never loaded in it)."""
    curve: list[tuple[float, int, str]] = field(default_factory=list)
    """``(t_ms, device bytes, event)`` at every change."""
