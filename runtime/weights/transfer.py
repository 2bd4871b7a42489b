"""The H2D engine: stage a block's bytes in a slab, copy them to one device buffer on the
transfer stream, and bind the parameters to views of that buffer once the copy's event was
waited on by the compute stream (a device-side wait: no host ``synchronize()`` in the hot path).

On CPU the same calls run as synchronous copies: "loading" materialises the block into a fresh
buffer and "evicting" releases it, and both are counted in ``DeviceMemory`` (category
``"weights"``), so the tracked figure falls with streaming exactly as VRAM would.

Eviction of trainable (module-backed) parameters copies their gradients back to the host, and
their data to the host masters when it may have changed on the device (an optimizer step, or
the user's code between steps: ``Block.dirty``; the weights of a block loaded from its masters
are the masters' own copy until then), on a D2H stream of its own,
and records one event per block; whoever reads those host tensors first waits on it (``synchronize_d2h``): a gradient copied with ``non_blocking`` is never read
before the copy finished (a defect of the public implementation).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from runtime.common.device import TransferEvent, TransferStream, host_buffer, host_like
from runtime.common.memory import DeviceMemory
from runtime.config import MB
from runtime.weights.host_cache import HostCache
from runtime.weights.pool import PinnedPool, Slab
from runtime.weights.readers import Readers
from runtime.weights.registry import Block, BlockState, slot_views
from runtime.weights.sources import SafetensorsCheckpoint, split_plan

PART_MIN_BYTES = 8 * MB
"""A block's read is shared by the readers in parts of at least this (a part's handoff costs
~0.1 ms, 8 MB of page-cache reads ~2 ms)."""

_PLACEHOLDERS: dict[torch.dtype, torch.Tensor] = {}


def placeholder(dtype: torch.dtype) -> torch.Tensor:
    """The data of an evicted file-backed parameter: empty, so any use outside the runtime's
    hooks fails loudly instead of computing with stale or zero weights (one shared empty tensor
    per dtype: an eviction allocates nothing)."""
    empty = _PLACEHOLDERS.get(dtype)
    if empty is None:
        empty = _PLACEHOLDERS[dtype] = torch.empty(0, dtype=dtype)
    return empty


def _converts(source: SafetensorsCheckpoint, slot: Any) -> bool:
    """Whether ``slot``'s checkpoint tensor is stored in another precision (read one by one)."""
    return source.entries[slot.key].dtype != slot.dtype


def _nothing() -> None:
    """The one part of a block with nothing to read (host masters only)."""


class StagedCopy:
    """The ``TransferEvent`` of a block read and copied on a reader thread: complete when the
    reader staged the block and the H2D copy it issued finished. Waiting on it first waits (on
    the host) for the reader, then as on the copy's own event.

    A reader that failed (a short read, a file gone) is complete as far as its staging goes
    (``query``, ``synchronize``: its slab may be reused, nothing reads it any more); its error
    is raised where the block's data would be used (``wait``, from ``TransferEngine.ready``).
    """

    __slots__ = ("future",)

    def __init__(self, future: Future[TransferEvent]) -> None:
        self.future = future

    def query(self) -> bool:
        future = self.future
        return future.done() and (future.exception() is not None or future.result().query())

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.future.result().wait(stream)  # raises the reader's error

    def synchronize(self) -> None:
        if self.future.exception() is None:  # waits for the reader
            self.future.result().synchronize()


@dataclass(eq=False)
class InFlight:
    """One issued H2D copy and what it holds until its event completes: the staging it reads
    (a slab, the direct path's host buffer, or a block image) and the Conductor's H2D grant. The entry owns
    them, not the block: a block evicted and reloaded before ``retire`` ran has two entries,
    each released with its own copy."""

    block: Block
    event: TransferEvent
    staging: Slab | torch.Tensor
    grant: Any | None = None


