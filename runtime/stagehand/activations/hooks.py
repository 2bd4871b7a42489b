"""What autograd holds for a managed saved tensor, and the layout of a spilled view.

# NOTE [ Spilled view layout ]
The contract of ``saved_tensors_hooks`` (``torch/autograd/graph.py``) is that ``unpack(pack(t))``
equals ``t`` in value, size, stride, dtype and device. Strides matter beyond the contract: a
backward kernel given a transposed operand may round differently from one given a contiguous
copy, and our tests demand bitwise-equal gradients.

A spilled tensor is therefore copied as the *storage span its view covers*: the elements from
its storage offset to its last addressable element, ``span = 1 + sum((size_i - 1) * stride_i)``
(strides are never negative in PyTorch). The span is copied as one contiguous 1-D run, byte for
byte, and restored into a fresh device tensor of ``span`` elements that is viewed back with
``as_strided(size, stride)``. Consequences:

- a contiguous tensor, a transpose or any permutation of a dense tensor copies exactly its
  own bytes (span = numel);
- a broadcast (``expand``, stride 0) copies only the data it repeats (span < numel);
- a strided slice copies the gaps between its elements too (span > numel); the alternative,
  a compact copy, would come back either with other strides or needing the span on the device
  anyway at restore;
- only the storage offset differs after restore (0), which autograd does not depend on.
The base tensor the view came from is never copied.

# NOTE [ Tracking kept tensors ]
On CUDA the allocator sees every kept tensor, so the KEEP path returns ``None`` (the router saves
the tensor as is: near-zero cost). On CPU there is no device memory to read, so kept saved
tensors are counted in the shared ``DeviceMemory`` as tracked bytes (category ``activations``):

- once per *data pointer* (the input of a LoRA layer is saved by the base layer and by
  ``lora_A``: counted once), with the bytes of the first view saved there (``tensor.nbytes``;
  reading the storage itself costs about 0.5 us more per tensor);
- never for the model's parameters and buffers or views of them (found by identity of the
  tensor or of its ``_base``: weights are not activations);
- uncounted when the last ``KeptTensor`` of that pointer is freed by autograd (its ``__del__``
  runs when autograd releases the saved variable after the node's backward) or at step end,
  whichever comes first; a weakref finalizer on the tensor would be wrong, since the tensor
  usually outlives its saved variable (it is the next layer's input);
- reported to ``DeviceMemory`` in batches (``runtime.PUBLISH_BYTES``), a lock per tensor being
  a third of the KEEP path's cost.

The wrapper costs one small Python object per kept tensor, only where memory is tracked;
``bench.py`` prints the KEEP path's cost per tensor with and without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from stagehand.common.saved_tensors import SavedTensorRouter

if TYPE_CHECKING:
    from stagehand.activations.registry import ActivationRecord
    from stagehand.activations.runtime import ActivationRuntime
    from stagehand.activations.spill import SpillTable


def span_elements(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a view of ``size``/``stride`` covers from its offset (0 if empty)."""
    span = 1
    for n, s in zip(size, stride, strict=True):
        if n == 0:
            return 0
        span += (n - 1) * s
    return span


def span_bytes_view(tensor: torch.Tensor, span: int) -> torch.Tensor:
    """The ``span`` elements from ``tensor``'s storage offset, as a contiguous uint8 1-D view
    (no copy; detached so copying it records no autograd graph)."""
    flat = tensor.detach().as_strided((span,), (1,), tensor.storage_offset())
    return flat.view(torch.uint8)


def rebuild(span_u8: torch.Tensor, record: ActivationRecord) -> torch.Tensor:
    """The saved tensor from its restored span (uint8, ``record.nbytes`` long)."""
    return span_u8.view(record.dtype).as_strided(record.size, record.stride, 0)


class SpilledTensor:
    """What autograd holds for a spilled tensor: the record and the ``SpillTable`` that owns it.

    ``unpack`` returns the restored tensor (restoring on demand when no prefetch got there
    first). Freed by autograd once the node's backward ran: the record is released and its
    memory returned.
    """

    __slots__ = ("record", "table")

    def __init__(self, record: ActivationRecord, table: SpillTable) -> None:
        self.record = record
        self.table = table

    def unpack(self) -> torch.Tensor:
        return self.table.unpack(self.record)

    def __del__(self) -> None:
        table = self.table
        if table is not None:
            table.release(self.record)

    def __repr__(self) -> str:
        return f"SpilledTensor({self.record!r})"


class KeptTensor(list):
    """A kept saved tensor whose storage is counted in tracked device memory (CPU only; see
    NOTE [ Tracking kept tensors ]): ``[tensor, entry, runtime]``, ``entry`` being the storage's
    ``[saved refs, bytes, data_ptr]`` in ``runtime._live``.

    A list, built from one tuple in C: the KEEP path makes one per kept tensor, and a Python
    ``__init__`` setting four slots cost ~0.15 us more (see ``bench.py``).
    """

    __slots__ = ()

    def unpack(self) -> torch.Tensor:
        return self[0]

    def __del__(self) -> None:
        entry = self[1]
        entry[0] -= 1
        if entry[0] == 0:  # 0 only from 1: ``end_step`` zeroes the entries it uncounts
            self[2]._release_kept(entry)


@contextlib.contextmanager
def managed_forward(runtime: ActivationRuntime, install_hooks: bool = True) -> Iterator[None]:
    """The seed's hook context: with ``install_hooks`` a ``SavedTensorRouter`` with only this
    runtime's packer wraps the block (standalone use); without it the caller's router (a
    composed strategy's, weight packer first) already routes to ``runtime.packer``."""
    if not install_hooks:
        yield
        return
    with SavedTensorRouter([runtime.packer]).hooks():
        yield
