"""The demo-asset build's status file and lock, readable without torch (the backend reads them).

The build (``workbench demo-assets``, ``backend/workbench/worker/assets/stages.py``) runs as ONE process per
cache folder: it holds an exclusive ``flock`` on ``<cache>/demo-build.lock`` for its whole life
(the kernel drops it when the process dies, so a killed build leaves no stale lock) and rewrites
``<cache>/demo-build.json`` atomically (a temp file renamed over it) as its stages advance::

    {"state": "building", "pid": 123, "started_at": 1700000000.0, "finished_at": null,
     "failed_stage": null, "error": null,
     "stages": [{"name": "demo base", "state": "running", "done": 120, "total": 300,
                 "unit": "steps", "elapsed_s": 160.2, "estimate_s": 240.0, "kept": false,
                 "error": null, "provides": {"models/flux-small-digits": "<sha256>"}}, ...]}

``estimate_s`` is the stage's remaining time in seconds. ``provides`` maps each finished product
(relative to the cache) to the digest its ``.complete`` marker holds once built
(``backend/workbench/worker/assets/cache.py``): what a run needs is ready when the marker on disk says so, which
is what :func:`run_refusal` checks.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

MARKER = ".complete"
STATUS_FILE = "demo-build.json"
LOCK_FILE = "demo-build.lock"
RETRY_HINT = "the dashboard's Retry button (POST /api/assets/build) or `workbench demo-assets`"


class BuildState(enum.StrEnum):
    """The build as a whole. ``interrupted``: the file says building but no process holds the
    lock (the build was killed); the next start resumes it."""

    MISSING = "missing"
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class StageState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


def demo_folder(size: str) -> str:
    """The demo's model folder for the Flux-style ``size``, relative to the cache."""
    return f"models/flux-{size}-digits"


def digits_folder(size: int) -> str:
    """The digits image folder at ``size`` px, relative to the cache."""
    return f"data/digits-{int(size)}px"


def write_status(root: Path, status: dict[str, Any]) -> None:
    """Replace ``<root>/demo-build.json`` atomically: a reader sees the old or the new file."""
    path = root / STATUS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, indent=1))
    os.replace(tmp, path)


def read_status(root: Path) -> dict[str, Any] | None:
    """The status file's content, or None when there is none (or it cannot be parsed)."""
    try:
        return json.loads((root / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def lock_holder(root: Path) -> int | None:
    """The pid holding the build lock of ``root`` (0 when it wrote none yet), or None when no
    process holds it. A probe: it takes the lock for an instant when it is free."""
    path = root / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def is_built(root: Path, rel: str, digest: str | None = None) -> bool:
    """True when ``<root>/<rel>/.complete`` exists (and holds ``digest`` when one is given)."""
    try:
        text = (root / rel / MARKER).read_text().strip()
    except OSError:
        return False
    return digest is None or text == digest


def current(root: Path) -> dict[str, Any]:
    """The status file with ``state`` settled against the lock (a ``building`` file whose
    process is gone is ``interrupted``), ``running`` (a process holds the lock), and the total
    ``estimate_s`` left (None when not building)."""
    status = read_status(root) or {"state": BuildState.MISSING, "stages": []}
    holder = lock_holder(root)
    state = BuildState(status.get("state", BuildState.MISSING))
    if state is BuildState.BUILDING and holder is None:
        state = BuildState.INTERRUPTED
        for stage in status["stages"]:
            if stage["state"] == StageState.RUNNING:
                stage["state"] = StageState.INTERRUPTED
        running = next((s for s in status["stages"] if s["state"] == "interrupted"), None)
        status["failed_stage"] = running["name"] if running else None
        status["error"] = "the build process ended before it finished (stopped or killed)"
    status["state"] = state
    status["running"] = holder is not None
    left = [
        s.get("estimate_s") or 0.0 for s in status["stages"] if s["state"] in ("pending", "running")
    ]
    status["estimate_s"] = sum(left) if state is BuildState.BUILDING else None
    status["cache_dir"] = str(root)
    status["now"] = time.time()
    return status


def needed_by(config: dict[str, Any]) -> list[str]:
    """The demo products (relative to the cache) a run config needs before it may start: the
    trained demo model when ``model.pretrained`` is ``digits``, with its digits folder."""
    model = config.get("model") or {}
    if not (model.get("factory") and model.get("pretrained") == "digits"):
        return []
    needs = [demo_folder(model.get("size") or "small")]
    if (config.get("data") or {}).get("factory") == "digits":
        needs.append(digits_folder(config.get("resolution") or 64))
    return needs


def _stage_text(stage: dict[str, Any]) -> str:
    text = f"stage {stage['name']!r} {stage.get('done', 0)}/{stage.get('total', 0)}"
    left = stage.get("estimate_s")
    if left is None:
        return text
    return text + (
        f", about {left:.0f} s left" if left < 90 else f", about {left / 60:.1f} min left"
    )


def run_refusal(
    config: dict[str, Any], root: Path, status: dict[str, Any] | None = None
) -> str | None:
    """Why a run of ``config`` may not start yet, or None. A run whose needed demo products
    (:func:`needed_by`) are all built (their ``.complete`` markers on disk hold the digest the
    build recorded) may start; so may a run needing a product this build does not make (the
    worker builds it itself, as before). ``status``: ``current(root)`` when the caller has
    read it already (one read for many presets)."""
    needs = needed_by(config)
    if not needs:
        return None
    status = status if status is not None else current(root)
    provides: dict[str, str] = {}
    for stage in status["stages"]:
        provides.update(stage.get("provides") or {})
    missing = [rel for rel in needs if not is_built(root, rel, provides.get(rel))]
    if not missing:
        return None
    if status["stages"] and not any(rel in provides for rel in missing):
        return None  # another size or resolution than the build makes: the worker builds it
    state = status["state"]
    what = f"the demo assets it needs ({', '.join(missing)}) are not built yet"
    later = "; other presets and pipeline folders can start meanwhile"
    if state is BuildState.BUILDING:
        stage = next((s for s in status["stages"] if s["state"] == "running"), None)
        now = f" ({_stage_text(stage)})" if stage else ""
        return (
            f"{what}: they are building{now} and this preset can start once they are ready{later}"
        )
    if state in (BuildState.FAILED, BuildState.INTERRUPTED):
        return (
            f"{what}: the build {state} at stage {status.get('failed_stage')!r} "
            f"({status.get('error')}); retry with {RETRY_HINT}{later}"
        )
    return f"{what}: build them with {RETRY_HINT}{later}"
