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
folder a later run would trust).

A folder that exists is reused once it verifies (``cached_meta``): ``squareq.json`` matches its
own ``check`` (a SHA-256 of its other fields) and records ``blocks.safetensors``' size and
checksum (``checksum.py``: SHA-256 over 64 MiB chunks, computed while the file is written, every
byte checked once per process, NOTE [ SquareQ cache checksum ]), and the file's header
describes the file (``stagehand.common.safetensors_header``). A folder that does not verify
(flipped bytes, a truncated or random file, an edited header, a garbage ``squareq.json``) is
never trained on: ``ensure`` moves it aside, deletes it when it holds nothing but the cache's
two files (anything else stays, renamed ``<folder>.corrupt-<pid>-<ns>``), and quantizes again;
where it cannot be moved, ``CorruptCacheError`` names it and how to clear it. The cache is
derived data: replacing it loses nothing the user made.

The file is written tensor by tensor (the header is known before any tensor is read), so the
quantization holds one weight in memory at a time, never the model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stagehand.common.safetensors_header import SafetensorsHeaderError, header_bytes, read_header
from stagehand.config.cache import cache_dir
from stagehand.squareq import checksum
from stagehand.squareq.formats import LayerError, dequantize, error_table, quantize, relative_rms
from stagehand.squareq.image import pack, packed_bytes
from stagehand.squareq.prequantized import load_packed_parts

VERSION = 2
"""Bumped when the cache's layout changes (old folders are then never matched). 2:
``squareq.json`` carries the checksums (version 1 folders could not be verified)."""
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
PRIVATE = ("checksum", "check")
"""``squareq.json`` fields that verify the folder, left out of what ``ensure`` returns (the
first ``squareq/step`` record carries the rest)."""
log = logging.getLogger(__name__)


