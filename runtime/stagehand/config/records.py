"""The telemetry records the runtimes emit that a reader looks up by name (the workbench's server
reads them), each a ``(source, kind)`` pair named once. Their fields are in the workbench's
``docs/contracts.md``.
"""

from __future__ import annotations

from typing import NamedTuple


class Record(NamedTuple):
    """A telemetry record's ``source`` and ``kind``."""

    source: str
    kind: str


LIMITS_APPLIED = Record("strategy", "limits_applied")
"""Live limits the worker applied (``changed``: field -> [old, new]): the limits in force."""
WEIGHTS_STEP = Record("stagehand", "step")
"""The weight runtime's per-step figures (loads, bytes, watermarks, step time)."""
SQUAREQ_STEP = Record("squareq", "step")
"""SquareQ's per-step figures (bytes dequantized, dequant ms, format; the first one also the
quantization error table and time)."""
