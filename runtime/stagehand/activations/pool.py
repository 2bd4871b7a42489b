"""Size-class host pool for spilled activations (``CPUSpillBackend``).

Source: "Activation Stagehand" ("Size-class pool"). Activation tensors range
from under 1 KB to over 200 MB, so one uniform slab size either wastes memory or cannot hold
them; the pool keeps several classes of slabs instead:

- a request takes the smallest class whose slab size is >= the bytes needed, then larger
  classes, and finally a host tensor outside the pool (a pool *miss*), page-locked like the
  pool: PyTorch's caching host allocator hands it out and takes it back for the next miss, so
  a miss costs host memory, never a pageable (synchronous) copy. Layer offload at FLUX.1-dev
  size spills 61 checkpoint inputs of ~25 MB per step: the default pool holds a dozen, and
  the ~49 unpinned misses were its ~100 pageable copies per step on an H100;
- buffers come back to their class by data pointer;
- each class is one host allocation made at construction (pinned when ``pin``), split into
  slabs. Beyond the seed (its v0 limit "fixed pool at init"), ``grow`` adds slabs between steps
  within a growth budget, as one more allocation per call.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from stagehand.common.device import host_buffer
from stagehand.config.memory import MB

_ALIGN = 64
"""Slab sizes are rounded up to this many bytes so a slab can be viewed as any dtype."""


def _slab_bytes(class_mb: float) -> int:
    nbytes = int(round(class_mb * MB))
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


class CPUSpillBackend:
    """Host buffers for spilled tensors, in size classes.

    Args:
        class_sizes_mb: slab size of each class in MB (2**20 bytes), strictly ascending.
        slabs_per_class: one int for every class, or one count per class (the seed's
            ``(512, 2, 2, 2, 2)``).
        pin: page-lock the pool (CUDA only; ``pin_memory`` raises without CUDA).
        growth_budget_mb: host memory ``grow`` may add in total.

    Raises:
        ValueError: empty, non-positive or unsorted ``class_sizes_mb``; a ``slabs_per_class``
            tuple of the wrong length or with a negative count; a negative growth budget.
    """

    def __init__(
        self,
        class_sizes_mb: Sequence[float] = (1, 4, 16, 64, 256),
        slabs_per_class: int | Sequence[int] = (512, 2, 2, 2, 2),
        *,
        pin: bool = False,
        growth_budget_mb: float = 0.0,
    ) -> None:
        classes = tuple(float(c) for c in class_sizes_mb)
        if not classes:
            raise ValueError("class_sizes_mb must name at least one size class, got ()")
        if any(c <= 0 for c in classes) or list(classes) != sorted(set(classes)):
            raise ValueError(
                f"class_sizes_mb must be positive, strictly ascending sizes in MB, got "
                f"{list(class_sizes_mb)}"
            )
        if isinstance(slabs_per_class, bool) or not isinstance(slabs_per_class, (int, Sequence)):
            raise ValueError(f"slabs_per_class must be an int or a tuple, got {slabs_per_class!r}")
        counts = (
            (slabs_per_class,) * len(classes)
            if isinstance(slabs_per_class, int)
            else tuple(slabs_per_class)
        )
        if len(counts) != len(classes):
            raise ValueError(
                f"slabs_per_class has {len(counts)} counts but class_sizes_mb has "
                f"{len(classes)} classes"
            )
        if any(not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"slabs_per_class must be counts >= 0, got {list(counts)}")
        if growth_budget_mb < 0:
            raise ValueError(f"growth_budget_mb must be >= 0, got {growth_budget_mb}")
        self.class_sizes_mb = classes
        self.slab_bytes = tuple(_slab_bytes(c) for c in classes)
        self.pin = pin
        self.growth_budget_bytes = int(growth_budget_mb * MB)
        self.grown_bytes = 0
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[torch.Tensor]] = [[] for _ in classes]
        self._total = [0] * len(classes)
        self._owner: dict[int, int] = {}
        """data_ptr of every pool slab -> its class index."""
        self._out: set[int] = set()
        """data_ptrs of pool slabs handed out and not yet released."""
        self._fallback: set[int] = set()
        self.hits = 0
        self.misses = 0
        for index, count in enumerate(counts):
            self._add_slabs(index, count)

    # -- allocation ------------------------------------------------------------------------------
    def _add_slabs(self, index: int, count: int) -> None:
        if count <= 0:
            return
        size = self.slab_bytes[index]
        chunk = host_buffer(size * count, pin=self.pin)
        self._chunks.append(chunk)
        for i in range(count):
            slab = chunk[i * size : (i + 1) * size]
            self._owner[slab.data_ptr()] = index
            self._free[index].append(slab)
        self._total[index] += count

    def class_for(self, nbytes: int) -> int | None:
        """Index of the smallest class whose slab holds ``nbytes``; None when none does."""
        index = bisect.bisect_left(self.slab_bytes, nbytes)
        return index if index < len(self.slab_bytes) else None

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A host buffer of exactly ``nbytes`` bytes (uint8, 1-D) and whether it is pooled.

        Smallest fitting class first, then larger classes; when every fitting class is empty,
        a tensor outside the pool (counted in ``misses``), page-locked when the pool is.

        Raises:
            ValueError: ``nbytes`` is not positive.
        """
        if nbytes <= 0:
            raise ValueError(f"acquire needs a positive byte count, got {nbytes}")
        first = self.class_for(nbytes)
        if first is not None:
            for index in range(first, len(self._free)):
                if self._free[index]:
                    slab = self._free[index].pop()
                    self._out.add(slab.data_ptr())
                    self.hits += 1
                    return slab[:nbytes], True
        self.misses += 1
        buffer = host_buffer(nbytes, pin=self.pin)
        self._fallback.add(buffer.data_ptr())
        return buffer, False

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back: a slab returns to its class (matched by data pointer), a
        fallback tensor is dropped.

        Raises:
            ValueError: the buffer did not come from ``acquire`` or was already released.
        """
        ptr = buffer.data_ptr()
        if ptr in self._out:
            index = self._owner[ptr]
            self._out.discard(ptr)
            size = self.slab_bytes[index]
            # The full slab, not the caller's (possibly shorter) view of it.
            self._free[index].append(buffer.as_strided((size,), (1,), buffer.storage_offset()))
            return
        if ptr in self._fallback:
            self._fallback.discard(ptr)
            return
        state = "is free already" if ptr in self._owner else "is not from this pool"
        raise ValueError(f"release: buffer at {ptr:#x} ({buffer.numel()} bytes) {state}")

    # -- growth ----------------------------------------------------------------------------------
    def index_of(self, class_mb: float) -> int:
        """Index of the class of ``class_mb`` MB.

        Raises:
            ValueError: no class of that size, naming the sizes there are.
        """
        try:
            return self.class_sizes_mb.index(float(class_mb))
        except ValueError:
            raise ValueError(
                f"no size class of {class_mb} MB; pinned_pool_classes_mb is "
                f"{list(self.class_sizes_mb)}"
            ) from None

    def growth_left_bytes(self) -> int:
        return self.growth_budget_bytes - self.grown_bytes

    def grow(self, class_mb: float, slabs: int) -> int:
        """Add up to ``slabs`` slabs to the class of ``class_mb`` MB within the growth budget.

        Call between steps only (it allocates). Returns the number of slabs added (0 when the
        budget is spent).

        Raises:
            ValueError: unknown class size or a negative slab count.
        """
        index = self.index_of(class_mb)
        if slabs < 0:
            raise ValueError(f"grow: slabs must be >= 0, got {slabs}")
        affordable = self.growth_left_bytes() // self.slab_bytes[index]
        count = int(min(slabs, affordable))
        self._add_slabs(index, count)
        self.grown_bytes += count * self.slab_bytes[index]
        return count

    # -- figures ---------------------------------------------------------------------------------
    def slab_counts(self) -> tuple[int, ...]:
        """Slabs per class (free or in use)."""
        return tuple(self._total)

    def free_counts(self) -> tuple[int, ...]:
        return tuple(len(f) for f in self._free)

    def total_bytes(self) -> int:
        return sum(n * s for n, s in zip(self._total, self.slab_bytes, strict=True))

    def in_use(self) -> int:
        """Buffers handed out and not yet released (pool slabs and fallbacks)."""
        return len(self._out) + len(self._fallback)

    def close(self) -> None:
        """Free the pool's host memory. Buffers still handed out stay valid until dropped."""
        self._chunks.clear()
        self._free = [[] for _ in self._free]
        self._owner.clear()
        self._out.clear()
        self._fallback.clear()
        self._total = [0] * len(self._total)
