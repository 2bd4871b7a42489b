"""A full disk under the data dir: which errors say so, and one ``DiskCondition`` per data dir.

A full disk fails every write of every request, tailer poll and supervisor tick at once (issue
54: 10,398 tracebacks in 126 s). The condition turns that into two log lines: one when writes
start failing (the first failure, with the path and the free bytes) and one when they succeed
again. The API answers 507 while it holds (``workbench.api.errors``), the supervisor launches
nothing and retries the end of a run whose worker died (``workbench.services.supervisor``), and
``GET /api/system/disk`` tells the dashboard, which shows "disk full at PATH".
"""

from __future__ import annotations

import errno
import logging
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("workbench.services.diskfull")

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""OSError errnos of a full disk: no space left, over quota."""

FREED_BYTES = 1 << 20
"""Bytes freed under the path since the first failure (1 MiB) after which the condition clears
without waiting for a write to succeed: the dashboard's banner goes when space was freed, on an
idle server too. A write that fails again starts a new condition."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk is full: sqlite's
    ``SQLITE_FULL`` ("database or disk is full") or an ``OSError`` with ``ENOSPC`` /
    ``EDQUOT``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, sqlite3.OperationalError):
            code = getattr(exc, "sqlite_errorcode", None)
            if (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or (
                "database or disk is full" in str(exc)
            ):
                return True
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this process on the filesystem of ``path`` (of its nearest existing
    folder when ``path`` does not exist); None when it cannot be read."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


class DiskCondition:
    """Whether writes under ``path`` (the data dir) fail for a full disk. Thread-safe.

    ``failed`` marks a failed write and logs the first one; ``succeeded`` (a write went through)
    and ``refresh`` (``FREED_BYTES`` freed since) clear it and log that once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.since: float | None = None
        """``time.time()`` of the first failed write of the condition; None while writes work."""
        self.failures = 0
        """Writes failed since ``since``."""
        self.free_at_failure: int | None = None
        """Free bytes (``free_bytes``) at the first failure."""

    @property
    def full(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, where: str) -> None:
        """A write of ``where`` ("POST /api/presets", "recording the end of run 3") failed on
        ``exc``, a disk-full error (``is_disk_full``). Logs a warning at the first failure of a
        condition only."""
        with self._lock:
            self.failures += 1
            if self.since is not None:
                return
            self.since = time.time()
            self.free_at_failure = free_bytes(self.path)
        log.warning(
            "disk full at %s (%s bytes free): %s failed: %s; writes fail until space is freed "
            "(further failures are not logged)",
            self.path,
            self.free_at_failure,
            where,
            exc,
        )

    def succeeded(self, where: str) -> None:
        """A write of ``where`` went through: the condition (if any) is over; logs that once."""
        with self._lock:
            if self.since is None:
                return
            lasted, failures = time.time() - self.since, self.failures
            self.since, self.failures, self.free_at_failure = None, 0, None
        log.warning(
            "disk writes at %s succeed again (%s) after %.1f s and %d failed writes; %s bytes free",
            self.path,
            where,
            lasted,
            failures,
            free_bytes(self.path),
        )

    def refresh(self) -> None:
        """Clear the condition when ``FREED_BYTES`` were freed under the path since it began."""
        start = self.free_at_failure
        if self.since is None or start is None:
            return
        free = free_bytes(self.path)
        if free is not None and free - start >= FREED_BYTES:
            self.succeeded(f"{free - start} bytes freed")

    def status(self) -> dict[str, Any]:
        """``{full, path, free_bytes, since, failures, message}`` (bytes; ``since``: seconds
        since the epoch, null while writes work; ``message``: "disk full at PATH: N bytes
        free", null while writes work), after a ``refresh``."""
        self.refresh()
        free = free_bytes(self.path)
        since = self.since
        return {
            "full": since is not None,
            "path": str(self.path),
            "free_bytes": free,
            "since": since,
            "failures": self.failures,
            "message": self.message(free) if since is not None else None,
        }

    def message(self, free: int | None = None) -> str:
        """``"disk full at PATH: N bytes free"``."""
        free = free_bytes(self.path) if free is None else free
        return f"disk full at {self.path}: {'unknown' if free is None else free} bytes free"


_CONDITIONS: dict[Path, DiskCondition] = {}
_CONDITIONS_LOCK = threading.Lock()


def condition(data_dir: str | Path) -> DiskCondition:
    """The one ``DiskCondition`` of ``data_dir`` in this process (the API's error handler, the
    supervisor and the tailer of one server share it; apps over other data dirs have theirs)."""
    path = Path(data_dir).resolve()
    with _CONDITIONS_LOCK:
        found = _CONDITIONS.get(path)
        if found is None:
            found = _CONDITIONS[path] = DiskCondition(path)
        return found
