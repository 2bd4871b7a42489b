"""SIGTERM, the worker's other way to be stopped (``docs/contracts.md``, "Control").

The control folder's requests are read with ``workbench.contract.control.ControlDir``. A ``stop`` request
and SIGTERM both mean: finish the step, save the LoRA, exit 0 with status ``cancelled``. Work a
stopped run may drop (its final samples, drawn after the LoRA is saved) runs ``interruptible``:
a SIGTERM then ends it at once, rather than at the SIGKILL the server sends after it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class Interrupted(BaseException):
    """SIGTERM during ``StopFlag.interruptible`` work. A BaseException, as KeyboardInterrupt is:
    no ``except Exception`` on the way (a sampler's, a pipeline's) swallows it."""


class StopFlag:
    """Set by SIGTERM (and by a ``stop`` request); checked by the loop between steps."""

    def __init__(self) -> None:
        self.requested = False
        self.reason: str | None = None
        self.terminated = False
        """A SIGTERM arrived (whatever the first reason was)."""
        self._interrupt = False
        self._previous: Any = None

    def set(self, reason: str) -> None:
        if not self.requested:
            self.requested, self.reason = True, reason

    def __call__(self) -> bool:
        return self.requested

    def _on_sigterm(self, *_: Any) -> None:
        self.set("sigterm")
        self.terminated = True
        if self._interrupt:
            self._interrupt = False  # one Interrupted per block
            raise Interrupted("SIGTERM")

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block that a SIGTERM ends by raising ``Interrupted`` (in the main thread, at its
        next Python bytecode) instead of only setting the flag."""
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def install(self) -> None:
        """Route SIGTERM to the flag (main thread only; elsewhere a no-op)."""
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (an in-process test runner)
            self._previous = None

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
