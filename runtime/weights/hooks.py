"""Autograd plumbing that lets forward hooks see backward, and the saved-weight-view handle.

# NOTE [ Backward block boundaries ]
Forward hooks alone do not see backward. As in DeepSpeed ZeRO-3, the forward hook passes a
block's outputs through ``_BackwardBegin`` (an identity whose backward runs once every output
gradient arrived, i.e. *before* the block's own backward: ensure the block is loaded, prefetch
the next blocks in backward order), and the forward pre-hook passes its inputs (positional and
keyword: diffusers blocks take ``encoder_hidden_states``, ``temb``, ``image_rotary_emb`` as
kwargs and return tuples) through ``_BackwardEnd`` (runs *after* the block's backward: the block
is done and may be evicted). When no input requires grad (block 0 of a LoRA model), the first
floating input is routed through ``_BackwardEnd`` together with a 0-d leaf that requires grad, so
the boundary still fires; gradients of parameters are unchanged by it.

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


class _BackwardBegin(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class _BackwardEnd(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[], None], anchor: torch.Tensor | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, None, *grads)


def _leaves(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _leaves(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _leaves(item, out)


def _replace(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return mapping.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_replace(item, mapping) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_replace(item, mapping) for item in obj)
    if isinstance(obj, dict):
        replaced = {k: _replace(v, mapping) for k, v in obj.items()}
        try:
            return type(obj)(**replaced) if type(obj) is not dict else replaced
        except TypeError:
            return replaced
    return obj


def wrap_outputs(output: Any, callback: Callable[[], None]) -> Any:
    """``output`` with its grad-requiring tensors routed through ``_BackwardBegin``."""
    leaves: list[torch.Tensor] = []
    _leaves(output, leaves)
    tensors = [t for t in leaves if t.requires_grad]
    if not tensors:
        return output
    new = _BackwardBegin.apply(callback, *tensors)
    return _replace(output, {id(t): n for t, n in zip(tensors, new, strict=True)})


def wrap_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    callback: Callable[[], None],
    anchor: torch.Tensor,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with grad-requiring tensors routed through ``_BackwardEnd``; see the
    NOTE for the anchor used when none requires grad."""
    leaves: list[torch.Tensor] = []
    _leaves((args, kwargs), leaves)
    tensors = [t for t in leaves if t.requires_grad]
    use_anchor = None
    if not tensors:
        floats = [t for t in leaves if t.is_floating_point()]
        if not floats:
            return args, kwargs
        tensors, use_anchor = floats[:1], anchor
    new = _BackwardEnd.apply(callback, use_anchor, *tensors)
    mapping = {id(t): n for t, n in zip(tensors, new, strict=True)}
    return _replace(args, mapping), _replace(kwargs, mapping)


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
