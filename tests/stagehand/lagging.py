"""A device that lags the host: the test double of the device layer (``stagehand/common/device.py``).

On CPU every copy completes the moment it is issued, so code that forgets an event, releases a
buffer early or reads a result too soon still passes. Under ``lagging_device(lag)`` every CPU
``TransferStream`` built by the runtimes is a ``LaggingStream``: an in-order queue whose copies
run only when the device gets to them, as a GPU's copy engine does:

- ``record()`` queues an event; the device runs the queue up to it ``lag`` device operations
  later (an operation: a ``record`` or a host ``query``), or at once when the host waits on it;
- ``TransferEvent.wait()`` (the compute stream waits, device-side) and ``synchronize()`` (the
  host waits) run the queue up to the event first: on CPU the compute is the host;
- ``query()`` says whether the device got there, and counts as an operation.

A copy's source is snapshotted when it is queued and compared when it runs: a source changed in
between (a slab released and refilled, a buffer reused) raises ``CopyRaceError``, the error a
real device would turn into silently wrong weights. Lag 0 is today's synchronous CPU behaviour.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from stagehand.common.device import TransferStream

LAGS = (0, 1, 2, 4)


class CopyRaceError(AssertionError):
    """A copy's source changed between the copy's issue and its execution."""


class Clock:
    """Device operations issued so far, and every lagging stream, for one ``lagging_device``."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.ops = 0
        self.streams: list[LaggingStream] = []
        self.copies_run = 0
        self.max_pending = 0
        """The most events queued and not yet run at once: > 0 proves the device lagged."""
        self.host_waits = 0
        """Host waits (``synchronize``) on an event the device had not reached: the host stalled."""

    def tick(self) -> None:
        self.ops += 1
        for stream in self.streams:
            stream.run_due()

    def pending(self) -> int:
        return sum(1 for s in self.streams for item in s.queue if item[0] == "event")

    def drain(self) -> None:
        """Let the device finish everything (what a ``torch.cuda.synchronize()`` would do)."""
        for stream in self.streams:
            stream.run_all()


class LaggingEvent:
    """A ``TransferEvent`` whose copy runs ``lag`` operations after it was recorded."""

    __slots__ = ("stream", "due", "done")

    def __init__(self, stream: LaggingStream, due: int) -> None:
        self.stream, self.due, self.done = stream, due, False

    def query(self) -> bool:
        if not self.done:
            self.stream.clock.tick()
        return self.done

    def wait(self, stream: Any = None) -> None:
        self.stream.run_until(self)

    def synchronize(self) -> None:
        if not self.done:
            self.stream.clock.host_waits += 1
        self.stream.run_until(self)


class LaggingStream(TransferStream):
    """An in-order queue of copies and events (see the module docstring)."""

    clock: Clock  # set per ``lagging_device`` on a subclass

    def __init__(self, device: torch.device | str, priority: int = 0) -> None:
        self.device = torch.device(device)
        self.stream = None
        self.pageable_copies = 0
        self.queue: deque[tuple] = deque()
        self.clock.streams.append(self)

    @contextlib.contextmanager
    def use(self, after: Any = None) -> Iterator[None]:
        yield

    def mark(self) -> None:
        return None

    @property
    def asynchronous(self) -> bool:
        return True

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append(("copy", dst, src, src.detach().clone()))

    def record(self) -> LaggingEvent:
        self.clock.tick()
        event = LaggingEvent(self, self.clock.ops + self.clock.lag)
        self.queue.append(("event", event))
        self.clock.max_pending = max(self.clock.max_pending, self.clock.pending())
        self.run_due()
        return event

    def _run_next(self) -> None:
        item = self.queue.popleft()
        if item[0] == "event":
            item[1].done = True
            return
        _, dst, src, snapshot = item
        if not torch.equal(src, snapshot):
            raise CopyRaceError(
                f"a copy's source ({tuple(src.shape)} {src.dtype}) changed before the device "
                "ran the copy: it was released or reused while the copy was pending"
            )
        # As issued: a copy into a tensor made under inference mode runs in inference mode.
        with torch.inference_mode(dst.is_inference()), torch.no_grad():
            dst.copy_(src)
        self.clock.copies_run += 1

    def run_due(self) -> None:
        """Run the queue up to the last event whose time has come."""
        due = [i for i, item in enumerate(self.queue) if item[0] == "event"]
        last = None
        for i in due:
            if self.queue[i][1].due <= self.clock.ops:
                last = i
        if last is not None:
            for _ in range(last + 1):
                self._run_next()

    def run_until(self, event: LaggingEvent) -> None:
        while not event.done:
            self._run_next()

    def run_all(self) -> None:
        while self.queue:
            self._run_next()


@contextlib.contextmanager
def lagging_device(lag: int) -> Iterator[Clock]:
    """Every CPU ``TransferStream`` built inside is a ``LaggingStream`` with ``lag``."""
    clock = Clock(lag)
    TransferStream.double = type("LaggingStream", (LaggingStream,), {"clock": clock})
    try:
        yield clock
    finally:
        TransferStream.double = None
