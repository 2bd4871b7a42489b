"""Text that can always be shown: a file name that is not UTF-8, escaped.

Python reads a file name whose bytes are not UTF-8 with ``surrogateescape``: the byte ``0xff``
of ``c_\\xff.png`` becomes the lone surrogate ``\\udcff``. Such a ``str`` cannot be encoded as
UTF-8, so a JSON answer, a log line or a terminal that holds it fails (pydantic's
``surrogates not allowed``), and a JSON record that carries it (``"\\udcff"`` is valid JSON)
fails every later answer that reads the record back. ``shown`` writes each such byte as
``\\xff``, as ``ls --quoting-style=escape`` and Python's ``backslashreplace`` do.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"  # any other lone surrogate (a JSON "\ud800" escape)


def shown(text: str) -> str:
    """``text`` with every lone surrogate escaped: a byte a file name held that is not UTF-8
    as ``\\xNN`` (``c_\\udcff.png`` -> ``c_\\xff.png``), any other as ``\\uNNNN``. Text that is
    valid Unicode comes back unchanged (the same object)."""
    return _SURROGATE.sub(_escape, text) if _SURROGATE.search(text) else text


def shown_json(value: Any) -> Any:
    """A JSON value (dicts, lists, strings, numbers) with ``shown`` applied to every string,
    keys included; other values unchanged."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, dict):
        return {shown(k) if isinstance(k, str) else k: shown_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_json(v) for v in value]
    return value
