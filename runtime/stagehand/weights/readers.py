"""Reader threads: one block's read shared by every reader, then its H2D copy issued.

Before, a block was read by one reader thread from start to end, so reads ran as many at once as
blocks were in flight (2 by default), whatever ``reader_threads`` said: on an H100 host 8 readers
gave nothing while a deeper pipeline halved the step (measured; page cache ->
pinned memory: 4.4 GB/s on one thread, 13.9 on 4, 22.8 on 8). Now a block's read plan is cut
into one part per reader (``sources.split_plan``: positional reads, so parts need no order), each
part is a task, and the reader that finishes the last part runs the block's ``finish`` (host
masters and converted tensors, then the H2D copy). No task waits on another task, so the pool
cannot deadlock however many blocks are queued; parts run in submission order (FIFO), so the
block needed first is read first. ``os.preadv`` releases the GIL: the parts read in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from stagehand.common.device import TransferEvent


class _Join:
    """Counts a block's parts down; the last one runs ``finish`` and completes ``future``
    (with the first part's error instead, if a part failed: ``finish`` is not run)."""

    __slots__ = ("left", "lock", "error", "finish", "future")

    def __init__(self, parts: int, finish: Callable[[], Any]) -> None:
        self.left, self.lock, self.error = parts, threading.Lock(), None
        self.finish, self.future = finish, Future()

    def part(self, read: Callable[[], None]) -> None:
        try:
            read()
        except BaseException as exc:  # reported through the future, never lost in the pool
            with self.lock:
                self.error = self.error or exc
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        if self.error is not None:
            self.future.set_exception(self.error)
            return
        try:
            self.future.set_result(self.finish())
        except BaseException as exc:
            self.future.set_exception(exc)


class Readers:
    """``threads`` reader threads (``reader_threads``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="stagehand-read")

    def stage(self, parts: Sequence[Callable[[], None]], finish: Callable[[], Any]) -> Future:
        """Run each of ``parts`` on a reader, then ``finish`` on the reader that ran the last;
        the future holds ``finish``'s result or the first error."""
        join = _Join(len(parts), finish)
        for read in parts:
            self.pool.submit(join.part, read)
        return join.future

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


class StagedCopy:
    """The ``TransferEvent`` of a block read and copied on a reader thread: complete when the
    reader staged the block and the H2D copy it issued finished. Waiting on it first waits (on
    the host) for the reader, then as on the copy's own event.

    A reader that failed (a short read, a file gone) is complete as far as its staging goes
    (``query``, ``synchronize``: its slab may be reused, nothing reads it any more); its error
    is raised where the block's data would be used (``wait``, from ``TransferEngine.ready``).
    """

    __slots__ = ("future",)

    def __init__(self, future: Future[TransferEvent]) -> None:
        self.future = future

    def query(self) -> bool:
        future = self.future
        return future.done() and (future.exception() is not None or future.result().query())

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.future.result().wait(stream)  # raises the reader's error

    def synchronize(self) -> None:
        if self.future.exception() is None:  # waits for the reader
            self.future.result().synchronize()

    def wait_quietly(self) -> None:
        """``wait`` on the current stream without raising: a failed read issued no copy."""
        if self.future.exception() is None:  # waits for the reader
            self.future.result().wait()
