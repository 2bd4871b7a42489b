"""What autograd sees of the blocks: where each use begins and ends (``BlockBoundaries``), and
saved views of block weights (``SavedViews``, ``WeightView``).

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

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from stagehand.common.nested import flatten, graph_task_id, in_backward
from stagehand.common.phases import Phase, PhaseMachine
from stagehand.weights.registry import Block, ParamSlot

_BACKWARD = Phase.BACKWARD  # read at every block use: an enum attribute costs ~50 ns


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


class BlockBoundaries:
    """Where each use of each block begins and ends: the blocks' forward pre- and post-hooks,
    and ``_BackwardBegin`` on their outputs (NOTE [ Backward block boundaries ]).

    ``WeightRuntime`` installs it and is told, in order: ``forward_started(index)`` before a
    block's forward use (its step boundaries), ``backward_started()`` when a block's backward
    begins outside BACKWARD, ``use(block, direction)`` when a use begins (``"forward"``,
    ``"backward"`` or ``"recompute"``) and ``done(block, direction)`` when it ended
    (``"forward"`` or ``"backward"``). ``active`` is the runtime's set of blocks in use (``use``
    adds, ``done`` removes); ``phases`` its phase machine; ``training``: outputs are wrapped for
    backward (while gradients are on).
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        active: set[int],
        phases: PhaseMachine,
        *,
        training: bool,
        forward_started: Callable[[int], None],
        backward_started: Callable[[], None],
        use: Callable[[Block, str], None],
        done: Callable[[Block, str], None],
    ) -> None:
        self.blocks, self.active, self.phases, self.training = blocks, active, phases, training
        self.forward_started, self.backward_started = forward_started, backward_started
        self.use, self.done = use, done
        self.began: dict[int, int] = {}  # block index -> graph task its backward began in
        self.handles = []
        for block in blocks:
            self.handles.append(
                block.module.register_forward_pre_hook(
                    partial(self._pre_hook, block), with_kwargs=True
                )
            )
            self.handles.append(
                block.module.register_forward_hook(
                    partial(self._post_hook, block), with_kwargs=True
                )
            )

    def _pre_hook(self, block: Block, module: Any, args: tuple, kwargs: dict) -> None:
        if in_backward():
            self._end_nested(block)
            self.use(block, "recompute")
        else:
            self.forward_started(block.index)
            self.use(block, "forward")

    def _post_hook(self, block: Block, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if not in_backward():
            self.began.pop(block.index, None)
            self.done(block, "forward")
        if not self.training or not torch.is_grad_enabled():
            return None
        # In a recomputation too: a reentrant checkpoint's nested backward starts at these
        # outputs (NOTE [ Backward block boundaries ]); a non-reentrant one never runs them.
        return wrap_outputs(output, partial(self._backward_begin, block))

    def _backward_begin(self, block: Block) -> None:
        # The begin of one block's backward is the end of every other block's (see the NOTE).
        if self.phases.phase is not _BACKWARD:
            self.backward_started()
        self._end_others(block)
        self.began[block.index] = graph_task_id()
        self.use(block, "backward")

    def _end_nested(self, block: Block) -> None:
        # A reentrant checkpoint's recomputation runs in the outer backward, after the nested
        # backward of the block before it returned: a block whose backward began in another
        # graph task is done (see the NOTE). A non-reentrant one shares the outer graph task.
        task = graph_task_id()
        self._end_others(block, lambda index: self.began.get(index) not in (None, task))

    def _end_others(self, block: Block, ended: Callable[[int], bool] | None = None) -> None:
        """End the backward of every active block other than ``block`` (those ``ended`` says)."""
        for index in sorted(self.active - {block.index}, reverse=True):
            if ended is None or ended(index):
                self._backward_end(self.blocks[index])

    def _backward_end(self, block: Block) -> None:
        self.began.pop(block.index, None)
        backward = self.phases.phase is _BACKWARD or in_backward()
        self.done(block, "backward" if backward else "forward")

    def finish(self) -> None:
        """End every use still open: the last block of backward (no next begin ends it), or
        blocks an error left in use."""
        for index in sorted(self.active, reverse=True):
            self._backward_end(self.blocks[index])

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


class SavedViews:
    """The loaded blocks by buffer and parameter address, for the packer (NOTE [ Saved weight
    views ]): ``add`` once a block is ready, ``discard`` before it is evicted. ``ensure(block)``
    loads a block again (a view of an evicted block unpacked in backward)."""

    def __init__(self, ensure: Callable[[Block], None]) -> None:
        self.ensure = ensure
        self.by_storage: dict[int, Block] = {}
        self.by_ptr: dict[int, ParamSlot] = {}
        self.frozen = False
        """No block holds a trainable parameter (LoRA kept resident): then a saved tensor that
        requires grad is not a view of a block weight (a view of a frozen parameter never
        requires grad), and ``pack`` answers without a storage lookup (~0.15 us per activation
        on the KEEP path)."""

    def add(self, block: Block) -> None:
        self.by_storage[block.flat.untyped_storage().data_ptr()] = block
        for slot in block.layout:
            self.by_ptr[slot.param.data_ptr()] = slot

    def discard(self, block: Block) -> None:
        if block.flat is not None:
            self.by_storage.pop(block.flat.untyped_storage().data_ptr(), None)
        for slot in block.layout:
            self.by_ptr.pop(slot.param.data_ptr(), None)

    def pack(self, tensor: torch.Tensor) -> WeightView | None:
        """``SavedTensorRouter`` packer: a handle for views of loaded block weights, else None.
        O(1): two dict lookups."""
        if self.frozen and tensor.requires_grad:
            return None
        block = self.by_storage.get(tensor.untyped_storage().data_ptr())
        if block is None or tensor.device != block.flat.device:
            return None
        slot = self.by_ptr.get(tensor.data_ptr())
        if slot is None:
            byte = tensor.data_ptr() - block.flat.data_ptr()
            slot = next(s for s in block.layout if s.offset <= byte < s.offset + max(s.nbytes, 1))
        return WeightView(partial(self.ensure, block), slot, tensor)

    def clear(self) -> None:
        self.by_storage.clear()
        self.by_ptr.clear()
