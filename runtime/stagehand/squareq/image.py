"""A block's 8-bit image: the bytes SquareQ stages, caches and copies in place of its buffer.

The weight runtime lays each block out in one buffer of the compute dtype (its *layout*, views
bound to the parameters). With SquareQ, what the host cache holds, what the file-backed path
reads and what the H2D copy carries is the block's *image*: each quantized weight as
``[fp32 scales (out) | pad | codes (out x in)]``, every other parameter (biases, norms, LoRA
adapters, weights left unquantized) as it is, each entry at a ``IMAGE_ALIGN`` offset. After the
copy lands, ``BlockImage.stage`` dequantizes the image into the block's buffer on the copy's
stream (NOTE [ Dequant staging ]); the parameters then bind to that buffer as without SquareQ.

``ImageSlot`` answers the transfer engine's questions about a staged entry (``key``,
``offset``, ``nbytes``, ``dtype``, ``shape``, ``host``) as the block layout's slots do, so the
read plan, the slabs and the host cache work on images unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stagehand.common.device import device_empty, slot_views
from stagehand.squareq.formats import cpu_scratch, dequantize, dequantize_into, storage_dtype

IMAGE_ALIGN = 16
"""Byte alignment of an image entry: an fp32 scale view needs 4, a vectorised copy likes 16.
The image is a staging container (never a GEMM operand), so the block layout's 512 is not
needed, and at small widths it would weigh more than the codes."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // IMAGE_ALIGN) * IMAGE_ALIGN


