"""SquareQ's 8-bit formats: quantize a linear weight row by row, dequantize it into the compute
dtype, and measure the error.

Both formats keep one fp32 scale per output row (a weight of shape ``(out, in)`` has ``out``
scales) and are symmetric (no zero point):

- ``int8``: ``q = clamp(round(w / s), -127, 127)`` with ``s = max|w_row| / 127`` (SquareQ's
  layout: a ``qweight`` int8 per layer and a per-row fp32 scale);
- ``fp8_e4m3``: ``q = float8_e4m3fn(clamp(w / s, -448, 448))`` with ``s = max|w_row| / 448``
  (musubi-tuner's ``fp8_scaled`` with per-channel scales, ComfyUI's ``scale_weight``: the weight
  is ``q.to(dtype) * scale``).

A row of zeros gets the scale 1 (its codes are 0). Quantization computes in fp32 from the weight
as the model holds it (its dtype), so it is deterministic; dequantization is one elementwise
``q * s`` in fp32 rounded once to the compute dtype, the same bits on any device and CPU
kernel path (no reduction, no GEMM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMATS: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
"""Format name -> storage dtype of the codes: one per name a config may give
(``stagehand.config.memory.SQUAREQ_FORMATS``; ``tests/runtime/squareq/test_squareq_formats.py`` holds
the two equal)."""
QMAX: dict[str, float] = {
    name: float((torch.finfo if dtype.is_floating_point else torch.iinfo)(dtype).max)
    for name, dtype in FORMATS.items()
}
"""Largest code magnitude: the storage dtype's largest value (int8: 127; float8_e4m3fn: 448)."""
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
"""The fp32 value of each float8_e4m3fn bit pattern (exact; the two NaN codes are NaN)."""


def storage_dtype(fmt: str) -> torch.dtype:
    """The codes' dtype of format ``fmt``.

    Raises:
        ValueError: an unknown format (names the ones known).
    """
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"squareq format must be one of {sorted(FORMATS)}, got {fmt!r}") from None


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (``(out, in)``, floating) as ``(codes, scales)``: codes ``(out, in)`` in the
    format's storage dtype, scales ``(out,)`` fp32, both on ``weight``'s device.

    Raises:
        ValueError: ``weight`` is not 2-D or not floating, or an unknown format.
    """
    dtype = storage_dtype(fmt)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"squareq quantizes 2-D floating weights, got shape {tuple(weight.shape)} {weight.dtype}"
        )
    w = weight.detach()
    qmax = QMAX[fmt]
    # max |w| of each row without a |w| temporary the size of the weight; exact in any dtype.
    low, high = torch.aminmax(w, dim=1)
    scale = torch.maximum(-low, high).to(torch.float32) / qmax  # (out,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x = w / scale[:, None]  # fp32 (promoted): float(w) / s, no fp32 copy of the weight first
    if fmt == "int8":
        codes = x.round_().clamp_(-qmax, qmax).to(dtype)
    else:
        codes = x.clamp_(-qmax, qmax).to(dtype)
    return codes, scale


CPU_CHUNK_ELEMENTS = 1 << 19
"""Elements of the CPU path's fp32 scratch (2 MiB, cache-resident): a weight is dequantized
that many elements (whole rows) at a time (NOTE [ CPU dequantization ])."""


def cpu_scratch(rows: int, cols: int) -> torch.Tensor:
    """The fp32 scratch ``dequantize_into`` uses on the CPU for weights up to ``(rows, cols)``:
    ``min(rows * cols, max(CPU_CHUNK_ELEMENTS, cols))`` elements (at least one row)."""
    return torch.empty(min(rows * cols, max(CPU_CHUNK_ELEMENTS, cols)), dtype=torch.float32)


def dequantize_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``codes * scales[:, None]`` (computed in fp32, rounded once) into ``out`` (``(out,
    in)``, the compute dtype) and return it. ``codes`` ``(out, in)`` int8 or float8_e4m3fn,
    contiguous, ``scales`` ``(out,)`` fp32, all on one device (on CUDA: on the current stream).
    ``scratch``: the CPU path's fp32 buffer (``cpu_scratch``; one is made when None or shorter
    than a row), reused across the weights of a block.

    On a GPU the codes are first copied into ``out``: exact in bf16, fp16 and fp32 (int8 needs
    7 significant bits, e4m3 3 and exponents 2^-9..2^8), so the product is ``float(q) * s`` in
    fp32 rounded once, with no fp32 temporary the size of the weight (torch promotes no float8
    operand). On the CPU, whose kernels convert bf16 and float8 element by element and cast
    mixed operands through temporaries, the same product is formed in an fp32 scratch of whole
    rows at a time (float8 codes through a 256-entry table of their exact values, int8 by a
    vectorised copy), multiplied in place and rounded into ``out``: the same bits, with no
    allocation the size of the weight (NOTE [ CPU dequantization ])."""
    if codes.device.type != "cpu":
        out.copy_(codes)
        return torch.mul(out, scales[:, None], out=out)
    rows, cols = codes.shape
    if scratch is None or scratch.numel() < cols:
        scratch = cpu_scratch(rows, cols)
    step = scratch.numel() // cols
    if step >= rows:  # one chunk (a small model's weights): no per-chunk views
        wide = _widen(codes, scratch[: rows * cols].view(rows, cols))
        return out.copy_(wide.mul_(scales[:, None]))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        wide = _widen(codes[start:stop], scratch[: (stop - start) * cols].view(stop - start, cols))
        out[start:stop].copy_(wide.mul_(scales[start:stop, None]))
    return out


