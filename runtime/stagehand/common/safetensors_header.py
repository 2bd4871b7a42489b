"""A safetensors file's header, read by hand and checked against the file before any of it is
trusted.

The format: 8 bytes, the header's length ``N`` as a little-endian u64; ``N`` bytes of JSON
(``{key: {dtype, shape, data_offsets: [begin, end]}}`` and an optional ``__metadata__``); then
the data section, each tensor's bytes at ``data_offsets`` counted from its first byte. The
length field is 8 bytes of whatever the file holds: read as is, a corrupt one asks ``read`` for
up to 2^64 bytes (a ``MemoryError`` with an empty message), and a file under 8 bytes gives
``unpack requires a buffer of 8 bytes``. So every reader of a header in the project (the weight
runtime's checkpoint, SquareQ's cache key, the pipeline folder's inspection) goes through
``read_header``, which applies the safetensors library's own checks (``safetensors/src/
tensor.rs``: ``read_metadata`` and ``Metadata::validate``) and names the file in every error:

- the length is at most ``MAX_HEADER_BYTES`` and the header ends inside the file;
- the header is UTF-8 JSON, an object whose tensors each have a string ``dtype``, a ``shape``
  of non-negative integers and two ``data_offsets``;
- sorted by offset, the tensors lie end to end from the data section's first byte to the file's
  last (no gap, no overlap, nothing past the end), each range holding exactly its shape's
  elements of its dtype (dtypes outside ``DTYPE_BYTES`` are not sized; their reader refuses
  them by name).

A file ``safetensors.safe_open`` refuses is refused here too, before a byte of data is read.
Only a regular file is opened (a FIFO named ``x.safetensors`` would block ``open`` forever) and
the header's JSON may nest at most ``stagehand.config.safe_read.MAX_JSON_DEPTH`` levels (``json.loads``
raised ``RecursionError`` on 100k levels): ``stagehand.config.safe_read``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from stagehand.config.safe_read import JsonTooDeep, loads, open_regular

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's cap on a header (``MAX_HEADER_SIZE``), in bytes: a sparse file can
be larger than any header that fits in memory."""
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
"""Bytes per element of the safetensors dtypes (``Dtype::bitsize`` / 8, whole bytes only)."""


class SafetensorsHeaderError(ValueError):
    """A safetensors file whose header does not describe the file (names the file)."""


def header_bytes(path: str | os.PathLike[str]) -> tuple[bytes, int]:
    """``(raw JSON header, file size in bytes)`` of the safetensors file ``path``, the length
    field checked against the file before anything is read past it.

    Raises:
        SafetensorsHeaderError: the file is under 8 bytes, or its header length is over
            ``MAX_HEADER_BYTES`` or past the end of the file (names the file and both sizes).
        stagehand.config.safe_read.NotRegularFile: a FIFO, device, socket or folder (never opened).
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SafetensorsHeaderError(
                f"{path}: {size} bytes, shorter than the 8-byte header length every "
                "safetensors file starts with; not a safetensors file (empty or truncated)"
            )
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsHeaderError(
                f"{path}: header length {length} bytes, but the file holds {size - 8} bytes "
                f"after the length field (headers are at most {MAX_HEADER_BYTES} bytes); "
                "not a safetensors file (corrupt or truncated)"
            )
        raw = f.read(length)
    if len(raw) != length:  # the file shrank while it was read
        raise SafetensorsHeaderError(f"{path}: header of {length} bytes ends early at {len(raw)}")
    return raw, size


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of the safetensors file ``path``: the parsed JSON header
    (``{key: {"dtype", "shape", "data_offsets"}}``, ``__metadata__`` kept when present) and the
    file offset of the data section in bytes (``8 + N``), every check of the module docstring
    passed.

    Raises:
        SafetensorsHeaderError: the header is not what the file holds (names the file and, for
            a tensor's fault, the tensor's key), or nests deeper than ``MAX_JSON_DEPTH``.
        stagehand.config.safe_read.NotRegularFile: a FIFO, device, socket or folder (never opened).
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    raw, size = header_bytes(path)
    try:
        header = loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, JsonTooDeep) as exc:
        raise SafetensorsHeaderError(
            f"{path}: the {len(raw)}-byte header is not UTF-8 JSON ({exc}); not a safetensors "
            "file (corrupt)"
        ) from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(
            f"{path}: the header is a JSON {type(header).__name__}; expected an object of tensors"
        )
    data_start = 8 + len(raw)
    _check_ranges(path, header, size - data_start)
    return header, data_start


def _check_ranges(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    """The tensors of ``header`` tile the ``data_bytes`` of the data section (module docstring)."""
    ranges = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and type(begin) is int
                and type(end) is int
                and 0 <= begin <= end
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise SafetensorsHeaderError(
                f"{path}: tensor {key!r} has {repr(info)[:200]}; expected a dtype string, a "
                "shape of non-negative integers and data_offsets [begin, end] with 0 <= begin "
                "<= end"
            )
        if dtype in DTYPE_BYTES:
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * DTYPE_BYTES[dtype]:
                raise SafetensorsHeaderError(
                    f"{path}: tensor {key!r} ({dtype} {shape}) is {numel * DTYPE_BYTES[dtype]} "
                    f"bytes but its data_offsets [{begin}, {end}] span {end - begin}"
                )
        ranges.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(ranges):
        if begin != at:
            raise SafetensorsHeaderError(
                f"{path}: tensor {key!r} starts at data byte {begin}, expected {at} (tensors lie "
                "end to end from the data section's first byte)"
            )
        at = end
    if at != data_bytes:
        raise SafetensorsHeaderError(
            f"{path}: the tensors end at data byte {at} but the data section holds {data_bytes} "
            "bytes (truncated, or a header that does not describe the file)"
        )
