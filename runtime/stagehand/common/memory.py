"""Device memory figures shared by the runtimes: CUDA allocator on GPU, tracked bytes on CPU.

On CUDA the figures come from the caching allocator (``memory_allocated`` *and*
``memory_reserved``: a budget on allocated memory alone lets reserved memory run into the card's
limit, a defect of the public implementation). On CPU there is no separate device memory, so the
runtimes account for what they place on the compute device themselves (streamed block weights,
kept saved tensors...) through ``track``/``untrack``; figures are then labelled ``"tracked"``.
One ``DeviceMemory`` is shared by every runtime of a strategy so their bytes add up.

A card of any size (``workbench train --card-gb``, ``stagehand.common.card.emulate_card``): on
CUDA the caching allocator is capped and raises its own ``torch.OutOfMemoryError``; on the CPU
the tracked bytes are held under ``capacity_bytes``, and the ``track`` that would cross it raises
``torch.OutOfMemoryError`` before counting anything, at the allocation that crosses the card as
CUDA would (the runtimes call ``check_room`` before they change a block's or a record's state).
"""

from __future__ import annotations

import threading
import time

import torch

from stagehand.config.memory import MB

STATS_REUSE_S = 0.0005
"""How long one read of the CUDA allocator's statistics serves further figures (500 us) while
the runtimes' own device bytes did not change (``DeviceMemory._allocator``)."""


EMULATED_CARD: dict[str, int] = {}
"""Device type -> the emulated card's bytes (``stagehand.common.card.emulate_card``): the capacity
a ``DeviceMemory`` built without one takes. Process-wide, as CUDA's
``set_per_process_memory_fraction`` is: every strategy of the worker (stage 1's text encoders,
training, the end's samples) runs on the one card."""


