"""Per-step counters of the activation runtime and the ``activation_stagehand/step`` record.

Source: "Activation Stagehand" (the JSONL record: ``step``,
``activations_saved`` ... ``vram_peak_mb``) and ``docs/contracts.md``, which adds
``prefetch_hits`` and ``restore_ms`` for predictive restore.

Invariants after a training step (tested): ``activations_saved = activations_kept +
activations_spilled``; ``pool_hits + pool_misses = activations_spilled``; and when backward
consumed every saved tensor, ``activations_restored = activations_spilled``,
``restore_bytes = spill_bytes`` and ``stall_count + prefetch_hits = activations_restored``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SOURCE = "activation_stagehand"

STEP_FIELDS = (
    "step",
    "activations_saved",
    "activations_kept",
    "activations_spilled",
    "activations_restored",
    "spill_bytes",
    "restore_bytes",
    "stall_time_ms",
    "stall_count",
    "pool_hits",
    "pool_misses",
    "vram_peak_mb",
    "prefetch_hits",
    "restore_ms",
)
"""The step record's fields, in the seed's order, then ours."""


@dataclasses.dataclass
class ActivationStepMetrics:
    """Counters of one step. Bytes are bytes, times are milliseconds of host wall time."""

    step: int = -1
    activations_saved: int = 0
    """Saved tensors this runtime was asked about (the weight runtime claims its views first)."""
    activations_kept: int = 0
    """Left on the device: under the watermark, not eligible, or spill refused."""
    activations_spilled: int = 0
    activations_restored: int = 0
    """Restores issued (on demand or predictive)."""
    spill_bytes: int = 0
    """Bytes copied D2H (the storage span of each spilled view)."""
    restore_bytes: int = 0
    stall_time_ms: float = 0.0
    """Host time backward spent in unpack on restores issued there (not prefetched). On CUDA
    those copies are asynchronous and the wait happens on the device, so ``stall_count`` is
    the figure to compare there."""
    stall_count: int = 0
    """Restores issued at unpack time (the tensor was needed and not on its way)."""
    pool_hits: int = 0
    pool_misses: int = 0
    vram_peak_mb: float = 0.0
    """Peak of the shared ``DeviceMemory`` over the step (allocator or tracked), MB."""
    prefetch_hits: int = 0
    """Spilled tensors already restored (or restoring) when backward first asked for them."""
    restore_ms: float = 0.0
    """Host time spent in restores, prefetched or not (on CUDA: issuing them)."""
    # Not in the record: diagnostics for tests and logs.
    spills_denied: int = 0
    """Spills refused by the Conductor or by ``max_d2h = 0`` (the tensor was kept)."""
    inline_finalizes: int = 0
    """Times the D2H cap was reached and in-flight spills were finished before the next."""

    def record(self) -> dict[str, Any]:
        """Exactly the step record's fields (``STEP_FIELDS``)."""
        return {name: getattr(self, name) for name in STEP_FIELDS}
