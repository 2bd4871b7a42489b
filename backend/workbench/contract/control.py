"""The run's control folder: how the server asks a running worker to stop or to change its live
limits (``docs/contracts.md``, "Control").

The server writes each request to a temp name in ``DIR/CONTROL_DIR/`` and renames it to
``NNNNNN-<request_id>.json`` (``write_request``; ``NNNNNN`` counts the run's requests, so name
order is sending order). The worker reads them in name order between steps and deletes each after
reading (``ControlDir.poll``). Commands: ``{"command": STOP}`` (finish the step, save the LoRA,
exit with status ``cancelled``) and ``{"command": LIMITS, "limits": {field: value}}`` (the
worker answers with a ``strategy/limits_applied`` record carrying the ``request_id``, or a
``trainer/event`` ``control_rejected`` one).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTROL_DIR = "control"
"""The control folder's name in the run folder."""
STOP = "stop"
LIMITS = "limits"
REQUEST_NAME = re.compile(r"^\d{6}-.+\.json$")
"""A request ready to read; anything else in the folder (a temp name) is still being written."""


def write_request(run_dir: Path, n: int, payload: dict[str, Any]) -> str:
    """Drop ``payload`` as request number ``n`` (0 <= n < 10**6) into ``run_dir``'s control
    folder (temp name, then rename) and return its ``request_id`` (``payload``'s, or a new one).
    """
    request_id = payload.get("request_id") or uuid.uuid4().hex[:12]
    body = {**payload, "request_id": request_id}
    folder = Path(run_dir) / CONTROL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{n:06d}-{request_id}.json"
    tmp = folder / f".{final.name}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, final)
    return request_id


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
        self.path = Path(run_dir) / CONTROL_DIR
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
