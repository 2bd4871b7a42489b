"""The H2D engine: stage a block's bytes in a slab, copy them to one device buffer on the
transfer stream, and bind the parameters to views of that buffer once the copy's event was
waited on by the compute stream (a device-side wait: no host ``synchronize()`` in the hot path).

On CPU the same calls run as synchronous copies: "loading" materialises the block into a fresh
buffer and "evicting" releases it, and both are counted in ``DeviceMemory`` (category
``"weights"``), so the tracked figure falls with streaming exactly as VRAM would.

Eviction of trainable (module-backed) parameters copies data and gradients back to their host
masters on the transfer stream and records one event per block; whoever reads those host tensors
first waits on it (``synchronize_d2h``): a gradient copied with ``non_blocking`` is never read
before the copy finished (a defect of the public implementation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from runtime.common.device import TransferEvent, TransferStream, host_buffer
from runtime.common.memory import DeviceMemory
from runtime.weights.pool import PinnedPool, Slab
from runtime.weights.registry import Block, BlockState, slot_view
from runtime.weights.sources import SafetensorsCheckpoint


def placeholder(dtype: torch.dtype) -> torch.Tensor:
    """The data of an evicted file-backed parameter: empty, so any use outside the runtime's
    hooks fails loudly instead of computing with stale or zero weights."""
    return torch.empty(0, dtype=dtype)


class TransferEngine:
    """Loads and evicts blocks; at most ``max_inflight`` H2D copies in flight (live knob)."""

    def __init__(
        self,
        device: torch.device,
        pool: PinnedPool,
        memory: DeviceMemory,
        source: SafetensorsCheckpoint | None,
        max_inflight: int,
    ) -> None:
        self.device = device
        self.stream = TransferStream(device)
        self.pool = pool
        self.memory = memory
        self.source = source
        self.max_inflight = max_inflight
        self.inflight: deque[Block] = deque()
        self.h2d_bytes = 0
        self.d2h_events: list[TransferEvent] = []
        self.on_copy_done: Callable[[Block], None] | None = None

    # -- completion -----------------------------------------------------------------------------
    def retire(self) -> bool:
        """Release the staging of copies that finished (never blocks); True if any did."""
        freed = False
        while self.inflight and self.inflight[0].load_event.query():
            self._release(self.inflight.popleft())
            freed = True
        return freed

    def _release(self, block: Block) -> None:
        if isinstance(block.staging, Slab):
            self.pool.release(block.staging)
        block.staging = None
        if self.on_copy_done is not None:
            self.on_copy_done(block)

    def _wait_oldest(self) -> bool:
        # Only reached when the pool or the in-flight limit is exhausted by a demand load.
        if not self.inflight:
            return False
        self.inflight[0].load_event.synchronize()
        return self.retire()

    def has_capacity(self) -> bool:
        self.retire()
        return len(self.inflight) < self.max_inflight

    def synchronize_d2h(self) -> None:
        """Block the host until every D2H copy back to host masters finished."""
        for event in self.d2h_events:
            event.synchronize()
        self.d2h_events.clear()

    # -- load -----------------------------------------------------------------------------------
    def load(self, block: Block, *, speculative: bool) -> bool:
        """UNLOADED -> HOST_STAGED -> PREFETCHING: stage ``block`` and issue its H2D copy.

        A speculative load gives up (returns False) when no slab or in-flight slot is free;
        a demand load waits for one (the pool's timeout bounds the wait).
        """
        if speculative and not self.has_capacity():
            return False
        while len(self.inflight) >= self.max_inflight:
            self._wait_oldest()
        if block.nbytes > self.pool.slab_bytes:
            # Direct path (seed): one contiguous host staging buffer, one copy.
            staging: Slab | torch.Tensor = host_buffer(block.nbytes, pin=False)
            host = staging
        else:
            slab = (
                self.pool.try_acquire(block.name)
                if speculative
                else self.pool.acquire(block.name, self._wait_oldest)
            )
            if slab is None:
                return False
            staging, host = slab, slab.buffer[: block.nbytes]
        if block.d2h_event is not None:  # this block's host masters may still be arriving
            block.d2h_event.synchronize()
            block.d2h_event = None
        for slot in block.layout:
            dst = host[slot.offset : slot.offset + slot.nbytes]
            if slot.key is not None:
                self.source.read_into(slot.key, dst)
            else:
                dst.view(slot.dtype).view(slot.shape).copy_(slot.host)
        block.to(BlockState.HOST_STAGED)
        flat = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        with self.stream.use():
            flat.copy_(host, non_blocking=self.stream.non_blocking)
            event = self.stream.record()
        block.flat, block.load_event, block.staging = flat, event, staging
        block.to(BlockState.PREFETCHING)
        self.memory.track(block.nbytes, "weights")
        self.h2d_bytes += block.nbytes
        self.inflight.append(block)
        self.retire()
        return True

    def ready(self, block: Block) -> None:
        """PREFETCHING -> GPU_READY: the compute stream waits on the copy's event, then the
        parameters become views of the block buffer (trainable gradients follow them)."""
        block.load_event.wait()
        for slot in block.layout:
            slot.param.data = slot_view(block.flat, slot)
            grad = slot.param.grad
            if grad is not None and grad.device != self.device:
                slot.param.grad = grad.to(self.device, non_blocking=self.stream.non_blocking)
        block.to(BlockState.GPU_READY)

    # -- evict ----------------------------------------------------------------------------------
    def evict(self, block: Block) -> None:
        """-> GPU_FREEING -> UNLOADED. File-backed parameters are dropped (they reload from disk);
        module-backed ones point back at their host masters, trainable ones after their data and
        gradients were copied back (EVICTING -> HOST_STAGED; the seed's bug 2)."""
        if block.state is BlockState.PREFETCHING:
            # A prefetch evicted before its use: its buffer and staging may be freed only after
            # its copy, and its in-flight entry (staging slab, Conductor grant) must go now: a
            # reload would otherwise replace the block's staging and event while the old entry
            # is queued, and the first slab and grant would never be released. Copies finish in
            # order, so retiring after this one's host wait takes it off the queue.
            block.load_event.synchronize()
            self.retire()
        trainable = [s for s in block.layout if s.trainable]
        if trainable and block.state is BlockState.GPU_READY:
            block.to(BlockState.EVICTING)
            with self.stream.use():
                for slot in trainable:
                    slot.host.copy_(slot.param.data, non_blocking=self.stream.non_blocking)
                    grad = slot.param.grad
                    if grad is not None:
                        if slot.host_grad is None or slot.host_grad.shape != grad.shape:
                            slot.host_grad = torch.empty(
                                grad.shape, dtype=grad.dtype, pin_memory=self.stream.non_blocking
                            )
                        slot.host_grad.copy_(grad, non_blocking=self.stream.non_blocking)
                block.d2h_event = self.stream.record()
                self.d2h_events.append(block.d2h_event)
            if self.stream.stream is not None:
                block.flat.record_stream(self.stream.stream)
                for slot in trainable:
                    if slot.param.grad is not None:
                        slot.param.grad.record_stream(self.stream.stream)
            block.to(BlockState.HOST_STAGED)
        block.to(BlockState.GPU_FREEING)
        for slot in block.layout:
            had_grad = slot.param.grad is not None
            slot.param.data = slot.host if slot.host is not None else placeholder(slot.dtype)
            if slot.trainable and had_grad:
                slot.param.grad = slot.host_grad
        block.flat = None
        block.prefetched = False
        self.memory.untrack(block.nbytes, "weights")
        block.to(BlockState.UNLOADED)
