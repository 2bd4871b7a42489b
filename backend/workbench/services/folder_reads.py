"""Reads of a folder a request names (``POST /api/pipelines/inspect``, ``POST /api/data/scan``):
each on a thread of its own, at most ``slots`` at once, given up after ``timeout_s``.

Such a read touches whatever the user's folder holds. ``stagehand.config.safe_read`` keeps FIFOs and
devices out (a FIFO named ``zz.safetensors`` held one server thread per inspection, and about 40
of them stopped every route: issue 54), but nothing keeps out a network mount that stops
answering a ``stat``. So a request waits at most ``timeout_s`` for its read and then answers
504 naming the path, while the read goes on alone on its thread. A read that never ends keeps
its slot: at most ``slots`` threads can hang, and a request that finds every slot taken is
answered 503 at once instead of queueing behind them. The server's own threads are each held
at most ``timeout_s``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from workbench.api.errors import ApiError, ErrorBody

T = TypeVar("T")

SLOTS = 4
"""Folder reads running at once (inspections and scans together); a read takes milliseconds to
a few seconds, so 4 are room for several browser tabs while keeping most of the server's 40
threads free when reads hang."""
TIMEOUT_S = float(os.environ.get("STAGEHAND_WORKBENCH_FOLDER_READ_S", "") or 30.0)
"""Seconds a request waits for its read (``STAGEHAND_WORKBENCH_FOLDER_READ_S``): a tiny
pipeline folder inspects in ~1 s on a cold server (diffusers' import), a scan decodes every
image once; 30 s is past both on a slow disk."""
RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorBody, "description": "every folder-read slot is taken (code busy)"},
    504: {"model": ErrorBody, "description": "the folder read took too long (code timeout)"},
}
"""``responses=`` of the routes that read a folder through ``FolderReads``."""


class Busy(ApiError):
    """Every folder-read slot is held by a read still running."""

    status, code = 503, "busy"


class ReadTimeout(ApiError):
    """A folder read did not finish within the time limit."""

    status, code = 504, "timeout"


class FolderReads:
    """At most ``slots`` folder reads at once, each waited for at most ``timeout_s`` seconds."""

    def __init__(self, slots: int = SLOTS, timeout_s: float = TIMEOUT_S) -> None:
        self.slots = slots
        self.timeout_s = timeout_s
        self._free = threading.BoundedSemaphore(slots)

    def run(self, read: Callable[[], T], *, path: str, field: str) -> T:
        """``read()`` on a thread of its own; what it returns or raises.

        ``path`` (the folder, as the request gave it) and ``field`` (the request field naming
        it) go into the errors.

        Raises:
            Busy (503): ``slots`` reads are running (some may hang); none is started.
            ReadTimeout (504): ``read`` ran past ``timeout_s``; it goes on alone, in its slot.
        """
        if not self._free.acquire(blocking=False):
            raise Busy(
                f"{field}: {_shown(path)} not read: {self.slots} folder reads are still running "
                "(a folder that does not answer, such as a stalled network mount); try again later"
            )
        done: Future[T] = Future()

        def work() -> None:
            try:
                done.set_result(read())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                done.set_exception(exc)
            finally:
                self._free.release()

        threading.Thread(target=work, name=f"folder-read {path[:40]}", daemon=True).start()
        try:
            return done.result(timeout=self.timeout_s)
        except TimeoutError:
            if done.done():  # the read's own TimeoutError (ETIMEDOUT from a mount)
                raise
            raise ReadTimeout(
                f"{field}: reading {_shown(path)} took over {self.timeout_s:g} s (the time limit, "
                "STAGEHAND_WORKBENCH_FOLDER_READ_S); something in the folder does not answer",
                field=field,
            ) from None


def _shown(path: str) -> str:
    return repr(path[:200]) + ("..." if len(path) > 200 else "")


READS = FolderReads()
"""The server's one set of folder-read slots (tests set ``timeout_s`` or replace it)."""
