"""The run's control folder and SIGTERM (``docs/contracts.md``, "Control").

The backend writes requests to a temp name in ``DIR/control/`` and renames them to
``NNNNNN-<request_id>.json``; the worker reads them in name order between steps and deletes each
after reading. ``{"command": "stop"}`` and SIGTERM both mean: finish the step, save the LoRA,
exit 0 with status ``cancelled``.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUEST_NAME = re.compile(r"^\d{6}-.+\.json$")


@dataclass
class Request:
    """One control request; ``error`` is set (and ``command`` is None) for an unreadable file."""

    name: str
    command: str | None
    request_id: str | None
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ControlDir:
    """Reads and consumes ``DIR/control/NNNNNN-<id>.json`` requests in name order."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "control"
        self.path.mkdir(parents=True, exist_ok=True)

    def poll(self) -> list[Request]:
        """The pending requests, oldest first; each file is deleted once read."""
        out = []
        for p in sorted(self.path.iterdir()):
            if not REQUEST_NAME.match(p.name) or not p.is_file():
                continue  # a temp name still being written
            request_id = p.stem.split("-", 1)[1]
            try:
                body = json.loads(p.read_text(encoding="utf-8"))
                if not isinstance(body, dict) or not isinstance(body.get("command"), str):
                    raise ValueError('expected an object with a "command" string')
                out.append(
                    Request(p.name, body["command"], body.get("request_id", request_id), body)
                )
            except (ValueError, OSError) as exc:
                out.append(Request(p.name, None, request_id, error=f"{type(exc).__name__}: {exc}"))
            p.unlink(missing_ok=True)
        return out


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
