"""The limits a step that ran out of device memory runs again with: one rule, for the worker's
recovery (``backend/workbench/worker/recovery.py``) and the planner alike.

# NOTE [ Lowering rule ]
A step that raised ``torch.OutOfMemoryError`` held ``failure_bytes`` on the device and asked for
``requested_bytes`` more: it needed ``needed = failure_bytes + requested_bytes``. The card holds
``card_bytes`` (unknown: ``needed`` is taken for it, the failure says the card is no larger).
Every watermark reads the one device usage (``DeviceMemory.usage_bytes``: weights, kept and
restored activations together), so the step's peak follows the lowest watermark the runtimes
can still honour. The rule keeps a margin of ``MARGIN_FRACTION`` of the card free (allocator
fragments, the copies in flight, the tensors no runtime moves: tiny ones, those saved in
backward) and lowers by what the step overshot the rest, at least by the margin:

    ceiling = card_bytes x (1 - MARGIN_FRACTION)
    cut     = max(needed - ceiling, MARGIN_FRACTION x card_bytes)

- each high watermark (weight and activation runtimes): ``min(high, ceiling) - cut``, at least 0:
  fewer blocks loaded ahead, activations spilled earlier;
- each low watermark: the lower of ``low - cut`` and ``low x high' / high`` (the band between
  the watermarks keeps its proportion: room for the window's prefetches), at least 0: fewer
  resident blocks, spilling continues further down. An activation high watermark of 0 spills
  every eligible saved tensor from the start of the step (``ActivationBudgetManager.pressure``);
- the prefetch window: halved, at least 1 block (a window of 0 stays 0).

Values are MB rounded down to the KB. Every lowering cuts by at least the margin, so a step
that keeps failing reaches the floors (watermarks 0, window 1) in a few attempts; there
``lowered_limits`` returns None: nothing is left to lower, and the run ends saying what would fit
(``backend/workbench/worker/recovery.py``). Copies in flight (``max_inflight_*``) are left alone: their bytes lie
inside the watermarks already.
"""

from __future__ import annotations

import math
import re
from typing import Any

from stagehand.config.limits import PAIRS
from stagehand.config.memory import MB

MARGIN_FRACTION = 0.10
"""Share of the card kept free below the watermarks after an out-of-memory error (NOTE
[ Lowering rule ]): the figures the watermarks compare are the runtimes' own, and on CUDA the
allocator's fragments and the compute's scratch tensors lie outside them."""

MAX_FAILURES_PER_STEP = 3
"""Out-of-memory failures of one step before the run ends: with every lowering cutting at least
``MARGIN_FRACTION`` of the card, three attempts take a step from watermarks at the card to 70 %
of it; a step still failing there needs what no watermark frees (one block or one saved tensor
larger than the card's rest)."""

WINDOW_FLOOR = 1
"""The smallest prefetch window the rule leaves (blocks): 0 would load every block on demand."""

_CUDA_REQUEST = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B|bytes)")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1, "bytes": 1}


def requested_bytes(exc: BaseException) -> int:
    """The bytes the failed allocation asked for: an emulated card's ``requested_bytes``, else
    the figure of CUDA's "Tried to allocate X MiB" message; 0 when neither says."""
    value = getattr(exc, "requested_bytes", None)
    if isinstance(value, int):
        return value
    found = _CUDA_REQUEST.search(str(exc))
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


def _down(mb: float) -> float:
    """``mb`` rounded down to the KB (MB with 3 decimals), at least 0."""
    return max(0.0, math.floor(mb * 1000) / 1000)


def lowered_limits(
    limits: dict[str, Any],
    failure_bytes: int,
    card_bytes: int | None,
    requested: int = 0,
) -> dict[str, Any] | None:
    """The live limits after an out-of-memory error (NOTE [ Lowering rule ]).

    Args:
        limits: the limits in force, ``{field: value}`` (``MemoryStrategy.limits()``: watermarks
            in MB, the window in blocks); fields of a runtime that is off are absent.
        failure_bytes: device bytes in use at the failure (tracked on the CPU, allocated on
            CUDA).
        card_bytes: the card's capacity in bytes; None when unknown.
        requested: bytes the failed allocation asked for (``requested_bytes``).

    Returns:
        Every field of ``limits`` with its lowered value, or None when none can be lowered (the
        floors: watermarks 0, window ``WINDOW_FLOOR``; or no limit at all).

    Raises:
        ValueError: ``failure_bytes`` or ``requested`` negative, ``card_bytes`` not positive.
    """
    if failure_bytes < 0 or requested < 0:
        raise ValueError(
            f"failure_bytes and requested must be >= 0 bytes, got {failure_bytes}, {requested}"
        )
    if card_bytes is not None and card_bytes <= 0:
        raise ValueError(f"card_bytes must be > 0 bytes, got {card_bytes}")
    needed = failure_bytes + requested
    card = card_bytes if card_bytes is not None else max(needed, 1)
    ceiling = card * (1 - MARGIN_FRACTION)
    cut = max(needed - ceiling, MARGIN_FRACTION * card) / MB
    ceiling /= MB
    out = dict(limits)
    for high_name, low_name in PAIRS:
        if high_name not in limits or low_name not in limits:
            continue
        high_was, low_was = limits[high_name], limits[low_name]
        high = _down(min(high_was, ceiling) - cut)
        kept = low_was * high / high_was if high_was > 0 else 0.0  # the band's proportion
        out[high_name] = high
        out[low_name] = min(high, _down(min(low_was - cut, kept)))
    window = limits.get("prefetch_window_blocks")
    if window is not None and window > WINDOW_FLOOR:
        out["prefetch_window_blocks"] = max(WINDOW_FLOOR, window // 2)
    return None if out == limits else out
