"""The API's constrained scalars: ids, seqs, preset and run names, tags, devices. Each is
checked once (a ``field_validator`` or a path/query type of the routes) and stated in the OpenAPI
document by what the check accepts (``*_SCHEMA``: ``json_schema_extra`` of the fields), so that
a value the schema allows is one the server takes (tests/backend/test_openapi_enforced.py).
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Path, Query
from pydantic import BeforeValidator

from stagehand.config.memory import _DEVICE_RE, AUTO_DEVICE

MAX_ID = 2**62
"""Run ids and telemetry seqs: SQLite's INTEGER is a signed 64-bit number; 2**62 leaves room."""
INTEGER_RE = re.compile(r"^-?[0-9]{1,19}$")


def _plain_integer(value: object) -> object:
    """A path or query integer as the websocket and ``ids`` take it (``bounded_int``): ASCII
    digits only, so ``1_0``, ``1.0``, `` 1`` and other scripts' digits are refused everywhere
    instead of read as 10 or 1 by some routes."""
    if isinstance(value, str) and not INTEGER_RE.match(value):
        raise ValueError(f"expected a base-10 integer of ASCII digits, got {value[:40]!r}")
    return value


PlainInteger = BeforeValidator(_plain_integer)
RunId = Annotated[int, Path(ge=1, le=MAX_ID, description="run id, 1 to 2**62"), PlainInteger]
TuneId = Annotated[int, Path(ge=1, le=MAX_ID, description="tune id, 1 to 2**62"), PlainInteger]
Since = Annotated[
    int,
    Query(ge=-1, le=MAX_ID, description="records with seq above this (-1: from the start)"),
    PlainInteger,
]


def bounded_int(text: str, low: int, high: int) -> int | None:
    """``text`` as a base-10 integer in ``[low, high]``, or None (ASCII digits only: Python's
    ``int`` also takes ``"1_0"`` and other scripts' digits)."""
    if not INTEGER_RE.match(text):
        return None
    value = int(text)
    return value if low <= value <= high else None


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""Preset names: they double as file names of built-in presets, so no separators or dots first."""
PRESET_NAME_SCHEMA = {"pattern": NAME_RE.pattern}
"""What the OpenAPI document states of a preset name (``check_preset_name`` enforces it)."""
RUN_NAME_DESCRIPTION = "1-100 printable characters without '/', '\\' or '..'"
MAX_RUN_NAME = 100
MAX_TAGS = 32
MAX_TAG_CHARS = 40
MAX_NOTES_CHARS = 20_000
NON_PRINTING = r"\x00-\x1f\x7f-\xa0\xad\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff"
"""A JSON Schema character range of what ``str.isprintable`` refuses: the control characters,
and the spaces, line separators and format characters of Unicode in common use (the pattern
cannot list every unassigned code point, which the server refuses too)."""
RUN_NAME_SCHEMA = {
    "minLength": 1,
    "pattern": rf"^(?!.*\.\.)[^/\\{NON_PRINTING}]{{1,{MAX_RUN_NAME}}}$",
}
"""What the OpenAPI document states of a run name (``check_run_name`` enforces it)."""
TAG_SCHEMA = {
    "minLength": 1,
    "maxLength": MAX_TAG_CHARS,
    "pattern": rf"^[^,{NON_PRINTING}]{{1,{MAX_TAG_CHARS}}}$",
}
"""What the OpenAPI document states of a run's tag (``RunUpdate._tags`` enforces it)."""
DEVICE_SCHEMA = {"pattern": f"^{AUTO_DEVICE}$|{_DEVICE_RE.pattern}"}
"""What the OpenAPI document states of a run's device (``check_device`` enforces it)."""


def check_preset_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(
            "expected 1-64 characters of letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit, got {value!r}"
        )
    return value


def check_run_name(value: str) -> str:
    """Run names are labels, never paths: no separators, no '..', no control characters."""
    if not 1 <= len(value) <= MAX_RUN_NAME:
        raise ValueError(f"expected 1-{MAX_RUN_NAME} characters, got {len(value)}")
    if any(c in value for c in "/\\") or ".." in value or not value.isprintable():
        raise ValueError(
            f"expected a label without '/', '\\', '..' or control characters, got {value!r}"
        )
    return value
