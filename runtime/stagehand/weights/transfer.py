"""The H2D engine: stage a block's bytes in a slab, copy them to one device buffer on the
transfer stream, and bind the parameters to views of that buffer once the copy's event was
waited on by the compute stream (a device-side wait: no host ``synchronize()`` in the hot path).

On CPU the same calls run as synchronous copies (a load materialises the block in a fresh
buffer, an eviction frees it), counted in ``DeviceMemory`` (``"weights"``) as VRAM would be.

Eviction copies back to the host what may have changed on the device (``copy_back.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from stagehand.common.device import (
    ComputeWaits,
    TransferEvent,
    TransferStream,
    device_empty,
    host_buffer,
    on_device,
    slot_views,
    to_device,
)
from stagehand.common.memory import DeviceMemory
from stagehand.config.memory import MB
from stagehand.weights.copy_back import CopyBack
from stagehand.weights.host_cache import HostCache
from stagehand.weights.pool import PinnedPool, Slab
from stagehand.weights.readers import Readers, StagedCopy
from stagehand.weights.registry import Block, BlockState
from stagehand.weights.sources import SafetensorsCheckpoint, split_plan

PART_MIN_BYTES = 8 * MB
"""Readers share a block's read in parts of at least this (a handoff ~0.1 ms, 8 MB read ~2 ms)."""

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
        self.back = CopyBack(device, memory, self._host_wait)
        """Copies back at eviction, on their own D2H stream, and the step-end exposure."""
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
        """Issued copies not yet retired, in issue order (they may finish in another order:
        ``retire``)."""
        self.h2d_bytes = 0
        self.host_waits = 0
        """Host waits on a copy (or a reader) not finished yet (``_host_wait``): none belong in
        a forward or backward (the ``host_waits`` counter)."""
        self.compute_waits = ComputeWaits(device)
        """The compute's waits on prefetched blocks' copies still in flight (``ready``)."""

    # -- completion -----------------------------------------------------------------------------
    def retire(self) -> bool:
        """Release the staging and grant of copies that finished (never blocks); True if any
        did."""
        # Every finished entry, not only a finished head: copies staged by reader threads reach
        # the stream when their read ends, a block image's at once, so a later entry may finish
        # while an earlier one is still being read (and keep its slab and its Conductor grant).
        kept: deque[InFlight] = deque()
        finished: list[InFlight] = []
        for entry in self.inflight:
            (finished if entry.event.query() else kept).append(entry)
        if finished:
            self.inflight = kept
            for entry in finished:
                self._release(entry)
        return bool(finished)

    def _release(self, entry: InFlight) -> None:
        if isinstance(entry.staging, Slab):
            self.pool.release(entry.staging)
        if entry.grant is not None:
            entry.grant.release()

    def _host_wait(self, event: TransferEvent | StagedCopy) -> None:
        """Block the host until ``event``'s copy finished, counted in ``host_waits`` when it had
        not (the hot path waits on the device: ``TransferEvent.wait``)."""
        if not event.query():
            self.host_waits += 1
            event.synchronize()

    def _wait_oldest(self) -> bool:
        # Only reached when the pool or the in-flight limit is exhausted by a demand load.
        if not self.inflight:
            return False
        self._host_wait(self.inflight[0].event)
        return self.retire()

    def drain(self) -> None:
        """Block the host until every copy (H2D and D2H) finished; release every entry."""
        for entry in self.inflight:
            self._host_wait(entry.event)
        self.retire()
        self.back.synchronize()

    @property
    def inflight_limit(self) -> int:
        """H2D copies allowed in flight: ``max_inflight``, at most ``inflight_cap``."""
        cap = self.inflight_cap
        return self.max_inflight if cap is None else min(self.max_inflight, cap)

    def has_capacity(self) -> bool:
        self.retire()
        return len(self.inflight) < self.inflight_limit

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
        back = block.d2h_event
        if speculative and image is None and back is not None and not back.query():
            # Its host masters are still arriving (its copy back) and there is no image to copy
            # from: staging them would wait on the host (below). A prefetch never does; the
            # next prefetch, or the use, loads it (NOTE [ Bytes being freed ] in policy.py).
            return False
        # An emulated card refuses the block here, before any state changes (DeviceMemory).
        self.memory.check_room(block.nbytes)
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
        # This block's host masters may still be arriving (its copy back): a copy from its image
        # waits for it on the device, a staging read on the host.
        d2h, block.d2h_event = block.d2h_event, None
        if d2h is not None and image is None:
            self._host_wait(d2h)
        block.to(BlockState.HOST_STAGED)  # staging (here, or on reader threads)
        # Allocated on this thread's (compute) stream, which frees it after its last use.
        flat = device_empty(block.nbytes, self.device)
        parts = block.read_parts
        if image is not None:
            event: TransferEvent | StagedCopy = self._copy(block, host, flat, None, d2h)
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
        self,
        block: Block,
        host: torch.Tensor,
        flat: torch.Tensor,
        after: TransferEvent | None,
        d2h: TransferEvent | None = None,
    ) -> TransferEvent:
        with self.stream.use(after=after):
            if d2h is not None:  # ``host`` is being written by a copy back
                self.stream.wait(d2h)
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

    def ready(self, block: Block, grads: bool = True, measured: bool = False) -> None:
        """PREFETCHING -> GPU_READY: the compute stream waits on the copy's event, then the
        parameters become views of the block buffer. Trainable gradients follow them when
        ``grads`` (``grads_to_device``); a forward use leaves them on the host, where an unchanged
        one stays (with ``set_to_none=False`` it would travel both ways at every forward).
        ``measured``: the wait is a use's wait on its prefetch (``compute_waits``)."""
        if measured:
            self.compute_waits.wait(block.load_event)
        else:
            block.load_event.wait()
        for slot, view in zip(block.layout, slot_views(block.flat, block.layout), strict=True):
            slot.param.data = view
        self.back.keep_grads(block)
        block.to(BlockState.GPU_READY)
        if grads:
            self.grads_to_device(block)

    def grads_to_device(self, block: Block) -> None:
        """Move ``block``'s host gradients to the device (asynchronous from pinned memory) before
        its backward or an optimizer step accumulates into them or reads them."""
        for slot in block.trainable:
            grad = slot.param.grad
            if grad is not None and not on_device(grad, self.device):
                slot.param.grad = to_device(grad, self.device, self.stream.non_blocking)

    # -- evict ----------------------------------------------------------------------------------
    def evict(self, block: Block) -> None:
        """-> GPU_FREEING -> UNLOADED. File-backed parameters are dropped (they reload from disk);
        module-backed ones point back at their host masters, after what may have changed on the
        device was copied back (EVICTING -> HOST_STAGED; the seed's bug 2): gradients that
        changed since the load, trainable weights an optimizer step changed (``block.dirty``),
        every weight of a block ``expose``d. Nothing to copy: no D2H event, nothing waits."""
        if block.state is BlockState.PREFETCHING:
            # A prefetch evicted before its use: the compute stream, which frees its buffer,
            # waits for the copy on the device (after the host waited for a reader still reading).
            # Its in-flight entry keeps its own staging and grant either way (``InFlight``).
            event = block.load_event
            if isinstance(event, StagedCopy):
                if not event.future.done():
                    self.host_waits += 1
                event.wait_quietly()
            else:
                event.wait()
        host_grads: dict[int, torch.Tensor] = {}
        if block.state is BlockState.GPU_READY:
            self.back.issue(block, host_grads)
        block.to(BlockState.GPU_FREEING)
        for slot in block.layout:
            slot.param.data = slot.host if slot.host is not None else placeholder(slot.dtype)
            if id(slot) in host_grads:
                slot.param.grad = host_grads[id(slot)]
        block.flat = None
        block.prefetched = False
        self.memory.untrack(block.nbytes, "weights")
        block.to(BlockState.UNLOADED)
