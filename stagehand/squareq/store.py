"""SquareQ's on-disk cache: a block checkpoint's tensors as the images hold them, quantized once
per source and format and reused by every later run.

One folder per (source, format, entries): ``squareq-<format>-<key>/`` beside the model cache
(``$STAGEHAND_WORKBENCH_CACHE/squareq`` unless ``memory.stagehand.squareq.cache_dir``) with
``blocks.safetensors`` (each quantized weight as its packed uint8 entry, ``image.pack``; every
other block tensor in the compute dtype) and ``squareq.json`` (the error table, the quantization
time). The key hashes what identifies the source's content without reading all of it (each
file's resolved path, size, modification time and safetensors header: every key, dtype, shape
and offset), the format and the entries asked for (keys, compute dtypes, which are quantized).
The path tells apart files that agree in all the rest and differ in their bytes only: Wan 2.2's
two experts (``transformer/``, ``transformer_2/``: one architecture, the same file names) when
their times are equal too, as in a Nix store or an image built with ``SOURCE_DATE_EPOCH``;
keyed by their names alone, the second expert read the first one's images. A moved folder is
quantized again (a copied one already was: its times change). The
folder is written under a temporary name and renamed when complete (atomic: a crash leaves no
folder a later run would trust); a folder that exists is reused as it is.

The file is written tensor by tensor (the header is known before any tensor is read), so the
quantization holds one weight in memory at a time, never the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.cache import cache_dir
from stagehand.squareq.formats import LayerError, dequantize, error_table, quantize, relative_rms
from stagehand.squareq.image import pack, packed_bytes
from stagehand.squareq.prequantized import load_packed_parts

VERSION = 1
"""Bumped when the cache's layout changes (old folders are then never matched)."""
FILE = "blocks.safetensors"
META = "squareq.json"
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Entry:
    """One block tensor the cache holds: checkpoint ``key``, the compute ``dtype`` and ``shape``
    of its parameter, and whether it is quantized (stored packed)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    quantized: bool
    prequantized: bool = False
    """Stored as float8_e4m3fn in the checkpoint: packed as stored (``prequantized.py``)."""

    @property
    def stored(self) -> tuple[str, tuple[int, ...], int]:
        """(safetensors dtype, shape, bytes) as written."""
        if self.quantized:
            n = packed_bytes(*self.shape)
            return "U8", (n,), n
        numel = 1
        for size in self.shape:
            numel *= size
        return SAFETENSORS_DTYPES[self.dtype], self.shape, numel * self.dtype.itemsize


def source_identity(paths: list[Path]) -> list[list[object]]:
    """What identifies a checkpoint's content: per file its resolved path (symlinks followed: a
    Hugging Face snapshot's blob), size, mtime and header hash (module docstring)."""
    out: list[list[object]] = []
    for path in sorted(set(paths)):
        stat = path.stat()
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = hashlib.sha256(f.read(length)).hexdigest()
        out.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns, header])
    return out


def cache_key(source: Any, fmt: str, entries: list[Entry]) -> str:
    """The folder key of ``entries`` of ``source`` (a ``SafetensorsCheckpoint``) in ``fmt``."""
    paths = [source.entries[e.key].path for e in entries]
    spec = {
        "version": VERSION,
        "format": fmt,
        "source": source_identity(paths),
        "entries": [[e.key, str(e.dtype), e.quantized, e.prequantized] for e in entries],
    }
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_root(explicit: str | os.PathLike[str] | None) -> Path:
    """``explicit``, else ``squareq/`` in the workbench cache (``workbench.asset_status``)."""
    return Path(explicit).expanduser().absolute() if explicit else cache_dir() / "squareq"


def folder_for(source: Any, entries: list[Entry], fmt: str, root: Path) -> Path:
    """The cache folder of ``entries`` of ``source`` in ``fmt`` under ``root`` (``cache_key``),
    whether or not it exists."""
    return root / f"squareq-{fmt}-{cache_key(source, fmt, entries)}"


def cached_meta(folder: Path) -> dict[str, Any] | None:
    """The ``squareq.json`` of a complete cache ``folder`` (``folder_for``) with ``cached``
    True, or None when it was not built yet (nothing else is read, nothing written)."""
    if not (folder / META).is_file():
        return None
    return {**json.loads((folder / META).read_text()), "cached": True}


def ensure(
    source: Any,
    entries: list[Entry],
    fmt: str,
    root: Path,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The cache folder of ``entries`` (built when absent) and its ``squareq.json`` with
    ``cached`` (True when it was reused).

    Raises:
        OSError: the cache root cannot be written (names the folder).
    """
    folder = folder_for(source, entries, fmt, root)
    found = cached_meta(folder)
    if found is not None:
        return folder, found
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"memory.stagehand.squareq.cache_dir: cannot create {root} ({exc}); "
            "set cache_dir to a writable folder"
        ) from exc
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        errors = _write(source, entries, fmt, tmp / FILE, progress)
        meta = {
            "format": fmt,
            "quantize_s": time.perf_counter() - t0,
            "bytes": (tmp / FILE).stat().st_size,
            "prequantized_layers": sum(e.prequantized for e in entries),
            **error_table(errors),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same folder first: theirs is as good
            if not (folder / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, {**meta, "cached": False}


def _write(
    source: Any,
    entries: list[Entry],
    fmt: str,
    path: Path,
    progress: Callable[[int, int], None] | None,
) -> list[LayerError]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "squareq": fmt}}
    offset = 0
    for entry in entries:
        dtype, shape, nbytes = entry.stored
        header[entry.key] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    errors: list[LayerError] = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for done, entry in enumerate(entries):
            if entry.prequantized:  # the file's codes and scale as stored: no upcast
                value = pack(*load_packed_parts(source, entry.key))
            else:
                value = source.load(entry.key, entry.dtype)
            if entry.quantized and not entry.prequantized:
                codes, scales = quantize(value, fmt)
                restored = dequantize(codes, scales, entry.dtype)
                errors.append(
                    LayerError(entry.key, tuple(value.shape), relative_rms(value, restored))
                )
                value = pack(codes, scales)
            f.write(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            if progress is not None:
                progress(done + 1, len(entries))
        f.flush()
        os.fsync(f.fileno())
    return errors


def progress_bar(fmt: str, stream: Any = None) -> Callable[[int, int], None]:
    """A tqdm bar over the tensors written (tqdm comes with huggingface_hub), on stderr."""
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(
                total=total, desc=f"squareq {fmt}", unit="tensor", file=stream or sys.stderr
            )
        bar["bar"].update(1)
        if done == total:
            bar["bar"].close()

    return update