def packed_bytes(rows: int, cols: int) -> int:
    """Bytes of one quantized weight ``(rows, cols)`` in an image: scales, pad, codes."""
    return _aligned(4 * rows) + rows * cols


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes`` ``(rows, cols)`` and ``scales`` ``(rows,)`` fp32 as one uint8 tensor of
    ``packed_bytes(rows, cols)``: the entry as it lies in an image (and in SquareQ's cache)."""
    rows, cols = codes.shape
    out = torch.zeros(packed_bytes(rows, cols), dtype=torch.uint8)
    out[: 4 * rows].view(torch.float32).copy_(scales)
    out[_aligned(4 * rows) :].view(codes.dtype).view(rows, cols).copy_(codes)
    return out


def unpack(
    entry: torch.Tensor, rows: int, cols: int, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(codes (rows, cols), scales (rows,))`` of a packed entry (uint8, any device)."""
    scales = entry[: 4 * rows].view(torch.float32)
    start = _aligned(4 * rows)
    codes = entry[start : start + rows * cols].view(storage_dtype(fmt)).view(rows, cols)
    return codes, scales


@dataclass(frozen=True)
class EntryView:
    """A typed view inside an image entry, as ``slot_views`` reads it: a quantized entry's
    scales (fp32 ``(rows,)``) or codes (``(rows, cols)``). ``offset`` in bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(eq=False)
class ImageSlot:
    """One entry of a block image, filling ``target`` (a block layout slot: ``ParamSlot``).

    Quantized: ``dtype`` uint8, ``shape`` ``(nbytes,)``, its packed bytes from ``key`` (in
    SquareQ's cache) or ``packed`` (module-backed). Passthrough: ``target``'s dtype and shape,
    from ``key`` or ``target.host``.
    """

    target: Any
    offset: int
    nbytes: int
    quantized: bool
    key: str | None = None
    packed: torch.Tensor | None = None
    fmt: str = "int8"
    """Format of its codes: the run's, or ``fp8_e4m3`` for a weight stored so in the checkpoint
    (``prequantized.py``)."""

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def qualname(self) -> str:
        return self.target.qualname

    @property
    def trainable(self) -> bool:
        return self.target.trainable

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.target.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.nbytes,) if self.quantized else self.target.shape

    @property
    def stride(self) -> tuple[int, ...]:
        return (1,) if self.quantized else self.target.stride

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else self.target.itemsize

    @property
    def param(self) -> Any:
        """The parameter a host image view may be bound to: None for a quantized entry (its
        parameter only ever holds the dequantized weight)."""
        return None if self.quantized else self.target.param

    @property
    def host(self) -> torch.Tensor | None:
        return self.packed if self.quantized else self.target.host

    @host.setter
    def host(self, value: torch.Tensor) -> None:
        if self.quantized:
            self.packed = value
        else:
            self.target.host = value


@dataclass(eq=False)
class BlockImage:
    """A block's image (see the module docstring): ``slots`` in image order, ``nbytes`` bytes."""

    fmt: str
    slots: list[ImageSlot] = field(default_factory=list)
    nbytes: int = 0
    dequantized_bytes: int = 0
    """Compute-dtype bytes one ``stage`` writes by dequantization (its quantized weights)."""
    timer: Any = None
    """``DequantTimer`` (``stagehand.squareq.runtime``) that times each ``stage``."""
    widest: tuple[int, int] = (0, 0)
    """``(rows, cols)`` whose ``cpu_scratch`` serves every quantized weight of the block."""
    views: list[Any] = field(default_factory=list)
    """What ``dequantize`` reads, in slot order: a passthrough slot itself, a quantized one's
    scales and codes (``EntryView``s)."""

    def add(
        self, target: Any, quantized: bool, key: str | None = None, fmt: str | None = None
    ) -> ImageSlot:
        rows, cols = target.shape if quantized else (0, 0)
        nbytes = packed_bytes(rows, cols) if quantized else target.nbytes
        slot = ImageSlot(target, self.nbytes, nbytes, quantized, key, fmt=fmt or self.fmt)
        self.slots.append(slot)
        if quantized:  # the layout of ``pack``/``unpack``
            codes = self.nbytes + _aligned(4 * rows)
            dtype = storage_dtype(slot.fmt)
            self.views.append(EntryView(torch.float32, (rows,), (1,), self.nbytes))
            self.views.append(EntryView(dtype, (rows, cols), (cols, 1), codes))
        else:
            self.views.append(slot)
        self.nbytes += _aligned(nbytes)
        if quantized:
            self.dequantized_bytes += target.nbytes
            # One scratch for all: as many rows as the largest weight, as wide as the widest.
            self.widest = (max(self.widest[0], rows), max(self.widest[1], cols))
        return slot

    def dequantize(self, image: torch.Tensor, flat: torch.Tensor) -> None:
        """Fill the block buffer ``flat`` (uint8, the block's ``nbytes``) from ``image`` (uint8,
        ``nbytes``, same device): quantized weights dequantized into the compute dtype, the rest
        copied. On CUDA the kernels go to the current stream; on the CPU one fp32 scratch
        serves the block's weights (NOTE [ CPU dequantization ] in ``formats``)."""
        scratch = cpu_scratch(*self.widest) if flat.device.type == "cpu" else None
        sources = iter(slot_views(image, self.views))
        targets = slot_views(flat, [s.target for s in self.slots])
        for slot, dst in zip(self.slots, targets, strict=True):
            if slot.quantized:
                scales = next(sources)
                dequantize_into(dst, next(sources), scales, scratch)
            else:
                dst.copy_(next(sources))

    def stage(self, stream: Any, host: torch.Tensor, flat: torch.Tensor) -> None:
        """The block's H2D copy with SquareQ (inside ``stream.use()``): copy the image ``host``
        to a device staging buffer, then dequantize it into ``flat`` on the same stream
        (NOTE [ Dequant staging ]). ``stream``: the transfer engine's ``TransferStream``."""
        device_image = device_empty(self.nbytes, flat.device)
        stream.copy_(device_image, host)
        if self.timer is None:
            stream.launch(self.dequantize, device_image, flat)
        else:
            self.timer.launch(stream, self, device_image, flat)

    def restore(self, source: Any, device: torch.device) -> None:
        """Each target parameter becomes an ordinary tensor on ``device`` holding what a load
        binds (the dequantized weight, the passthrough value): read from ``source`` (SquareQ's
        cache checkpoint) or the host entries. The runtime's ``close(restore=True)``."""
        for slot in self.slots:
            t = slot.target
            if slot.key is not None:
                data = source.load(slot.key)
            elif slot.quantized:
                data = slot.packed
            else:
                data = t.host
            if slot.quantized:
                codes, scales = unpack(data, t.shape[0], t.shape[1], slot.fmt)
                data = dequantize(codes, scales, t.dtype)
            t.param.data = data.to(device, copy=data is t.host)


# NOTE [ Dequant staging ]
# The image's copy and its dequantization are queued on the transfer stream one after the
# other, and the load's event is recorded after both: the compute stream's wait on that event
# (``TransferEngine.ready``) orders the block's first use after the dequantization, and nothing
# waits on the host. The device staging buffer is allocated on the transfer stream (inside
# ``use()``), so the caching allocator hands its memory to later work on that stream only after
# the kernels queued on it: dropping the Python reference right after queueing is safe. Its
# bytes are transient (one image per copy in flight); the block buffer is the compute-dtype
# layout as without SquareQ, so everything downstream (views, evictions, watermarks) is
# unchanged. The dequantization is elementwise (``formats.dequantize_into``): the same bits on
# the device as on the host, so a streamed run equals the model holding the dequantized
# weights resident.