class CorruptCacheError(ValueError):
    """A SquareQ cache folder that does not verify (names it, what failed and how to clear it)."""

    def __init__(self, folder: Path, why: str, note: str = "") -> None:
        self.folder, self.why = folder, why
        super().__init__(
            f"SquareQ cache {folder} does not verify: {why}{note}. It holds derived data only: "
            f"delete it (rm -r '{folder}') and the next run quantizes the checkpoint again"
        )


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
    Hugging Face snapshot's blob), size, mtime and header hash (module docstring).

    Raises:
        SafetensorsHeaderError: a file's header length is past its end (names the file).
    """
    out: list[list[object]] = []
    for path in sorted(set(paths)):
        stat = path.stat()
        header = hashlib.sha256(header_bytes(path)[0]).hexdigest()
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
    """``explicit``, else ``squareq/`` in the workbench cache (``workbench.worker.asset_status``)."""
    return Path(explicit).expanduser().absolute() if explicit else cache_dir() / "squareq"


def folder_for(source: Any, entries: list[Entry], fmt: str, root: Path) -> Path:
    """The cache folder of ``entries`` of ``source`` in ``fmt`` under ``root`` (``cache_key``),
    whether or not it exists."""
    return root / f"squareq-{fmt}-{cache_key(source, fmt, entries)}"


def cached_meta(folder: Path, verify: bool = False) -> dict[str, Any] | None:
    """The ``squareq.json`` fields of the cache ``folder`` (``folder_for``) with ``cached``
    True, or None when there is no such folder (nothing is written).

    Checked first (module docstring): ``squareq.json``'s own ``check``, the file's recorded
    size and its header, which costs a stat and a header read; with ``verify`` every byte of
    the file against its checksum too, hashed once per process (``checksum.check_once``: about
    0.5-1.4 GB/s a core, NOTE [ SquareQ cache checksum ]). A run verifies (``ensure``); the
    planner, which reads the error table and trains nothing, does not.

    Raises:
        CorruptCacheError: the folder exists and does not verify.
    """
    if not folder.exists() and not folder.is_symlink():
        return None
    meta, why = _verified(folder, verify)
    if meta is None:
        raise CorruptCacheError(folder, why)
    return {**{k: v for k, v in meta.items() if k not in PRIVATE}, "cached": True}


def _seal(meta: dict[str, Any]) -> str:
    """SHA-256 of ``meta``'s fields but ``check``, as canonical JSON (``squareq.json``'s
    ``check``: an edited or damaged record that still parses is caught too)."""
    body = {k: v for k, v in meta.items() if k != "check"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _verified(folder: Path, verify: bool) -> tuple[dict[str, Any] | None, str]:
    """``(squareq.json, "")`` when ``folder`` verifies (``cached_meta``), else ``(None, why)``."""
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        return None, f"{META} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{META} is not readable JSON ({exc})"
    if not isinstance(meta, dict) or meta.get("check") != _seal(meta):
        return None, f"{META} does not match its own check (edited or damaged)"
    record, path = meta.get("checksum"), folder / FILE
    if not (
        isinstance(record, dict)
        and record.get("file") == FILE
        and isinstance(record.get("bytes"), int)
        and isinstance(record.get("chunk_bytes"), int)
        and record["chunk_bytes"] > 0
        and isinstance(record.get("sha256_tree"), str)
    ):
        return None, f"{META} records no checksum of {FILE}"
    try:
        size = path.stat().st_size
        if size != record["bytes"]:
            return None, f"{FILE} is {size} bytes, {META} records {record['bytes']}"
        read_header(path)
        if verify and not checksum.check_once(path, record["sha256_tree"], record["chunk_bytes"]):
            return None, f"{FILE} does not match the checksum written when it was quantized"
    except FileNotFoundError:
        return None, f"{FILE} is missing"
    except SafetensorsHeaderError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"{FILE} is not readable ({exc})"
    return meta, ""


def _discard(error: CorruptCacheError) -> str:
    """Move the corrupt cache folder of ``error`` aside and delete it when it holds only the
    cache's own two files (regular files, no links); anything else is kept, renamed beside it.
    Returns what was done, for the record.

    Raises:
        CorruptCacheError: the folder cannot be moved (``error``'s, and why).
    """
    folder = error.folder
    aside = folder.with_name(f"{folder.name}.corrupt-{os.getpid()}-{time.time_ns()}")
    said = f"SquareQ cache {folder} did not verify: {error.why}"
    try:
        folder.rename(aside)
    except FileNotFoundError:  # another process moved it first
        return f"{said}; moved by another process, quantized again"
    except OSError as exc:
        raise CorruptCacheError(
            folder, error.why, f" (and it could not be moved aside: {exc})"
        ) from None
    own = (
        aside.is_dir()
        and not aside.is_symlink()
        and all(
            p.name in (FILE, META) and p.is_file() and not p.is_symlink() for p in aside.iterdir()
        )
    )
    if own:
        shutil.rmtree(aside)
        done = f"{said}; deleted and quantized again"
    else:
        done = f"{said}; kept as {aside} (it holds more than the cache's files), quantized again"
    log.warning("%s", done)
    return done


def ensure(
    source: Any,
    entries: list[Entry],
    fmt: str,
    root: Path,
    progress: Callable[[int, int], None] | None = None,
    device: torch.device | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The cache folder of ``entries`` (built when absent or when it does not verify) and its
    ``squareq.json`` fields with ``cached`` (True when it was reused) and, when a folder that did
    not verify was replaced, ``replaced`` (why, and what became of it). Every byte a run reads
    from the folder has been checked in this process (``cached_meta`` with ``verify``).
    ``device``: a CUDA device quantizes there (NOTE [ Quantizing on the GPU ]); None or a CPU,
    on this machine's cores.

    Raises:
        OSError: the cache root cannot be written (names the folder).
        CorruptCacheError: the folder does not verify and cannot be moved aside (names it).
    """
    folder = folder_for(source, entries, fmt, root)
    replaced = None
    try:
        found = cached_meta(folder, verify=True)
    except CorruptCacheError as exc:
        found, replaced = None, _discard(exc)
    if found is not None:
        return folder, found
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"memory.stagehand.squareq.cache_dir: cannot create {root} ({exc}); "
            "set cache_dir to a writable folder"
        ) from exc
    gpu = device if device is not None and torch.device(device).type == "cuda" else None
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        errors, digest = _write(source, entries, fmt, tmp / FILE, progress, gpu)
        size = (tmp / FILE).stat().st_size
        meta = {
            "format": fmt,
            "quantize_s": time.perf_counter() - t0,
            "bytes": size,
            "prequantized_layers": sum(e.prequantized for e in entries),
            **error_table(errors),
            "checksum": {
                "file": FILE,
                "bytes": size,
                "chunk_bytes": checksum.CHUNK_BYTES,
                "sha256_tree": digest,
            },
        }
        meta["check"] = _seal(meta)
        (tmp / META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same folder first: theirs is as good
            if not (folder / META).is_file():
                raise
        else:  # the bytes just hashed as they were written: not hashed again in this process
            checksum.remember(folder / FILE, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if gpu is not None:  # the quantization's temporaries: not reserved for the run
            torch.cuda.empty_cache()
    out = {**{k: v for k, v in meta.items() if k not in PRIVATE}, "cached": False}
    return folder, out if replaced is None else {**out, "replaced": replaced}


def _write(
    source: Any,
    entries: list[Entry],
    fmt: str,
    path: Path,
    progress: Callable[[int, int], None] | None,
    device: torch.device | None = None,
) -> tuple[list[LayerError], str]:
    """Write ``entries`` to ``path`` (quantized on ``device``, a CUDA device, when given);
    returns the quantization errors and the file's ``checksum.TreeHash`` hex digest, hashed
    from the bytes as they are written."""
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
    digest = checksum.TreeHash()
    threads = quantize_threads(len(entries), device)
    with open(path, "wb") as f, ThreadPoolExecutor(threads, "squareq-quantize") as pool:

        def put(data: Any) -> None:
            f.write(data)
            digest.update(data)

        put(struct.pack("<Q", len(blob)))
        put(blob)
        # Entries are prepared on ``threads`` threads (torch's kernels and the reads release the
        # GIL) and written in order; at most ``threads + 1`` are held at once (memory).
        pending: deque[Future] = deque()
        todo = iter(entries)
        for entry in itertools.islice(todo, threads + 1):
            pending.append(pool.submit(_prepare, source, entry, fmt, device))
        done = 0
        while pending:
            data, error = pending.popleft().result()
            following = next(todo, None)
            if following is not None:
                pending.append(pool.submit(_prepare, source, following, fmt, device))
            put(data)
            if error is not None:
                errors.append(error)
            done += 1
            if progress is not None:
                progress(done, len(entries))
        f.flush()
        os.fsync(f.fileno())
    return errors, digest.hexdigest()


GPU_THREADS = 4
"""Threads that read and copy entries for a GPU's quantization: reads from the files overlap
the copies and kernels of the others."""

# NOTE [ Quantizing on the GPU ]
# On the CPU a weight's quantization (row maxima, the division, rounding, the dequantized copy
# for its error) takes ~0.1-0.3 s of a core at real size, and a FLUX.1-dev transformer has 500
# such weights: minutes (the real-size int8 row ran out of its 120 s). On a CUDA device each
# weight is copied there, quantized by the same ``quantize`` (the same operations: row maxima
# exact, fp32 division and round-half-even as IEEE-754 prescribes on both, the float8 cast by
# the same c10 conversion), its error measured there, and its codes and scales copied back:
# the cache's bytes do not depend on where they were made (``test_squareq_gpu.py`` checks them
# against the CPU's on the GPU). The caching allocator's blocks are released afterwards, so
# the run's budget does not start with the quantization's temporaries reserved.


def quantize_threads(entries: int, device: torch.device | None = None) -> int:
    """Threads ``_write`` prepares entries on: ``GPU_THREADS`` for a CUDA ``device``; else this
    machine's cores over torch's intra-op threads (each kernel may use those); at least 1, at
    most ``entries``."""
    if device is not None:
        return max(1, min(entries, GPU_THREADS))
    cores = os.cpu_count() or 1
    return max(1, min(entries, cores // max(1, torch.get_num_threads())))


def _prepare(
    source: Any, entry: Entry, fmt: str, device: torch.device | None = None
) -> tuple[memoryview, LayerError | None]:
    """``entry``'s bytes as the cache stores them and, for a weight quantized here (on
    ``device`` when given), its error (on a quantization thread)."""
    error = None
    if entry.prequantized:  # the file's codes and scale as stored: no upcast
        value = pack(*load_packed_parts(source, entry.key))
    else:
        value = source.load(entry.key, entry.dtype)
    if entry.quantized and not entry.prequantized:
        weight = value if device is None else value.to(device)
        codes, scales = quantize(weight, fmt)
        restored = dequantize(codes, scales, entry.dtype)
        error = LayerError(entry.key, tuple(value.shape), relative_rms(weight, restored))
        value = pack(codes, scales).cpu()
    return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy()), error


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
