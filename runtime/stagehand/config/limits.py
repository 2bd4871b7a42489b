"""The live limits: the fields a user may change during a run, where each lives in a run's
config, and the watermark rule (``docs/contracts.md``, "Control").

``WEIGHT_FIELDS`` and ``ACTIVATION_FIELDS`` are the one list of the fields: ``PATHS`` is made
from them, ``stagehand.config.memory.LiveLimits`` has one field per path (typed as the config field it
changes) and the runtime parts own them (``runtime/stagehand/strategy/parts.py``).

The server checks a ``PATCH /api/runs/{id}/limits`` body against the limits in force
(``watermark_problem``), the worker checks the limits it would apply (``check_watermarks``), the
configs check their watermark pairs (``check_pair``, ``"auto"`` allowed), and the dashboard
reads the field -> config path table and the pairs from ``/static/js/contract.js``
(``workbench.contract.javascript``; the New run form) and ``GET /api/runs/{id}/limits`` (the live limits
panel; ``GET /api/limits/fields`` serves it without a run): all of them from here.
"""

from __future__ import annotations

from typing import Any

SH = "memory.stagehand"
"""The weight runtime's config section."""
AS = f"{SH}.activation_stagehand"
"""The activation runtime's config section."""

WEIGHT_FIELDS = (
    "vram_high_watermark_mb",
    "vram_low_watermark_mb",
    "prefetch_window_blocks",
    "max_inflight_transfers",
)
"""Live-limit fields of the weight runtime; their config path is ``memory.stagehand.<field>``."""

ACTIVATION_FIELDS = {
    "activation_vram_high_watermark_mb": "vram_high_watermark_mb",
    "activation_vram_low_watermark_mb": "vram_low_watermark_mb",
    "max_inflight_d2h": "max_inflight_d2h",
    "max_inflight_h2d": "max_inflight_h2d",
}
"""Live-limit field of the activation runtime -> its name in ``AS``."""

PATHS = {
    **{field: f"{SH}.{field}" for field in WEIGHT_FIELDS},
    **{field: f"{AS}.{name}" for field, name in ACTIVATION_FIELDS.items()},
}
"""Every live-limit field -> the dotted path of its value in a run's config."""

WEIGHT_PAIR = ("vram_high_watermark_mb", "vram_low_watermark_mb")
"""The weight runtime's (high, low) watermarks; also their names in either runtime's section."""
ACTIVATION_PAIR = ("activation_vram_high_watermark_mb", "activation_vram_low_watermark_mb")
"""The activation runtime's (high, low) watermarks, as live-limit fields."""
PAIRS = (WEIGHT_PAIR, ACTIVATION_PAIR)
"""(high, low) watermark pairs among the live-limit fields."""

AUTO = "auto"
"""A watermark or cap derived from the card and the step's needs at build
(NOTE [ Auto watermarks ] in ``runtime/stagehand/weights/auto.py``)."""


def low_above_high(high: float, low: float, names: tuple[str, str] = WEIGHT_PAIR) -> str | None:
    """The watermark rule: the sentence naming both fields when the low watermark ``low`` is
    above the high one ``high`` (MB), else None."""
    if low > high:
        return f"{names[1]} ({low}) must not be above {names[0]} ({high})"
    return None


def check_watermarks(high: object, low: object, names: tuple[str, str] = WEIGHT_PAIR) -> None:
    """A pair of watermarks in MB: both numbers >= 0 (bools and NaN refused) and the low one not
    above the high one (``low_above_high``); ``names`` are the (high, low) fields errors name.

    Raises:
        ValueError: naming the field at fault.
    """
    for name, value in zip(names, (high, low), strict=True):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value != value
            or value < 0
        ):
            raise ValueError(f"{name} must be a number of MB >= 0, got {value!r}")
    sentence = low_above_high(high, low, names)  # type: ignore[arg-type]
    if sentence:
        raise ValueError(sentence)


def check_pair(high: object, low: object, names: tuple[str, str]) -> None:
    """A pair of watermark (or cap) fields in a config: both ``AUTO``, or both MB with
    ``check_watermarks``' rule. Raises ``ValueError`` naming the fields when only one is
    ``AUTO``."""
    if high == AUTO and low == AUTO:
        return
    if AUTO in (high, low):
        raise ValueError(f'{names[0]} and {names[1]} must both be "auto" or both MB numbers')
    check_watermarks(high, low, names)


def watermark_problem(now: dict[str, Any], given: dict[str, Any]) -> tuple[str, str] | None:
    """``(field, sentence)`` when the live limits ``given`` would put a low watermark above its
    high one once folded into the limits in force ``now``; the field is one ``given`` names.
    None when fine. A pair ``given`` whole is checked by ``check_watermarks`` on its own."""
    for high, low in PAIRS:
        if high in given and low in given:
            continue
        if high in given and low in now and low_above_high(given[high], now[low]):
            return high, (
                f"{high} ({given[high]:g}) must not be below the low watermark in force, "
                f"{low} ({now[low]:g})"
            )
        if low in given and high in now and low_above_high(now[high], given[low]):
            return low, (
                f"{low} ({given[low]:g}) must not be above the high watermark in force, "
                f"{high} ({now[high]:g})"
            )
    return None