class DeviceMemory:
    """VRAM usage of ``device`` in bytes, with its source (``"cuda"`` or ``"tracked"``).

    ``capacity_bytes``: the card's bytes; None takes the emulated card's (``EMULATED_CARD``), or
    on CUDA the device's total memory, or on the CPU no limit. Tracked bytes above it raise
    ``torch.OutOfMemoryError`` (CPU; on CUDA the allocator raises).
    """

    def __init__(self, device: torch.device | str, capacity_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.source = "cuda" if self.is_cuda else "tracked"
        if capacity_bytes is None:
            capacity_bytes = EMULATED_CARD.get(self.device.type)
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        """The card's bytes (None: unknown, no limit on the CPU); ``card_bytes()`` reads it."""
        self._lock = threading.Lock()
        self._tracked = 0
        self._tracked_peak = 0
        self._by_category: dict[str, int] = {}
        self._pending: list[tuple[object, int]] = []
        self._generation = 0
        """Counts ``track``/``untrack`` calls: a change of the runtimes' own device bytes."""
        self._stats: dict | None = None
        self._stats_key = (-1, 0.0)

    def card_bytes(self) -> int | None:
        """The card's capacity in bytes: ``capacity_bytes``, else on CUDA the device's total
        memory; None for a CPU without an emulated card."""
        if self.capacity_bytes is not None or not self.is_cuda:
            return self.capacity_bytes
        return torch.cuda.get_device_properties(self.device).total_memory

    def check_room(self, nbytes: int) -> None:
        """Refuse ``nbytes`` more on an emulated CPU card (``capacity_bytes``) as CUDA refuses
        an allocation: call it before the allocation changes any state. No-op on CUDA (the
        allocator raises itself) and without a capacity.

        Raises:
            torch.OutOfMemoryError: tracked bytes plus ``nbytes`` above ``capacity_bytes``; its
                ``requested_bytes`` and ``in_use_bytes`` give the figures.
        """
        cap = self.capacity_bytes
        if cap is None or self.is_cuda or self._tracked + nbytes <= cap:
            return
        raise out_of_memory(nbytes, self._tracked, cap)

    def track(self, nbytes: int, category: str = "other") -> None:
        """Count ``nbytes`` placed on the compute device (tracked on CUDA too, for telemetry).

        Raises:
            torch.OutOfMemoryError: on the CPU, the bytes would cross ``capacity_bytes``
                (``check_room``); nothing is counted then.
        """
        with self._lock:
            if nbytes > 0:
                self.check_room(nbytes)
            self._generation += 1
            self._tracked += nbytes
            self._by_category[category] = self._by_category.get(category, 0) + nbytes
            if self._tracked > self._tracked_peak:
                self._tracked_peak = self._tracked

    def untrack(self, nbytes: int, category: str = "other") -> None:
        """Count ``nbytes`` released from the compute device.

        Raises:
            RuntimeError: when more is released than was tracked (an accounting bug).
        """
        with self._lock:
            left = self._by_category.get(category, 0) - nbytes
            if left < 0 or self._tracked - nbytes < 0:
                raise RuntimeError(
                    f"untrack({nbytes}, {category!r}) releases more than tracked "
                    f"({self._by_category.get(category, 0)} bytes in that category)"
                )
            self._by_category[category] = left
            self._tracked -= nbytes
            self._generation += 1

    def release_after(self, event: object, nbytes: int) -> None:
        """Count ``nbytes`` that were just released (``untrack``, or freed to the CUDA allocator
        with ``record_stream``) but are still read by a copy on another stream, until ``event``
        (a ``TransferEvent``) completes. ``memory_allocated`` drops at once, yet the allocator
        cannot reuse that memory before the copy ends: ``usage_bytes`` counts it, so watermarks
        see what cannot be reused yet."""
        with self._lock:
            self._pending.append((event, nbytes))

    def pending_bytes(self) -> int:
        """Released bytes still read by a copy in flight (``release_after``)."""
        with self._lock:
            self._pending = [(e, n) for e, n in self._pending if not e.query()]
            return sum(n for _, n in self._pending)

    def tracked_bytes(self, category: str | None = None) -> int:
        if category is None:
            return self._tracked
        return self._by_category.get(category, 0)

    def _allocator(self, *names: str) -> list[int]:
        """The caching allocator's current ``names`` figures (bytes, pool "all").

        One read of its nested statistics (~20 us on an H100 host; ``torch.cuda.memory_allocated``
        flattens and sorts all ~170 of them on every call, ~0.4 ms), reused for
        ``STATS_REUSE_S`` while the runtimes' own device bytes did not change (no ``track`` or
        ``untrack``): one block transition reads the figures for its telemetry events and its
        watermark checks several times within microseconds. Only what compute allocated in
        that window is missed.
        """
        now = time.perf_counter()
        generation, read_at = self._stats_key
        if self._stats is None or generation != self._generation or now - read_at > STATS_REUSE_S:
            self._stats = torch.cuda.memory.memory_stats_as_nested_dict(self.device)
            self._stats_key = (self._generation, now)
        stats = self._stats
        return [stats.get(name, {}).get("all", {}).get("current", 0) for name in names]

    def allocated_bytes(self) -> int:
        """Bytes allocated on the device now."""
        if self.is_cuda:
            return self._allocator("allocated_bytes")[0]
        return self._tracked

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds (allocated plus cached); equals allocated when tracked."""
        if self.is_cuda:
            return self._allocator("reserved_bytes")[0]
        return self._tracked

    def allocated_and_reserved(self) -> tuple[int, int]:
        """``(allocated_bytes(), reserved_bytes())`` from one read of the allocator."""
        if self.is_cuda:
            allocated, reserved = self._allocator("allocated_bytes", "reserved_bytes")
            return allocated, reserved
        return self._tracked, self._tracked

    def usage_bytes(self) -> int:
        """The figure budgets compare against watermarks, in bytes.

        Tracked: the tracked bytes. CUDA: allocated plus the allocator's inactive split bytes
        (free fragments inside reserved segments that a new block of weights cannot use), so a
        fragmented cache counts against the budget instead of being invisible to it. Both add
        the bytes released while a copy on another stream still reads them (``pending_bytes``).
        """
        if self.is_cuda:
            used = sum(self._allocator("allocated_bytes", "inactive_split_bytes"))
        else:
            used = self._tracked
        return used + (self.pending_bytes() if self._pending else 0)

    def peak_bytes(self) -> int:
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return self._tracked_peak

    def reset_peak(self) -> None:
        """Start a new peak window (each step)."""
        with self._lock:
            self._tracked_peak = self._tracked
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def snapshot(self) -> dict[str, float | str]:
        """Figures for telemetry, in MB."""
        return {
            "vram_allocated_mb": self.allocated_bytes() / MB,
            "vram_reserved_mb": self.reserved_bytes() / MB,
            "vram_peak_mb": self.peak_bytes() / MB,
            "vram_source": self.source,
        }


def out_of_memory(requested: int, in_use: int, card: int) -> torch.OutOfMemoryError:
    """The ``torch.OutOfMemoryError`` of an emulated card, worded as CUDA's ("Tried to allocate
    X MiB ... N MiB free of a G GiB card"), with ``requested_bytes`` and ``in_use_bytes``."""
    free = max(0, card - in_use)
    exc = torch.OutOfMemoryError(
        f"Tried to allocate {requested / 2**20:.2f} MiB: {in_use / 2**20:.2f} MiB in use, "
        f"{free / 2**20:.2f} MiB free of a {card / 2**30:.4g} GiB card (emulated, tracked)"
    )
    exc.requested_bytes, exc.in_use_bytes = requested, in_use
    return exc


HOST_CACHE_BYTES = 256 * 2**20
"""Freed host allocations up to this size stay in the process heap (``cache_host_allocations``)."""


def cache_host_allocations() -> bool:
    """Keep freed host memory in the process for reuse, as CUDA's caching allocator keeps freed
    device memory: glibc's ``mallopt`` with an mmap threshold of ``HOST_CACHE_BYTES``, a trim
    threshold of 1 GB and a top pad of ``HOST_CACHE_BYTES``. For a worker whose compute device is
    the CPU: each block load allocates a fresh device buffer, which glibc would otherwise map
    anew and page-fault on first touch (``workbench bench`` measures the copy into fresh memory
    at about a third of the copy into reused memory on its 2-core machine). Returns False where
    there is no glibc (the figures are then slower, never different). Process-wide: call it
    from a process's entry point, never from a library."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    return bool(
        mallopt(m_mmap_threshold, HOST_CACHE_BYTES)
        and mallopt(m_trim_threshold, 2**30)
        and mallopt(m_top_pad, HOST_CACHE_BYTES)
    )
