"""The D2H side of the weight runtime: what an eviction copies back to the host, and what a step's
end exposes to the user's code.

An eviction copies back, on a D2H stream of its own, what may have changed on the device:
changed trainable gradients, trainable weights after an optimizer step (``Block.dirty``) and
the module-backed weights of a block left on the device between steps (``expose``). One event per
block that copied anything; whoever reads those host tensors first waits on it
(``synchronize``; a load from an image, on the device), so a ``non_blocking`` gradient is never
read early (a defect of the public implementation); host waits are counted by the caller's
``host_wait``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stagehand.common.device import TransferEvent, TransferStream, host_like
from stagehand.common.memory import DeviceMemory
from stagehand.weights.errors import LostWriteError
from stagehand.weights.registry import Block, BlockState


class CopyBack:
    """Copies back at eviction and the step-end exposure (module docstring). ``host_wait``:
    the transfer engine's counted host wait on an event."""

    def __init__(
        self,
        device: torch.device,
        memory: DeviceMemory,
        host_wait: Callable[[TransferEvent], None],
    ) -> None:
        self.memory = memory
        self.host_wait = host_wait
        self.stream = TransferStream(device)
        """D2H copies: a stream of their own, so a prefetch is not queued behind an eviction and
        the copy engines run both directions at once. A load of a block whose copy back is
        still running waits for it first (``block.d2h_event``)."""
        self.bytes = 0
        """Bytes copied back to the host at evictions (gradients that changed, weights an
        optimizer step changed or the user's code could write)."""
        self.events: list[tuple[TransferEvent, bool]] = []
        """Copies back not yet waited on: each block's event, and whether the host reads what it
        copied (gradients, trainable weights) rather than only a later load of the block (the
        frozen weights of a block ``expose``d, which that load waits for itself)."""
        self.exposed: set[int] = set()
        """Blocks on the device while the user's code may write their weights (``expose``)."""
        self.unkept: list[tuple[Any, int]] = []
        """Slots on the device at a step's end with no host copy to keep a write (file-backed,
        SquareQ's quantized weights), with their parameter's version then
        (``refuse_lost_writes``)."""
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}
        """Trainable slot -> the host gradient it kept at its block's load, and that gradient's
        version then: the same tensor and version at eviction is an unchanged gradient."""

    def keep_grads(self, block: Block) -> None:
        """At ``block``'s load: note each trainable slot's host gradient and its version."""
        for slot in block.trainable:
            grad = slot.param.grad
            if grad is not None:
                self.kept[id(slot)] = (grad, grad._version)

    def synchronize(self, frozen: bool = True) -> None:
        """Block the host until the D2H copies back to host masters finished: those the host
        reads (gradients, trainable weights), and with ``frozen`` every one (the user's code
        runs next and may read any host master). A frozen weight's copy back left pending is
        waited for by its block's next load (on the device from an image, else on the host)."""
        kept = []
        for event, host_reads in self.events:
            if host_reads or frozen:
                self.host_wait(event)
            else:
                kept.append((event, host_reads))
        self.events = kept

    def expose(self, blocks: list[Block], ready: Callable[[Block], None]) -> None:
        """A step ended and the user's code runs next: it may write weights (a state dict loaded
        back, an EMA or weight swap). Every module-backed block on the device is bound to its
        buffer (a PREFETCHING one is made ready with ``ready``: a write to its host masters
        would race the copy still reading them) and *exposed*: its next eviction copies every
        weight with a host master back (trainable ones as ``dirty``), so the write reaches
        every later step. Frozen blocks left on the device at a step's end pay one D2H copy
        each when evicted (``bytes``), synchronous where their masters are not page-locked
        (no image: ``host_cache_mb: 0``, a lock refused; ``pageable_copies``). A parameter with
        no host copy (file-backed, or a weight SquareQ holds in 8 bits) cannot keep a write: its
        version is noted, and ``refuse_lost_writes`` refuses a write made through it by name.
        """
        self.unkept = [
            (slot, slot.param._version)
            for block in blocks
            if block.state is BlockState.GPU_READY
            for slot in block.layout
            if slot.host is None
        ]
        for block in blocks:
            if block.on_device and any(s.host is not None for s in block.layout):
                if block.state is BlockState.PREFETCHING:
                    ready(block)
                if block.trainable:
                    block.dirty = True
                if any(s.host is not None and not s.trainable for s in block.layout):
                    self.exposed.add(block.index)

    def refuse_lost_writes(self) -> None:
        """At the next step's start: raise ``LostWriteError`` for a parameter ``expose`` noted
        that was written since (``load_state_dict``, an in-place op on it: its version moved; a
        write through ``.data`` bypasses the version and cannot be seen).

        Raises:
            LostWriteError: names the first such parameter and where its weights come from.
        """
        unkept, self.unkept = self.unkept, []
        for slot, version in unkept:
            if slot.param._version != version:
                kept_as = (
                    "streams read-only from its checkpoint file"
                    if slot.key is not None
                    else "is held on the host by SquareQ in 8 bits"
                )
                raise LostWriteError(
                    f"parameter {slot.qualname!r} was written between steps while its block was "
                    f"on the device, but it {kept_as}: the write would be lost when the block is "
                    "evicted. Write block weights before building the memory strategy, or close "
                    "it, write, and build it again (module-backed blocks without SquareQ, "
                    "file_backed: false, keep such writes)"
                )

    def issue(self, block: Block, host_grads: dict[int, torch.Tensor]) -> None:
        """Issue ``block``'s D2H copies (``TransferEngine.evict``) on the D2H stream;
        ``host_grads`` gets each trainable slot's host gradient."""
        everything = block.index in self.exposed
        self.exposed.discard(block.index)
        weights = [
            s
            for s in block.layout
            if s.host is not None and (everything or block.dirty and s.trainable)
        ]
        block.dirty = False
        grads = []
        for slot in block.trainable:
            grad, kept = slot.param.grad, self.kept.pop(id(slot), None)
            if grad is None:
                continue
            if kept is not None and kept[0] is grad and grad._version == kept[1]:
                host_grads[id(slot)] = grad  # the host gradient it kept, unchanged
            else:
                grads.append(slot)
        if not weights and not grads:
            return
        block.to(BlockState.EVICTING)
        stream = self.stream
        with stream.use():
            for slot in weights:
                stream.copy_(slot.host, slot.param.data)
                self.bytes += slot.nbytes
            for slot in grads:
                grad = slot.param.grad
                self.bytes += grad.nbytes
                # A fresh host gradient per copy, as autograd gives a fresh ``.grad`` after
                # ``zero_grad(set_to_none=True)``: one the user kept is never overwritten.
                # Pinned ones come from PyTorch's caching host allocator.
                host_grads[id(slot)] = host = host_like(grad, stream.non_blocking)
                stream.copy_(host, grad)
            block.d2h_event = stream.record()
            host_reads = bool(grads) or any(s.trainable for s in weights)
            self.events.append((block.d2h_event, host_reads))
        # Freed by ``evict``, yet read by the D2H copy until its event: not reusable before.
        pending = block.nbytes if weights else 0
        if stream.stream is not None:  # device gradients are real allocations
            pending += sum(s.param.grad.nbytes for s in grads)
        if weights:
            stream.hold(block.flat)
        for slot in grads:
            stream.hold(slot.param.grad)
        self.memory.release_after(block.d2h_event, pending)
        block.to(BlockState.HOST_STAGED)
