"""Checkpoints whose linear weights are already 8 bits: ``float8_e4m3fn`` weights, with or
without a scale (ComfyUI's fp8 FLUX files: ``<layer>.scale_weight``; other tools:
``<layer>.weight_scale``), one per tensor or one per output row.

With SquareQ on, such a weight is streamed as it is stored: its codes are copied into the image
unchanged (no upcast, no second rounding), with its scale broadcast to one fp32 per row (the
file's weight is ``codes * scale``, exactly what the image dequantizes to). Without SquareQ an
unscaled one is converted as it is read, as any other precision; a scaled one is refused
(converted without its scale its values would be wrong). Anything else 8-bit (``float8_e5m2``,
block-wise scales) is refused naming the key, its dtype and the scale's shape.
"""

from __future__ import annotations

from typing import Any

import torch

SCALE_SUFFIXES = ("scale_weight", "weight_scale")
"""Scale keys beside ``<layer>.weight`` (ComfyUI's, and the compressed-tensors/ModelOpt name)."""
EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)


class PrequantizedCheckpointError(ValueError):
    """A checkpoint's 8-bit weight cannot be streamed (names the key, dtype and what was expected)."""


def scale_key(source: Any, key: str) -> str | None:
    """The checkpoint key of ``key``'s scale (``<layer>.weight`` -> ``<layer>.scale_weight`` or
    ``<layer>.weight_scale``), or None when the file has none."""
    owner = key.rpartition(".")[0]
    for suffix in SCALE_SUFFIXES:
        candidate = f"{owner}.{suffix}" if owner else suffix
        if candidate in source.entries:
            return candidate
    return None


def is_prequantized(source: Any, key: str | None) -> bool:
    """Whether checkpoint tensor ``key`` is a float8_e4m3fn weight SquareQ streams as is."""
    return (
        key is not None and source is not None and source.entries[key].dtype == torch.float8_e4m3fn
    )


def check(source: Any, key: str, squareq_on: bool) -> None:
    """Refuse a weight that cannot be streamed (see the module docstring; ``check_weight``).

    Raises:
        PrequantizedCheckpointError: names the key, its dtype, the scale found and the fix.
    """
    entry = source.entries[key]
    if entry.dtype not in EIGHT_BIT:
        return
    scale = scale_key(source, key)
    check_weight(
        f"checkpoint tensor {key!r} in {entry.path.name}",
        entry.dtype,
        tuple(entry.shape),
        scale,
        None if scale is None else tuple(source.entries[scale].shape),
        squareq_on,
    )


def check_weight(
    where: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    scale: str | None,
    scale_shape: tuple[int, ...] | None,
    squareq_on: bool,
) -> None:
    """Refuse an 8-bit weight (``dtype`` in ``EIGHT_BIT``) that cannot be read as stored: not a
    2-D float8_e4m3fn weight, a scale (key ``scale``, ``scale_shape``) neither per tensor (one
    element, 0-d included) nor per output row, or a scaled one with SquareQ off. ``where``
    names the tensor (``"checkpoint tensor 'k' in file"``).

    Raises:
        PrequantizedCheckpointError: names the key, its dtype, the scale found and the fix.
    """
    found = f"{where} is {dtype} {shape}"
    if scale is not None:
        found += f" with scale {scale!r} of shape {scale_shape}"
    if dtype != torch.float8_e4m3fn or len(shape) != 2:
        raise PrequantizedCheckpointError(
            f"{found}: only 2-D float8_e4m3fn weights (a scale per tensor or per row) are read "
            "as stored; convert this file to bf16 or float8_e4m3fn first"
        )
    if scale is not None:
        numel = 1
        for size in scale_shape:
            numel *= size
        if numel not in (1, shape[0]):
            raise PrequantizedCheckpointError(
                f"{found}: expected one scale per tensor or one per output row ({shape[0]}); "
                "block-wise scales are not read"
            )
        if not squareq_on:
            raise PrequantizedCheckpointError(
                f"{found}: a scaled fp8 weight is streamed as stored only with "
                'memory.stagehand.squareq: {"format": "fp8_e4m3"} and file_backed streaming (read '
                "without its scale its values would be wrong)"
            )


def row_scales(scale: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``(rows,)`` fp32: a weight's scale (one element, 0-d included, or one per row; None: 1)
    given to each of its ``rows`` output rows."""
    if scale is None:
        return torch.ones(rows, dtype=torch.float32)
    value = scale.to(torch.float32).reshape(-1)
    return value.expand(rows).contiguous() if value.numel() == 1 else value.contiguous()


def load_packed_parts(source: Any, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes (rows, cols) float8_e4m3fn as stored, scales (rows,) fp32)`` of a prequantized
    weight: its scale broadcast to the rows, 1 when the file has none."""
    codes = source.load(key)
    scale = scale_key(source, key)
    return codes, row_scales(None if scale is None else source.load(scale), codes.shape[0])
