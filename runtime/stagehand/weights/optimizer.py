"""Trainable block parameters on the compute device for ``optimizer.step()`` (seed bug 6).

Between steps a trainable (module-backed) block parameter, its gradient and its optimizer state
live on the host (evicted with its block after backward). ``optimizer.step()`` must find
parameters, gradients and state on one device, so this context brings every evicted trainable
parameter and its gradient to the compute device (counted in ``DeviceMemory``, category
``"weights"``), moves the optimizer state there, and after the step copies the updated values
back into the host masters and the state back to the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from stagehand.common.device import host_like, on_device, on_host, to_device, uses_cuda
from stagehand.common.memory import DeviceMemory
from stagehand.weights.errors import FrozenParameterError
from stagehand.weights.registry import Block, BlockState, ParamSlot


def _move_state(
    optimizer: Any, slots: list[ParamSlot], compute: torch.device, to_host: bool, non_blocking: bool
) -> None:
    """Every optimizer state tensor of ``slots`` to the ``compute`` device (H2D from the pinned
    host copies made below), or back to the host when ``to_host`` (D2H into fresh pinned host
    tensors; ``non_blocking``: the caller waits)."""
    if optimizer is None:
        return
    for slot in slots:
        state = optimizer.state.get(slot.param)
        for name, value in (state or {}).items():
            # 0-d tensors (Adam's ``step``) stay where the optimizer keeps them.
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if to_host and not on_host(value):
                host = host_like(value, non_blocking)
                host.copy_(value, non_blocking=non_blocking)
                state[name] = host
            elif not to_host and not on_device(value, compute):
                state[name] = to_device(value, compute, non_blocking)


def refuse_unfrozen(frozen: list[ParamSlot]) -> None:
    """Raise ``FrozenParameterError`` for a block parameter frozen at set-up (``frozen``) that
    requires grad now: it has no host master to update (file-backed) or none kept in step with
    its device copy (its gradient is not copied back, its update is lost at eviction)."""
    for slot in frozen:
        if slot.param.requires_grad:
            source = "its checkpoint file" if slot.file_backed else "host memory"
            raise FrozenParameterError(
                f"parameter {slot.qualname!r} was frozen when the memory strategy was built and "
                f"requires grad now: it streams read-only from {source}, so it cannot be "
                "trained (unfreezing mid-run); set requires_grad before build_strategy, or close "
                "the strategy and build it again after unfreezing"
            )


@contextlib.contextmanager
def trainable_on_device(
    blocks: list[Block], device: torch.device, memory: DeviceMemory, optimizer: Any | None
) -> Iterator[None]:
    """See the module docstring. Host masters must be complete (D2H copies waited on).

    On CUDA every copy is asynchronous on the current stream (host masters, gradients and state
    are pinned), so ``optimizer.step()`` queues behind the H2D copies without a host wait; on
    exit the D2H copies back are waited on once (one host sync per step), since the host masters
    may be read next (a saved LoRA file, the next step's loads)."""
    non_blocking = uses_cuda(device)
    moved: list[ParamSlot] = []
    trainable = [s for b in blocks for s in b.layout if s.trainable]
    try:  # an out-of-memory error while moving puts back what moved (the step is retried)
        for block in blocks:
            if block.state is BlockState.GPU_READY:
                # Already on the device, as views of the block buffer: the step updates them
                # there, so they are copied back at the block's eviction.
                block.dirty = bool(block.trainable)
                continue
            for slot in block.layout:
                if slot.trainable:
                    memory.track(slot.nbytes, "weights")  # an emulated card raises here
                    moved.append(slot)
                    slot.param.data = to_device(slot.host, device, non_blocking)
                    if slot.param.grad is not None:
                        slot.param.grad = to_device(slot.param.grad, device, non_blocking)
        # State follows every trainable block parameter (also those whose block is loaded).
        _move_state(optimizer, trainable, device, False, non_blocking)
        yield
    finally:
        for slot in moved:
            slot.host.copy_(slot.param.data, non_blocking=non_blocking)
            slot.param.data = slot.host
            grad = slot.param.grad
            if grad is not None:
                host = host_like(grad, non_blocking)
                host.copy_(grad, non_blocking=non_blocking)
                slot.param.grad = host
            memory.untrack(slot.nbytes, "weights")
        _move_state(optimizer, trainable, device, True, non_blocking)
        if non_blocking:
            # The device tensors just dropped are freed in stream order (the copies were queued
            # on the same stream before them); the host reads the copies' results after this.
            torch.cuda.current_stream(device).synchronize()
