"""The telemetry stream between the worker and the server: where it is, how a record is written
and read, and how it travels on stdout (``docs/contracts.md``, "Telemetry").

The worker appends one JSON object per line to ``DIR/TELEMETRY_FILE`` (``stagehand.common.telemetry``
writes with ``encode``); the server tails that file (``workbench.services.tailer`` reads with ``decode``).
With ``STDOUT_ENV=1`` in its environment (the Ray executor sets it) the worker also prints every
line after ``STDOUT_MARKER``, so a job log carries the stream when the server cannot read the run
folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TELEMETRY_FILE = "telemetry.jsonl"
"""The run's one stream, in the run folder (all sources)."""

STDOUT_MARKER = "@@stagehand-telemetry@@ "
"""Prefix of a telemetry line on the worker's stdout: a job log carries the worker's other
output too, and only lines that start with this are records."""

STDOUT_ENV = "STAGEHAND_TELEMETRY_STDOUT"
"""``1``: the worker writes every record to stdout too, after ``STDOUT_MARKER``."""


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf (browsers reject them): a diverging loss must still be a valid line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode(record: dict[str, Any]) -> str:
    """The record's line (no newline): compact JSON, a non-finite float field written as
    ``null``; numpy/torch scalars as numbers, sets and tuples as lists, anything else as text."""
    record = {k: _finite(v) for k, v in record.items()}
    return json.dumps(record, default=_json_default, separators=(",", ":"))


def decode(line: str) -> tuple[Any, str]:
    """``(value, line)``: the parsed line, and the line as it should be passed on.

    A writer other than ``encode`` (Python's json with a ``NaN`` nested in a list) may write
    ``NaN``/``Infinity``; they become ``None``, and the line passed on is re-encoded with
    ``null`` in their place, so pages and the websocket only ever see valid JSON.

    Raises:
        ValueError: the line is not JSON.
    """
    constants: list[str] = []
    value = json.loads(line, parse_constant=constants.append)  # the constant becomes None
    if constants:
        line = json.dumps(value, separators=(",", ":"))
    return value, line
