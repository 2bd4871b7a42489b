"""Fan-out of telemetry lines and run status to websocket subscribers.

The tailer thread calls ``publish_lines`` / ``publish_run``; one ``call_soon_threadsafe`` per
batch moves the batch onto the event loop, where it is appended to each subscriber's own
bounded queue. Each websocket drains its queue into one frame per send, so a slow client gets
bigger frames rather than slowing anyone down, and a client that falls ``max_pending`` records
behind is closed with a reason telling it to reconnect with ``since`` (nothing is lost: the
store has every record).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import Any


class SubscriberState(enum.Enum):
    """LIVE: receiving. OVERFLOWED: fell too far behind, will be closed. CLOSED: unsubscribed."""

    LIVE = "live"
    OVERFLOWED = "overflowed"
    CLOSED = "closed"


class Batch:
    """Lines ingested together; the frame text is built once and shared by every subscriber."""

    __slots__ = ("lines", "_frame")

    def __init__(self, lines: list[tuple[int, str]]) -> None:
        self.lines = lines
        self._frame: str | None = None

    @property
    def first_seq(self) -> int:
        return self.lines[0][0]

    @property
    def frame(self) -> str:
        if self._frame is None:
            self._frame = records_frame(self.lines)
        return self._frame


def records_frame(lines: list[tuple[int, str]]) -> str:
    """``{"records": [...]}`` from stored lines: they are the worker's JSON objects verbatim,
    so they are spliced in, never decoded and re-encoded."""
    return '{"records":[' + ",".join(line for _, line in lines) + "]}"


class Subscriber:
    """One websocket's pending items: ``("lines", Batch)`` or ``("run", dict)``."""

    def __init__(self, run_id: int, max_pending: int) -> None:
        self.run_id = run_id
        self.max_pending = max_pending
        self.items: deque[tuple[str, Any]] = deque()
        self.pending_lines = 0
        self.state = SubscriberState.LIVE
        self.ready = asyncio.Event()

    def push(self, kind: str, payload: Any) -> None:
        if self.state is not SubscriberState.LIVE:
            return
        if kind == "lines":
            self.pending_lines += len(payload.lines)
            if self.pending_lines > self.max_pending:
                self.state = SubscriberState.OVERFLOWED
                self.items.clear()
        if self.state is SubscriberState.LIVE:
            self.items.append((kind, payload))
        self.ready.set()

    async def take(self) -> list[tuple[str, Any]]:
        """Wait for items (or a state change), then return all of them in order."""
        while not self.items and self.state is SubscriberState.LIVE:
            self.ready.clear()
            await self.ready.wait()
        out = list(self.items)
        self.items.clear()
        self.pending_lines = 0
        return out

    def close(self) -> None:
        """Wake ``take`` for good (the websocket went away)."""
        if self.state is SubscriberState.LIVE:
            self.state = SubscriberState.CLOSED
        self.ready.set()


class Hub:
    """Subscribers per run, owned by the event loop ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int = 100_000) -> None:
        self.loop = loop
        self.max_pending = max_pending
        self._subs: dict[int, set[Subscriber]] = {}

    def subscribe(self, run_id: int) -> Subscriber:
        """Call on the loop. Subscribe before replaying from the store so nothing falls between."""
        sub = Subscriber(run_id, self.max_pending)
        self._subs.setdefault(run_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.state = SubscriberState.CLOSED
        subs = self._subs.get(sub.run_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.run_id]

    def subscribers(self, run_id: int) -> int:
        return len(self._subs.get(run_id, ()))

    def publish_lines(self, run_id: int, lines: list[tuple[int, str]]) -> None:
        """Thread-safe: queue ``(seq, raw_line)`` pairs for every subscriber of ``run_id``."""
        self._post(run_id, "lines", lines)

    def publish_run(self, run_id: int, run: dict[str, Any]) -> None:
        """Thread-safe: queue a run status frame for every subscriber of ``run_id``."""
        self._post(run_id, "run", run)

    def _post(self, run_id: int, kind: str, payload: Any) -> None:
        if kind == "lines":
            payload = Batch(payload)
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self._dispatch, run_id, kind, payload)
        except RuntimeError:
            pass  # loop shutting down: subscribers are gone with it

    def _dispatch(self, run_id: int, kind: str, payload: Any) -> None:
        for sub in list(self._subs.get(run_id, ())):
            sub.push(kind, payload)
