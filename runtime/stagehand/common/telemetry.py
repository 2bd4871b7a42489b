"""One telemetry stream per run: JSONL records with a sequence number, time, step, phase, source.

Every record the runtimes and the trainer write goes through ``Telemetry.emit`` and has the
envelope ``{"seq", "time", "source", "kind", "step", "phase"}`` followed by the record's own
fields, which keep the seeds' names (``activations_spilled``, ``step_id``, ``vram_peak_mb``...).

Sources: ``stagehand`` (weight streaming and layer offload), ``activation_stagehand``,
``conductor``, ``strategy`` (the composed strategy: limits, set-up), ``trainer``.
Kinds: ``block`` (one block event), ``step`` (one per source per step), ``event`` (anything
else, with an ``event`` field naming it), ``limits_applied``, ``stage``, ``error``.

Each record is one line of ``stagehand.config.wire.encode`` (the wire the server reads).

``seq`` increases by one per record and, for a run dir that already holds a stream (resume),
continues from its last record, so the backend can use ``(run, seq)`` as a key.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from stagehand.config.wire import STDOUT_MARKER, encode

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where records go. ``write`` must not raise for ordinary JSON-able records."""

    def write(self, record: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class ListSink:
    """Keeps records in memory (tests, benchmarks)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def of(self, source: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """The records matching ``source`` and ``kind`` (None matches any)."""
        return [
            r
            for r in self.records
            if (source is None or r["source"] == source) and (kind is None or r["kind"] == kind)
        ]


class NullSink(ListSink):
    """Drops every record."""

    def write(self, record: dict[str, Any]) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per line to ``path``; ``flush`` pushes the lines to the OS.

    Lines are written whole (one ``write`` call each), so a reader tailing the file sees at most
    one torn last line. A file that already ends in one (a worker killed mid-write, then
    resumed) is mended first (``mend_torn_tail``), so appended records start lines of their
    own. ``last_seq`` is the highest ``seq`` already in the file (-1 if none).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mend_torn_tail(self.path)
        self.last_seq = _last_seq(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - owned until close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(encode(record) + "\n")

    def flush(self) -> None:
        """Push the lines to the OS and sync them to the disk.

        Raises:
            OSError: the write failed (``ENOSPC`` on a full disk, ``EROFS``...). A file that
                cannot be synced (``EINVAL``: a pipe, a character device) is only flushed.
        """
        if not self._file.closed:
            self._file.flush()
            try:
                os.fsync(self._file.fileno())
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


class TeeStdoutSink:
    """``inner`` (a ``JsonlSink``), and every record also on stdout as ``STDOUT_MARKER`` + the
    same line, so a job log (a Ray job's ``tail_job_logs``) carries the run's telemetry when
    the server cannot read the run folder. Both copies are encoded once, so they are equal.
    """

    def __init__(self, inner: JsonlSink, stream: Any = None) -> None:
        self.inner = inner
        self.last_seq = inner.last_seq
        self.stream = stream if stream is not None else sys.stdout

    def write(self, record: dict[str, Any]) -> None:
        line = encode(record) + "\n"
        self.inner._file.write(line)
        self.stream.write(STDOUT_MARKER + line)

    def flush(self) -> None:
        self.inner.flush()
        self.stream.flush()

    def close(self) -> None:
        self.inner.close()
        self.stream.flush()


def mend_torn_tail(path: Path) -> int:
    """Make ``path`` end at a line's end before anything is appended to it: a last line without
    its newline is finished (a newline added) when it is a whole JSON object, else cut (it is
    the half of a record whose writer died; the records before it are whole and stay). Returns
    the bytes cut (0 when none). A missing or empty file is left as it is.

    Without this, the first record appended to a torn line is glued to it and neither parses:
    that ``seq`` is lost to every reader."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        start = size
        while start > 0:  # the last newline, 64 KiB at a time from the end
            at = max(0, start - 65536)
            f.seek(at)
            found = f.read(start - at).rfind(b"\n")
            if found >= 0:
                start = at + found + 1
                break
            start = at
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            f.seek(size)
            f.write(b"\n")
            return 0
        f.truncate(start)
    log.warning("%s: cut a torn last line of %d bytes before appending", path, size - start)
    return size - start


def _last_seq(path: Path) -> int:
    if not path.exists() or path.stat().st_size == 0:
        return -1
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["seq"])
        except (ValueError, KeyError, TypeError):
            continue  # torn or foreign line
    return -1


def default_telemetry(path: str | os.PathLike[str] | None) -> Telemetry:
    """The stream of a runtime built without one: JSONL appended to ``path`` (relative to the
    working directory, as the seeds' ``activation_telemetry.jsonl``), or nowhere for None.
    The runtime owns it and closes it with itself."""
    return Telemetry(JsonlSink(path)) if path else Telemetry()


class Telemetry:
    """Stamps records with the run's envelope and hands them to one sink.

    ``step`` and ``phase`` are set by whoever drives the step (the composed strategy or the
    trainer); runtimes only call ``emit``. Thread-safe: one lock around stamping and writing.
    """

    def __init__(self, sink: Sink | None = None, flush_interval_s: float | None = None) -> None:
        """``flush_interval_s``: also flush on a time bound, so a record reaches readers of the
        sink (the dashboard tailing the JSONL) within that many seconds even when no step ends
        to flush it (stage 1's caching progress, a long first step). None: only ``flush()``.

        Raises:
            ValueError: ``flush_interval_s`` is not > 0.
        """
        self.sink: Sink = sink if sink is not None else NullSink()
        self._seq = getattr(self.sink, "last_seq", -1) + 1
        self._lock = threading.Lock()
        self.step: int | None = None
        self.phase: str | None = None
        self.tags: dict[str, Any] = {}
        """Fields added to every record while set (``tagged``), e.g. ``sampling: true``."""
        self._dirty = False
        self._error: OSError | None = None
        """What a time-bound flush raised: raised again on the writer's side, at its next
        ``emit`` or ``flush`` (the flusher thread stops), so the run fails with the first error."""
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        if flush_interval_s is not None:
            if not flush_interval_s > 0:
                raise ValueError(f"flush_interval_s must be > 0 seconds, got {flush_interval_s!r}")
            self._flusher = threading.Thread(
                target=self._flush_every,
                args=(flush_interval_s,),
                name="telemetry-flush",
                daemon=True,
            )
            self._flusher.start()

    def _flush_every(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            if self._dirty:
                try:
                    self.flush()
                except OSError as exc:
                    self._error = exc
                    return

    @property
    def next_seq(self) -> int:
        return self._seq

    def emit(self, source: str, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one record and return it (with its envelope)."""
        with self._lock:
            self._raise_flusher_error()
            record = {
                "seq": self._seq,
                "time": time.time(),
                "source": source,
                "kind": kind,
                "step": self.step,
                "phase": self.phase,
                **self.tags,
                **fields,
            }
            self._seq += 1
            self.sink.write(record)
            self._dirty = True
        return record

    @contextlib.contextmanager
    def tagged(self, **tags: Any) -> Iterator[None]:
        """Add ``tags`` to every record emitted inside (the trainer marks the records of a
        sampling step with ``sampling=True``: charts and Compare's series leave them out, as
        that step's number is also a training step's)."""
        before = self.tags
        self.tags = {**before, **tags}
        try:
            yield
        finally:
            self.tags = before

    def flush(self) -> None:
        """Flush the sink.

        Raises:
            OSError: the sink's, or one a time-bound flush met earlier.
        """
        with self._lock:
            self._raise_flusher_error()
            self._dirty = False
            self.sink.flush()

    def _raise_flusher_error(self) -> None:
        if self._error is not None and threading.current_thread() is not self._flusher:
            raise self._error

    def close(self) -> None:
        self._closed.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()
        with self._lock:
            self.sink.close()
