"""SIGTERM, the worker's other way to be stopped (``docs/contracts.md``, "Control").

The control folder's requests are read with ``contract.control.ControlDir``. A ``stop`` request
and SIGTERM both mean: finish the step, save the LoRA, exit 0 with status ``cancelled``.
"""

from __future__ import annotations

import signal
from typing import Any


class StopFlag:
    """Set by SIGTERM (and by a ``stop`` request); checked by the loop between steps."""

    def __init__(self) -> None:
        self.requested = False
        self.reason: str | None = None
        self._previous: Any = None

    def set(self, reason: str) -> None:
        if not self.requested:
            self.requested, self.reason = True, reason

    def __call__(self) -> bool:
        return self.requested

    def install(self) -> None:
        """Route SIGTERM to ``set("sigterm")`` (main thread only; elsewhere a no-op)."""
        try:
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self.set("sigterm"))
        except ValueError:  # not the main thread (an in-process test runner)
            self._previous = None

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
