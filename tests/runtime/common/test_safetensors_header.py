"""A safetensors header read by hand is checked against its file (the safetensors library's own
checks) and every refusal names the file: a corrupt length field never becomes a read of 2^62
bytes (``MemoryError`` with an empty message) or ``unpack requires a buffer of 8 bytes``."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stagehand.common.safetensors_header import (
    SafetensorsHeaderError,
    header_bytes,
    read_header,
)


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file(
        {"a": torch.zeros(3, 2), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.zeros(0)},
        path,
        metadata={"format": "pt"},
    )
    return path


def with_header(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_good_file_reads_as_the_library_reads_it(good):
    header, start = read_header(good)
    with safe_open(good, "pt") as f:
        assert sorted(k for k in header if k != "__metadata__") == sorted(f.keys())
        assert header["__metadata__"] == f.metadata() == {"format": "pt"}
    raw, size = header_bytes(good)
    assert start == 8 + len(raw) and size == good.stat().st_size
    assert header["b"]["data_offsets"][1] - header["b"]["data_offsets"][0] == 10


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (2**64 - 1, "header length 18446744073709551615 bytes, but the file holds"),
        (2**62, "header length 4611686018427387904 bytes, but the file holds"),
        (10**9, "header length 1000000000 bytes"),  # past the 100 MB cap and the file
    ],
)
def test_a_length_past_the_file_is_refused_before_it_is_read(good, length, expected):
    data = bytearray(good.read_bytes())
    data[:8] = struct.pack("<Q", length)
    good.write_bytes(bytes(data))
    with pytest.raises(SafetensorsHeaderError, match="not a safetensors file") as info:
        read_header(good)
    assert str(info.value).startswith(f"{good}: {expected}")


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03"])
def test_a_file_under_8_bytes_is_named(tmp_path, content):
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsHeaderError) as info:
        read_header(path)
    assert str(info.value) == (
        f"{path}: {len(content)} bytes, shorter than the 8-byte header length every safetensors "
        "file starts with; not a safetensors file (empty or truncated)"
    )


def test_a_zeroed_or_random_header_is_not_json(good):
    data = bytearray(good.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + n] = bytes(n)  # the length kept, the JSON zeroed
    good.write_bytes(bytes(data))
    with pytest.raises(SafetensorsHeaderError, match=r"header is not UTF-8 JSON") as info:
        read_header(good)
    assert str(info.value).startswith(f"{good}: the {n}-byte header")
    good.write_bytes(bytes(len(data)))  # the length zeroed too: an empty header
    with pytest.raises(SafetensorsHeaderError, match="the 0-byte header is not UTF-8 JSON"):
        read_header(good)
    good.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(SafetensorsHeaderError, match="a JSON list; expected an object"):
        read_header(good)


@pytest.mark.parametrize(
    ("tensors", "data", "expected"),
    [
        # A shape smaller than its range: the tensor understated.
        ({"a": ("F32", [2], [0, 12])}, 12, "tensor 'a' (F32 [2]) is 8 bytes but its data_offsets"),
        ({"a": ("F32", [1], [0, 4]), "b": ("F32", [1], [8, 12])}, 12, "'b' starts at data byte 8"),
        ({"a": ("F32", [2], [0, 8]), "b": ("F32", [1], [4, 8])}, 8, "'b' starts at data byte 4"),
        ({"a": ("F32", [3], [0, 12])}, 8, "the tensors end at data byte 12 but the data section"),
        ({"a": ("F32", [1], [0, 4])}, 8, "the tensors end at data byte 4 but the data section"),
        ({"a": ("F32", [-1], [0, 4])}, 4, "tensor 'a' has"),
        ({"a": ("F32", [1], [4, 0])}, 4, "with 0 <= begin <= end"),
    ],
)
def test_ranges_that_do_not_tile_the_data_are_named(tmp_path, tensors, data, expected):
    path = tmp_path / "bad.safetensors"
    header = {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in tensors.items()}
    with_header(path, header, bytes(data))
    with pytest.raises(SafetensorsHeaderError, match=re.escape(expected)) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: ")
    with pytest.raises(Exception):  # noqa: B017 - the library refuses each of them too
        with safe_open(path, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]


def test_malformed_entries_are_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    for entry in (
        "F32",
        {"dtype": "F32", "shape": [1]},
        {"dtype": 1, "shape": [], "data_offsets": [0, 0]},
    ):
        with_header(path, {"w": entry}, b"")
        with pytest.raises(SafetensorsHeaderError, match=re.escape(f"{path}: tensor 'w' has")):
            read_header(path)
    # A dtype the table does not size is left to its reader, the ranges still checked.
    with_header(path, {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0\0")
    assert read_header(path)[0]["w"]["dtype"] == "F4"
