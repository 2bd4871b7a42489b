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

from runtime.common.memory import DeviceMemory
from runtime.weights.registry import Block, BlockState, ParamSlot


def _move_state(optimizer: Any, slots: list[ParamSlot], device: torch.device) -> None:
    if optimizer is None:
        return
    for slot in slots:
        state = optimizer.state.get(slot.param)
        for name, value in (state or {}).items():
            # 0-d tensors (Adam's ``step``) stay where the optimizer keeps them.
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                state[name] = value.to(device)


@contextlib.contextmanager
def trainable_on_device(
    blocks: list[Block], device: torch.device, memory: DeviceMemory, optimizer: Any | None
) -> Iterator[None]:
    """See the module docstring. Host masters must be complete (D2H copies waited on)."""
    moved: list[ParamSlot] = []
    for block in blocks:
        if block.state is BlockState.GPU_READY:
            continue  # already on the device, as views of the block buffer
        for slot in block.layout:
            if slot.trainable:
                slot.param.data = slot.host.to(device, copy=True)
                if slot.param.grad is not None:
                    slot.param.grad = slot.param.grad.to(device, copy=True)
                memory.track(slot.nbytes, "weights")
                moved.append(slot)
    # State follows every trainable block parameter (also those whose block is loaded).
    trainable = [s for b in blocks for s in b.layout if s.trainable]
    _move_state(optimizer, trainable, device)
    try:
        yield
    finally:
        for slot in moved:
            slot.host.copy_(slot.param.data)
            slot.param.data = slot.host
            grad = slot.param.grad
            if grad is not None:
                if slot.host_grad is None or slot.host_grad.shape != grad.shape:
                    slot.host_grad = torch.empty_like(slot.host)
                slot.host_grad.copy_(grad)
                slot.param.grad = slot.host_grad
            memory.untrack(slot.nbytes, "weights")
        _move_state(optimizer, trainable, torch.device("cpu"))
