"""The runs whose worker is gone and whose final status is not stored yet.

A store that cannot be written (a full disk: "database or disk is full") must not lose the end
of a run: before issue 54 the supervisor forgot the worker, the settle failed, and the run stayed
"running" until a restart marked it "crashed", the cause lost. An ``Ending`` stays here until a
try stores it; the supervisor's tick retries the due ones (``SETTLE_RETRY_S`` apart), and an end
stored after the disk was full says so in the run's error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from workbench.executors import Exit, Job
from workbench.services.diskfull import DiskCondition, is_disk_full

log = logging.getLogger("workbench.services.supervisor")

SETTLE_RETRY_S = 0.5
"""Seconds between tries to store the end of a run whose last try failed."""


@dataclass
class Ending:
    """A run whose worker is gone: how it ended, as the supervisor's settle takes it."""

    job: Job
    ended: Exit
    cancel_requested: bool
    pid: int | None
    gone_at_start: bool = False
    at: float = 0.0
    """``time.time()`` when the worker was found gone (0: when it is added)."""
    tries: int = 0
    """Failed tries to store its end."""
    next_try: float = 0.0
    disk_full: bool = False
    """A try failed because the disk was full (the stored error says so)."""


class Endings:
    """Pending ends by run id; ``settle(ending, exit)`` stores one (raising when it cannot).
    Not thread-safe: the supervisor calls it under its lock."""

    def __init__(self, settle: Callable[[Ending, Exit], None], disk: DiskCondition) -> None:
        self._settle = settle
        self.disk = disk
        self._pending: dict[int, Ending] = {}

    def __contains__(self, run_id: int) -> bool:
        return run_id in self._pending

    def add(self, ending: Ending) -> BaseException | None:
        """Store ``ending`` now, or keep it for ``retry_due``; the error of a failed try."""
        ending.at = ending.at or time.time()
        self._pending[ending.job.run_id] = ending
        return self.store(ending.job.run_id)

    def retry_due(self, now: float) -> None:
        """One more try for each pending end whose ``next_try`` has come."""
        for run_id, ending in list(self._pending.items()):
            if now >= ending.next_try:
                self.store(run_id)

    def store(self, run_id: int) -> BaseException | None:
        """One try to store the pending end of ``run_id``: None when stored, else the error,
        counted on the disk condition (logged once per condition) when the disk is full, logged
        with its traceback at a run's first failure otherwise."""
        e = self._pending[run_id]
        ended = e.ended
        if e.disk_full:
            late = f"disk full at {self.disk.path} when the worker ended; its end was stored "
            late += f"{time.time() - e.at:.0f} s later"
            ended = Exit(ended.rc, f"{ended.reason}; {late}" if ended.reason else late)
        try:
            self._settle(e, ended)
        except Exception as exc:
            e.tries += 1
            e.next_try = time.time() + SETTLE_RETRY_S
            if is_disk_full(exc):
                e.disk_full = True
                self.disk.failed(exc, f"storing the end of run {run_id}")
            elif e.tries == 1:
                log.exception("run %d: storing its end failed; retrying", run_id)
            return exc
        del self._pending[run_id]
        if e.tries:
            self.disk.succeeded(f"the end of run {run_id} stored after {e.tries} failed tries")
        return None
