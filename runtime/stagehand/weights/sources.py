"""Where a block's bytes come from: a folder of (sharded) safetensors files, or the module.

*File-backed* parameters are read from the checkpoint each time their block loads, straight
into the staging buffer with positional reads (``os.preadv``): the module keeps no copy, and no
file page is mapped into the process, so host RSS does not grow with the model (an mmap'd read
would count every touched page in RSS). The headers are parsed once at set-up, so shapes, dtypes
and keys are checked before the first step.

Source: the LTX-2 bf16 on 24 GB case study ("file-backed mode streams frozen weights
directly from NVMe ... through a fixed pinned buffer pool").
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from stagehand.common.safetensors_header import SafetensorsHeaderError, read_header
from stagehand.weights.errors import StagehandSetupError, UnmatchedParameterError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor: its file and absolute byte range."""

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


IOV_MAX = 1024
"""Buffers one ``preadv`` takes at most (Linux's ``IOV_MAX``)."""


def _after(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """``buffers`` without their first ``skip`` bytes (in order)."""
    out = []
    for buf in buffers:
        if skip >= len(buf):
            skip -= len(buf)
            continue
        out.append(buf[skip:])
        skip = 0
    return out


def split_plan(runs: list[tuple], parts: int, min_bytes: int) -> list[list[tuple]]:
    """``runs`` (``SafetensorsCheckpoint.plan``) cut into at most ``parts`` lists of runs of
    about equal bytes, none under ``min_bytes`` (unless the whole is), so the reader threads
    share one block's read: a positional read of a file range needs no other read before it,
    so a tensor may be cut anywhere. One part when ``parts`` <= 1 or the block is small."""
    total = sum(end - start for _, start, end, _ in runs)
    parts = min(parts, total // max(min_bytes, 1))
    if parts <= 1:
        return [runs]
    target = -(-total // parts)
    out: list[list[tuple]] = [[]]
    room = target
    for path, start, _end, pieces in runs:
        first, pos, cut = start, start, []
        for dest, nbytes in pieces:
            while nbytes:
                take = min(nbytes, room)
                cut.append((dest, take))
                dest, nbytes, pos, room = dest + take, nbytes - take, pos + take, room - take
                if room == 0:
                    out[-1].append((path, first, pos, cut))
                    out.append([])
                    first, cut, room = pos, [], target
        if cut:
            out[-1].append((path, first, pos, cut))
    return [part for part in out if part]


def checkpoint_key(name: str) -> str:
    """The checkpoint key of a model parameter name: peft's ``base_model.model.`` prefix and
    ``.base_layer`` (LoRA-wrapped layers) removed."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def _read_header(path: Path) -> tuple[dict, int]:
    """``read_header`` with its error a set-up error (it names the file)."""
    try:
        return read_header(path)
    except SafetensorsHeaderError as exc:
        raise StagehandSetupError(str(exc)) from None


class SafetensorsCheckpoint:
    """The tensors of a folder of safetensors files (``*.safetensors.index.json`` when sharded).

    Raises:
        StagehandSetupError: the folder holds no safetensors file, or a header does not
            describe its file (``stagehand.common.safetensors_header``; names the file).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        indexes = sorted(self.folder.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            files = sorted({self.folder / f for f in weight_map.values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise StagehandSetupError(f"checkpoint_dir {self.folder} holds no .safetensors file")
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            header, data_start = _read_header(path)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise StagehandSetupError(
                        f"{path.name}: tensor {key!r} has unsupported dtype {info['dtype']}"
                    )
                begin, end = info["data_offsets"]
                self.entries[key] = TensorEntry(
                    key,
                    path,
                    DTYPES[info["dtype"]],
                    tuple(info["shape"]),
                    data_start + begin,
                    end - begin,
                )
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        """Guards ``_fds`` and the read counters: reader threads read concurrently (``pread``
        is positional, so one descriptor per file serves them all)."""
        self._tails: dict[str, list[str]] | None = None
        self.reads = 0
        """Tensors read from the files so far (``read_into`` calls)."""
        self.read_bytes = 0

    def resolve(self, name: str) -> str:
        """The checkpoint key of model parameter ``name``.

        Raises:
            UnmatchedParameterError: no key, or several keys, match (names the parameter).
        """
        key = checkpoint_key(name)
        if key in self.entries:
            return key
        # Wrapped or unwrapped models (``bert.`` prefixes...): a unique suffix match.
        hits = [k for k in self.entries if k.endswith("." + key) or key.endswith("." + k)]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            # A loader that renames a middle segment (transformers 5 loads Qwen2.5-VL's saved
            # ``model.layers.N`` as ``model.language_model.layers.N``): the longest tail of the
            # name, of at least three parts, that ends exactly one key. Shape and dtype are still
            # checked against it.
            parts = key.split(".")
            for start in range(1, len(parts) - 2):
                tail = ".".join(parts[start:])
                found = self._by_tail().get(tail, ())
                if len(found) == 1:
                    return found[0]
                if found:
                    hits = list(found)
                    break
        raise UnmatchedParameterError(
            f"parameter {name!r} (checkpoint key {key!r}) matches "
            f"{'no' if not hits else len(hits)} tensor(s) in {self.folder}"
            + (f": {hits[:4]}" if hits else "")
        )

    def _by_tail(self) -> dict[str, list[str]]:
        """Every key under each of its dotted tails (built on first use)."""
        if self._tails is None:
            self._tails = {}
            for k in self.entries:
                parts = k.split(".")
                for start in range(1, len(parts)):
                    self._tails.setdefault(".".join(parts[start:]), []).append(k)
        return self._tails

    def read_into(self, key: str, dst: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Read tensor ``key`` into ``dst``: a contiguous CPU uint8 tensor of its size in
        ``dtype`` (default: the file's dtype). A floating ``dtype`` other than the file's is
        converted on the way (round to nearest even, as ``Tensor.to``), so a model loaded with
        ``torch_dtype=`` streams from a checkpoint stored in another precision."""
        entry = self.entries[key]
        if dtype is not None and dtype != entry.dtype:
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_into(key, raw)
            dst.view(dtype).view(entry.shape).copy_(raw.view(entry.dtype).view(entry.shape))
            return
        fd = self._fd(entry.path)
        view = memoryview(dst.numpy()).cast("B")
        done = 0
        while done < entry.nbytes:
            n = os.preadv(fd, [view[done:]], entry.start + done)
            if n <= 0:
                raise OSError(
                    f"short read of {key!r} from {entry.path} at byte {entry.start + done}"
                )
            done += n
        self.count_reads(1, entry.nbytes)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def count_reads(self, reads: int, nbytes: int) -> None:
        """Add ``reads`` tensors and ``nbytes`` bytes to the read counters (thread-safe)."""
        with self._lock:
            self.reads += reads
            self.read_bytes += nbytes

    def plan(self, pieces: list[tuple[str, int]]) -> list[tuple[Path, int, int, list]]:
        """A read plan for ``pieces`` (checkpoint key, byte offset in a destination buffer):
        runs of tensors that lie back to back in one file, each ``(file, first byte, end byte,
        [(dest offset, nbytes), ...])``, so ``read_plan`` fills a whole block with one vectored read
        per run (a block's tensors are usually contiguous in a safetensors file) instead of one
        read per tensor."""
        ordered = sorted(pieces, key=lambda p: (self.entries[p[0]].path, self.entries[p[0]].start))
        runs: list[list] = []
        for key, dest in ordered:
            entry = self.entries[key]
            if (
                not runs
                or runs[-1][0] != entry.path
                or runs[-1][2] != entry.start
                or len(runs[-1][3]) == IOV_MAX
            ):
                runs.append([entry.path, entry.start, entry.start, []])
            runs[-1][3].append((dest, entry.nbytes))
            runs[-1][2] = entry.start + entry.nbytes
        return [tuple(run) for run in runs]

    def read_plan(
        self,
        runs: list[tuple[Path, int, int, list[tuple[int, int]]]],
        dst: torch.Tensor,
        count: bool = True,
    ) -> None:
        """Execute ``plan``'s runs (or one part of ``split_plan``) into ``dst`` (a contiguous CPU
        uint8 tensor). ``count``: add the pieces read to ``reads`` (a part of a split plan may
        hold a piece of a tensor: the caller counts the block's tensors once instead)."""
        view = memoryview(dst.numpy()).cast("B")
        for path, start, end, pieces in runs:
            fd = self._fd(path)
            buffers = [view[dest : dest + nbytes] for dest, nbytes in pieces]
            want = end - start
            done = os.preadv(fd, buffers, start)  # one vectored read per run
            while done < want:  # continued after a short read (rare)
                n = os.preadv(fd, _after(buffers, done), start + done)
                if n <= 0:
                    raise OSError(f"short read from {path} at byte {start + done}")
                done += n
            self.count_reads(len(pieces) if count else 0, want)

    def load(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh CPU tensor holding checkpoint tensor ``key`` in ``dtype`` (default: the
        file's; see ``read_into``)."""
        entry = self.entries[key]
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        self.read_into(key, raw)
        tensor = raw.view(entry.dtype).view(entry.shape)
        return tensor if dtype is None or dtype == entry.dtype else tensor.to(dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
