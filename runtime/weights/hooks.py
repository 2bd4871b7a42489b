"""Autograd plumbing that lets forward hooks see backward, and the saved-weight-view handle.

# NOTE [ Backward block boundaries ]
Forward hooks alone do not see backward. As in DeepSpeed ZeRO-3, the forward hook passes a
block's outputs through ``_BackwardBegin``: an identity whose backward runs once every output
gradient arrived, i.e. *before* the block's own backward (load the block, prefetch the next ones
in backward order). The end of a block's backward is the begin of the next block's (or the end
of the backward phase): autograd runs ready nodes newest first, and every node of block k was
created after block k-1's ``_BackwardBegin``, so block k's backward has finished when block
k-1's begins. Under reentrant checkpointing the block's outputs are wrapped again in the
recomputation, whose nested backward (a graph task of its own) starts there; the next block's
recomputation runs in the outer graph task once that nested backward returned, so it ends
every block whose backward began in another graph task. In a non-reentrant checkpoint the
recomputation shares the outer graph task and its wrapped outputs are never run.

Nothing is put on the block's *inputs*, on purpose: an identity there changes the numbers. A
tensor given to several blocks and used more than once in each (the text context of
cross-attention ``k``/``v``, a timestep embedding) would have its gradient summed per block
first, then across blocks, where the plain model sums every contribution in arrival order:
floating-point addition is not associative, and the producer's gradient differs in the last bit.

``_BackwardBegin`` does not materialise gradients: an output the loss does not use (the last
text-stream output of a dual-stream block) passes None on, as in the plain model. A zero there
would give the parameters feeding only that output a ``.grad`` of zeros instead of None, which
AdamW decays and keeps state for, and run the dead branch's backward for nothing.

# NOTE [ Saved weight views ]
Autograd saves views of weights (``weight.t()`` in ``F.linear``). Kept as is, such a view would
keep an evicted block's storage alive until backward: memory is not freed and the figures lie.
The runtime's packer (first in the ``SavedTensorRouter``) replaces a tensor whose storage is a
loaded block buffer with a ``WeightView`` handle; ``unpack`` makes sure the block is loaded
again and rebuilds the same view (size, stride, offset) over the parameter's current storage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.common.nested import flatten


class _BackwardBegin(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)  # None stays None: see the NOTE
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if any(g is not None for g in grads):  # else the block has no backward to run
            ctx.callback()
        return (None, *grads)


def wrap_outputs(output: Any, callback: Callable[[], None]) -> Any:
    """``output`` with its grad-requiring tensors routed through ``_BackwardBegin``."""
    leaves: list[torch.Tensor] = []
    rebuild = flatten(output, leaves)
    tensors = [t for t in leaves if t.requires_grad]
    if not tensors:
        return output
    new = _BackwardBegin.apply(callback, *tensors)
    routed = {id(t): n for t, n in zip(tensors, new, strict=True)}
    return rebuild([routed.get(id(t), t) for t in leaves])


class WeightView:
    """A saved view of a block parameter: ``unpack`` re-loads the block if needed and returns the
    same view of the parameter's current storage (``save_on_cpu``'s contract: equal value, size,
    stride, dtype and device)."""

    __slots__ = ("_ensure", "_slot", "_size", "_stride", "_offset")

    def __init__(self, ensure: Callable[[], None], slot: Any, tensor: torch.Tensor) -> None:
        self._ensure = ensure
        self._slot = slot
        self._size = tensor.size()
        self._stride = tensor.stride()
        self._offset = tensor.storage_offset() - slot.param.data.storage_offset()

    def unpack(self) -> torch.Tensor:
        self._ensure()
        data = self._slot.param.data
        return data.as_strided(self._size, self._stride, data.storage_offset() + self._offset)