def _widen(codes: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """``codes`` (2-D, contiguous) as their exact fp32 values in ``wide`` (same shape): int8 by
    a copy, float8 through the 256-entry table (an int32 index: 4 bytes per code, not 8)."""
    if codes.dtype == torch.float8_e4m3fn:
        index = codes.reshape(-1).view(torch.uint8).int()
        torch.index_select(_FP8_VALUES, 0, index, out=wide.view(-1))
        return wide
    return wide.copy_(codes)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh ``(out, in)`` tensor of ``dtype``: ``dequantize_into`` of a new buffer."""
    return dequantize_into(
        torch.empty(codes.shape, dtype=dtype, device=codes.device), codes, scales
    )


@dataclass(frozen=True)
class LayerError:
    """One quantized weight's error: ``rel_rms = ||w - deq(q(w))|| / ||w||`` (Frobenius)."""

    name: str
    shape: tuple[int, int]
    rel_rms: float


RMS_CHUNK_ELEMENTS = 1 << 22
"""Elements ``relative_rms`` takes at a time (16 MiB fp32 temporaries)."""


def relative_rms(weight: torch.Tensor, restored: torch.Tensor) -> float:
    """``||weight - restored|| / ||weight||`` (0 for a zero weight), ``RMS_CHUNK_ELEMENTS`` at a
    time: the difference in fp32 (exact for bf16 and fp16 weights, whose dequantized values lie
    within a few of their ulps), its squares summed in fp64. A third of the time of widening
    both to fp64 (a real-size FLUX.1-dev weight: ~0.3 s of CPU, was ~1 s), and bounded memory."""
    w, r = weight.detach().reshape(-1), restored.detach().reshape(-1)
    err = norm = 0.0
    for start in range(0, w.numel(), RMS_CHUNK_ELEMENTS):
        wc = w[start : start + RMS_CHUNK_ELEMENTS].float()
        diff = wc - r[start : start + RMS_CHUNK_ELEMENTS].float()
        norm += float(torch.linalg.vector_norm(wc, dtype=torch.float64)) ** 2
        err += float(torch.linalg.vector_norm(diff, dtype=torch.float64)) ** 2
    if norm == 0.0:
        return 0.0
    return math.sqrt(err) / math.sqrt(norm)


def error_table(errors: list[LayerError]) -> dict[str, object]:
    """The record's error fields: layers counted, mean and worst relative RMS error, the worst
    layer's name, and the five worst layers (name, rel_rms), worst first."""
    if not errors:
        return {"quantized_layers": 0}
    worst = sorted(errors, key=lambda e: e.rel_rms, reverse=True)
    return {
        "quantized_layers": len(errors),
        "rel_rms_mean": sum(e.rel_rms for e in errors) / len(errors),
        "rel_rms_max": worst[0].rel_rms,
        "worst_layer": worst[0].name,
        "worst_layers": [[e.name, e.rel_rms] for e in worst[:5]],
    }


# NOTE [ CPU dequantization ]
# On the CPU a load's dequantization runs on the host's cores between the compute, so its cost
# is the bench rows'. Forming ``float(q) * s`` for a whole weight in one fp32
# temporary allocated per weight (4 bytes per element: 151 MB for FLUX's 12288 x 3072
# ``proj_mlp``) cost more in page faults and DRAM traffic than the arithmetic, and gathering
# float8 values through an int64 index (8 bytes per element) more still. Whole rows at a time
# into one cache-resident fp32 scratch (``CPU_CHUNK_ELEMENTS``: 2^16 .. 2^21 elements measured,
# 2^19 to 2^21 the fastest on a 3072 x 3072 weight, smaller chunks pay per-chunk dispatch),
# reused across a block's weights, with float8 codes looked up through an int32 index, computes
# the same elementwise product in the same order: the same bits
# (tests/runtime/squareq/test_squareq_formats.py). Thread CPU time of one use of a real-size
# FLUX.1-dev block into bf16, OMP_NUM_THREADS=1, 2-core EPYC host, median of 3: double block
# (340 M parameters) int8 674 -> 67 ms, fp8 2118 -> 243 ms; single block (142 M) int8 280 ->
# 30 ms, fp8 893 -> 101 ms. At the bench's tiny widths (weights of 64 x 64 .. 384 x 64) a
# block's dequantization is per-call dispatch, not arithmetic: a weight in one chunk skips the
# per-chunk views and ``BlockImage.dequantize`` takes its views through ``slot_views`` (one
# typed view per dtype, one strided view per entry), 222 -> 155 us per block in int8 and
# 340 -> 218 us in fp8 (the bench's 57 blocks, thread CPU time). The tiny bench rows load 29
# blocks a step: 6.4 -> 4.5 ms of dequantization per step in int8, 9.9 -> 6.3 ms in fp8, out of
# ~300 ms; their ms/step on the shared 2-core host (load average 2-4) vary more than that from
# run to run (``stream_file``, unchanged, 282-612 ms), so the rows cannot show it.