class TransferEngine:
    """Loads and evicts blocks; at most ``inflight_limit`` H2D copies in flight: the user's
    ``max_inflight`` (live limits write it), at most the Conductor's ``inflight_cap``."""

    def __init__(
        self,
        device: torch.device,
        pool: PinnedPool,
        memory: DeviceMemory,
        source: SafetensorsCheckpoint | None,
        max_inflight: int,
        reader_threads: int = 0,
        reader_min_bytes: int = 0,
        cache: HostCache | None = None,
    ) -> None:
        self.device = device
        self.stream = TransferStream(device)
        """H2D copies (block loads)."""
        self.d2h_stream = TransferStream(device)
        """D2H copies (trainable weights and gradients copied back at eviction): a stream of
        their own, so a prefetch is not queued behind an eviction and the copy engines run both
        directions at once. A load of a block whose copy back is still running waits for it
        first (``block.d2h_event``)."""
        self.readers = Readers(reader_threads) if reader_threads > 0 else None
        """Reader threads (``reader_threads``): they share each block's read, and the last
        part's reader issues its H2D copy (``readers.py``)."""
        self.cache = cache if cache is not None else HostCache(0, pin=False)
        """Block images (``host_cache.py``): a load with a ready image copies from it."""
        self.reader_min_bytes = reader_min_bytes
        """Prefetched blocks of at least this many bytes go to the readers."""
        self.pool = pool
        self.memory = memory
        self.source = source
        self.max_inflight = max_inflight
        self.inflight_cap: int | None = None
        """The Conductor's cap (published by its adapter, >= 1); None without a Conductor."""
        self.inflight: deque[InFlight] = deque()
        """Issued copies in issue order (a stream completes them in that order)."""
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        """Bytes copied back to the host at evictions (gradients, and weights when dirty)."""
        self.d2h_events: list[TransferEvent] = []

    # -- completion -----------------------------------------------------------------------------
    def retire(self) -> bool:
        """Release the staging and grant of copies that finished (never blocks); True if any
        did."""
        freed = False
        while self.inflight and self.inflight[0].event.query():
            self._release(self.inflight.popleft())
            freed = True
        return freed

    def _release(self, entry: InFlight) -> None:
        if isinstance(entry.staging, Slab):
            self.pool.release(entry.staging)
        if entry.grant is not None:
            entry.grant.release()

    def _wait_oldest(self) -> bool:
        # Only reached when the pool or the in-flight limit is exhausted by a demand load.
        if not self.inflight:
            return False
        self.inflight[0].event.synchronize()
        return self.retire()

    def wait_block(self, block: Block) -> None:
        """Block the host until every copy issued for ``block`` finished, and retire it."""
        for entry in list(self.inflight):
            if entry.block is block:
                entry.event.synchronize()
        self.retire()

    def drain(self) -> None:
        """Block the host until every copy (H2D and D2H) finished; release every entry."""
        for entry in self.inflight:
            entry.event.synchronize()
        self.retire()
        self.synchronize_d2h()

    @property
    def inflight_limit(self) -> int:
        """H2D copies allowed in flight: ``max_inflight``, at most ``inflight_cap``."""
        cap = self.inflight_cap
        return self.max_inflight if cap is None else min(self.max_inflight, cap)

    def has_capacity(self) -> bool:
        self.retire()
        return len(self.inflight) < self.inflight_limit

    def synchronize_d2h(self) -> None:
        """Block the host until every D2H copy back to host masters finished."""
        for event in self.d2h_events:
            event.synchronize()
        self.d2h_events.clear()

    # -- load -----------------------------------------------------------------------------------
    def load(self, block: Block, *, speculative: bool, grant: Any | None = None) -> bool:
        """UNLOADED -> HOST_STAGED -> PREFETCHING: stage ``block`` and issue its H2D copy.

        A speculative load gives up (returns False) when no slab or in-flight slot is free;
        a demand load waits for one (the pool's timeout bounds the wait). ``grant`` (the
        Conductor's H2D slot) is released with the copy's entry once the copy finished; on
        False it stays the caller's.
        """
        if speculative and not self.has_capacity():
            return False
        while len(self.inflight) >= self.inflight_limit:
            self._wait_oldest()
        if block.read_plan is None:
            self._plan(block)
        image = self.cache.ready(block)
        fill = None
        if image is None:
            fill = self.cache.reserve(block)
        if image is not None or fill is not None:
            # A block image: the copy reads it directly, no slab (host_cache.py).
            staging: Slab | torch.Tensor = image if image is not None else fill
            host = staging
        elif block.staged_bytes > self.pool.slab_bytes:
            # Direct path (seed): one contiguous host staging buffer, one copy; pinned like the
            # pool (PyTorch's host cache reuses it from the second load on), else the
            # "asynchronous" copy would run synchronously.
            staging = host_buffer(block.staged_bytes, pin=self.pool.pin)
            host = staging
        else:
            slab = (
                self.pool.try_acquire(block.name)
                if speculative
                else self.pool.acquire(block.name, self._wait_oldest)
            )
            if slab is None:
                return False
            staging, host = slab, slab.buffer[: block.staged_bytes]
        if block.d2h_event is not None:  # this block's host masters may still be arriving
            block.d2h_event.synchronize()
            block.d2h_event = None
        block.to(BlockState.HOST_STAGED)  # staging (here, or on reader threads)
        # Allocated on this thread's (compute) stream, which frees it after its last use.
        flat = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        parts = block.read_parts
        if image is not None:
            event: TransferEvent | StagedCopy = self._copy(block, host, flat, None)
        elif self.readers is None or not (
            len(parts) > 1 or speculative and block.nbytes >= self.reader_min_bytes
        ):
            # A small block reads faster than a handoff to a reader thread (which waits for
            # Python's thread switch), and a demand load is waited on at once: read here,
            # unless the block's read is shared by several readers (faster than one thread).
            for part in parts:
                self.source.read_plan(part, host, count=False)
            event = self._finish(block, host, flat, None, fill is not None)
        else:
            # The copy must follow the compute work queued so far (``flat`` may be memory that
            # work still uses), which the readers' threads cannot see: an event marks it.
            after = self.stream.mark()
            reads = [partial(self.source.read_plan, part, host, False) for part in parts]
            finish = partial(self._finish, block, host, flat, after, fill is not None)
            event = StagedCopy(self.readers.stage(reads or [_nothing], finish))
        block.flat, block.load_event = flat, event
        block.to(BlockState.PREFETCHING)
        self.memory.track(block.nbytes, "weights")
        self.h2d_bytes += block.staged_bytes
        self.inflight.append(InFlight(block, event, staging, grant))
        self.retire()
        return True

    def _plan(self, block: Block) -> None:
        """At a block's first load: its read plan (checkpoint tensors read as they are, one
        vectored read per contiguous run) and its ``staged`` slots (host masters, converted
        tensors), so later loads do no per-slot work beyond the copies themselves."""
        source = self.source
        direct = [
            s
            for s in block.staged_layout
            if source is not None and s.key is not None and not _converts(source, s)
        ]
        block.read_plan = source.plan([(s.key, s.offset) for s in direct]) if direct else []
        threads = self.readers.threads if self.readers is not None else 1
        block.read_parts = split_plan(block.read_plan, threads, PART_MIN_BYTES)
        if block.read_parts == [[]]:
            block.read_parts = []
        chosen = {id(s) for s in direct}
        block.staged = [s for s in block.staged_layout if id(s) not in chosen]

    def _finish(
        self,
        block: Block,
        host: torch.Tensor,
        flat: torch.Tensor,
        after: TransferEvent | None,
        fills_image: bool,
    ) -> TransferEvent:
        """After ``block``'s read plan was read into ``host``: its other slots (host masters,
        converted tensors), the read counters, the image marked filled, then the H2D copy into
        ``flat``. On the loading thread, or on the reader that read the last part."""
        for slot in block.staged:
            dst = host[slot.offset : slot.offset + slot.nbytes]
            if slot.key is None:
                dst.view(slot.dtype).view(slot.shape).copy_(slot.host)
            else:
                self.source.read_into(slot.key, dst, slot.dtype)
        if block.read_plan:  # the parts counted bytes; a cut tensor is still one tensor
            self.source.count_reads(sum(len(run[3]) for run in block.read_plan), 0)
        if fills_image:
            self.cache.filled(block)
        return self._copy(block, host, flat, after)

    def _copy(
        self, block: Block, host: torch.Tensor, flat: torch.Tensor, after: TransferEvent | None
    ) -> TransferEvent:
        with self.stream.use(after=after):
            if block.image is None:
                self.stream.copy_(flat, host)
            else:  # SquareQ: the 8-bit image copied, dequantized into ``flat`` on this stream
                block.image.stage(self.stream, host, flat)
            return self.stream.record()

    def close(self) -> None:
        """Stop the reader threads (after ``drain``)."""
        if self.readers is not None:
            self.readers.shutdown()
            self.readers = None

    def ready(self, block: Block) -> None:
        """PREFETCHING -> GPU_READY: the compute stream waits on the copy's event, then the
        parameters become views of the block buffer (trainable gradients follow them)."""
        block.load_event.wait()
        for slot, view in zip(block.layout, slot_views(block.flat, block.layout), strict=True):
            slot.param.data = view
        for slot in block.trainable:
            grad = slot.param.grad
            if grad is not None and grad.device != self.device:
                slot.param.grad = grad.to(self.device, non_blocking=self.stream.non_blocking)
        block.to(BlockState.GPU_READY)

    # -- evict ----------------------------------------------------------------------------------
    def evict(self, block: Block) -> None:
        """-> GPU_FREEING -> UNLOADED. File-backed parameters are dropped (they reload from disk);
        module-backed ones point back at their host masters, trainable ones after their
        gradients, and their data when an optimizer step changed it on the device
        (``block.dirty``), were copied back (EVICTING -> HOST_STAGED; the seed's bug 2)."""
        if block.state is BlockState.PREFETCHING:
            # A prefetch evicted before its use: nothing on the compute stream waited for its
            # copy, so its device buffer may be dropped only after the copy (host wait, rare).
            # Its in-flight entry keeps its own staging and grant either way (``InFlight``).
            self.wait_block(block)
        trainable = block.trainable
        host_grads: dict[int, torch.Tensor] = {}
        if trainable and block.state is BlockState.GPU_READY:
            block.to(BlockState.EVICTING)
            with self.d2h_stream.use():
                for slot in trainable:
                    if block.dirty:
                        self.d2h_stream.copy_(slot.host, slot.param.data)
                        self.d2h_bytes += slot.nbytes
                    grad = slot.param.grad
                    if grad is not None:
                        self.d2h_bytes += grad.nbytes
                        # A fresh host gradient per eviction, as autograd gives a fresh ``.grad``
                        # after ``zero_grad(set_to_none=True)``: one the user kept is never
                        # overwritten. Pinned ones come from PyTorch's caching host allocator.
                        host_grads[id(slot)] = host = host_like(grad, self.d2h_stream.non_blocking)
                        self.d2h_stream.copy_(host, grad)
                block.d2h_event = self.d2h_stream.record()
                self.d2h_events.append(block.d2h_event)
            block.dirty = False
            pending = block.nbytes
            if self.d2h_stream.stream is not None:  # device gradients are real allocations
                pending += sum(s.param.grad.nbytes for s in trainable if s.param.grad is not None)
                block.flat.record_stream(self.d2h_stream.stream)
                for slot in trainable:
                    if slot.param.grad is not None:
                        slot.param.grad.record_stream(self.d2h_stream.stream)
            # Freed below, yet read by the D2H copy until its event: not reusable before.
            self.memory.release_after(block.d2h_event, pending)
            block.to(BlockState.HOST_STAGED)
        block.to(BlockState.GPU_FREEING)
        for slot in block.layout:
            slot.param.data = slot.host if slot.host is not None else placeholder(slot.dtype)
            if id(slot) in host_grads:
                slot.param.grad = host_grads[id(slot)]
        block.flat = None
        block.prefetched = False
        self.memory.untrack(block.nbytes, "weights")
        block.to(BlockState.UNLOADED)
