"""Tail each active run's ``telemetry.jsonl``: every record exactly once, torn lines held back.

The promise is TensorBoard ``directory_watcher``'s: a reader that resumes from a byte offset
delivers each complete line once and never a partial one. ``JsonlTail`` keeps the offset just
past the last complete line; bytes after it (a line the worker is still writing) are re-read on
the next poll. ``Tailer`` polls the files of active runs on one thread, ingests new lines into
the store in one transaction per batch (the offset is stored with them, so a restarted server
resumes exactly where it stopped), then hands the batch to the ``Hub`` for websocket fan-out.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stagehand.config.wire import decode
from workbench.services.diskfull import condition, is_disk_full
from workbench.services.hub import Hub
from workbench.store import Store

log = logging.getLogger("workbench.services.tailer")

MAX_READ_BYTES = 8 << 20
"""Bytes read per file per poll: a long backlog is ingested in several batches."""


@dataclass
class Line:
    """One complete telemetry line with its envelope parsed out."""

    seq: int
    time: float | None
    source: str | None
    kind: str | None
    step: int | None
    phase: str | None
    raw: str
    record: dict = field(repr=False, default_factory=dict)

    def row(self) -> tuple:
        return (self.seq, self.time, self.source, self.kind, self.step, self.phase, self.raw)


def parse_line(raw: str) -> Line | None:
    """The line's envelope, or None for a line that is not a telemetry record.

    ``raw`` is kept as the record's text (pages and the websocket send it as it is), so a line
    with ``NaN``/``Infinity`` (Python's json writes them; JSON and browsers reject them) is
    rewritten with ``null`` in their place (``stagehand.config.wire.decode``).
    """
    try:
        rec, raw = decode(raw)
        seq = int(rec["seq"])
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(rec, dict):
        return None
    step = rec.get("step")
    return Line(
        seq=seq,
        time=rec.get("time") if isinstance(rec.get("time"), (int, float)) else None,
        source=rec.get("source") if isinstance(rec.get("source"), str) else None,
        kind=rec.get("kind") if isinstance(rec.get("kind"), str) else None,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        phase=rec.get("phase") if isinstance(rec.get("phase"), str) else None,
        raw=raw,
        record=rec,
    )


@dataclass
class JsonlTail:
    """Reads complete lines appended to ``path`` after byte ``offset``."""

    path: Path
    offset: int = 0
    skipped: int = field(default=0)
    """Complete lines that were not telemetry records (not JSON, no ``seq``)."""

    def read(self) -> list[Line]:
        """New complete lines since the last call; advances ``offset`` past them only."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            # Truncated or replaced: the worker never does this; start over and let the
            # (run, seq) key drop what the store already has.
            log.warning("%s shrank from %d to %d bytes; re-reading", self.path, self.offset, size)
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(size - self.offset, MAX_READ_BYTES))
        end = chunk.rfind(b"\n")
        if end < 0:
            return []  # only a torn line so far
        lines = []
        for raw in chunk[: end + 1].splitlines():
            if not raw.strip():
                continue
            line = parse_line(raw.decode("utf-8", errors="replace"))
            if line is None:
                self.skipped += 1
                continue
            lines.append(line)
        self.offset += end + 1
        return lines

    def rewind(self, offset: int, lines: list[Line]) -> None:
        """Make the next ``read`` return ``lines`` again (their ingest failed)."""
        self.offset = offset

    def finish(self) -> None:
        """Nothing to wait for: the worker's last ``flush`` reached the file before it exited."""


class Tailer:
    """One thread polling the telemetry files of the runs it watches, every ``interval_s``
    (s) while it watches any; with none, it sleeps until ``watch`` or ``stop`` wakes it (a
    server without a run polled at 100 Hz for nothing: ~5% of a core, measured idle here)."""

    def __init__(self, store: Store, hub: Hub, interval_s: float = 0.01) -> None:
        self.store = store
        self.hub = hub
        self.interval_s = interval_s
        self._tails: dict[int, JsonlTail] = {}  # or any TelemetrySource (workbench.executors)
        self._lock = threading.Lock()  # held while a run's file is read and ingested
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by watch() and stop(): the idle loop goes on
        self._thread: threading.Thread | None = None

    def watch(self, run_id: int, source) -> None:
        """Start ingesting ``source`` (a ``JsonlTail``, or an executor's ``TelemetrySource``)
        for ``run_id``; a run already watched keeps its source."""
        with self._lock:
            if run_id not in self._tails:
                self._tails[run_id] = source
        self._wake.set()

    def drain(self, run_id: int, forget: bool = True) -> int:
        """Ingest everything complete in the run's file now; with ``forget``, stop watching.

        Called by the supervisor after the worker exited, before it publishes the final status,
        so subscribers see every record before the run frame that ends the run.
        """
        with self._lock:
            tail = self._tails.get(run_id)
        if tail is not None:
            tail.finish()  # outside the lock: a log stream may wait for its last lines
        with self._lock:
            tail = self._tails.get(run_id)
            n = 0
            if tail is not None:
                while True:
                    got = self._ingest(run_id, tail)
                    n += got
                    if got == 0:
                        break
                if forget:
                    del self._tails[run_id]
        return n

    def _ingest(self, run_id: int, tail: JsonlTail) -> int:
        before = tail.offset
        lines = tail.read()
        if not lines and tail.offset == before:
            return 0
        try:
            self.store.ingest(
                run_id, [ln.row() for ln in lines], tail.offset, [ln.record for ln in lines]
            )
        except Exception:
            tail.rewind(before, lines)  # retry the same records next poll: nothing is lost
            raise
        if lines:
            self.hub.publish_lines(run_id, [(ln.seq, ln.raw) for ln in lines])
        return max(len(lines), 1)

    def poll_once(self) -> None:
        """Ingest what each watched file has new. A full disk is counted on the data dir's
        condition (``workbench.services.diskfull``: logged once, not at each poll)."""
        disk = condition(self.store.path.parent)
        with self._lock:
            for run_id, tail in list(self._tails.items()):
                try:
                    if self._ingest(run_id, tail) and disk.full:
                        disk.succeeded(f"telemetry of run {run_id} stored")
                except Exception as exc:
                    if is_disk_full(exc):
                        disk.failed(exc, f"storing telemetry of run {run_id}")
                    else:
                        log.exception("ingesting telemetry of run %d failed; will retry", run_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="telemetry-tailer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._tails
            if idle:
                # A watch() after the check has set the event: the wait returns at once.
                self._wake.wait()
                self._wake.clear()
                continue
            if self._stop.wait(self.interval_s):
                break
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll_once()
