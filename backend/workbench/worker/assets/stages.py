"""A resumable, single-instance build of named stages with progress, for the demo assets.

``run_stages`` takes the cache's build lock (``backend/workbench/worker/asset_status.py``: one build per cache
folder; a second starter gets :class:`BuildBusy`), then for each stage in order: a stage whose
outputs are already complete is kept (``kept``, never rebuilt), any other is built with an
``advance(n)`` callback that moves its progress. Each stage writes its outputs atomically
(``cache.build_once``: a temp folder renamed into place), so a build stopped at any point
resumes at the first stage not complete. Progress goes to the status file (at most every
``STATUS_EVERY_S``) and, on a terminal, to one tqdm bar per stage.

A stage that raises ends the build ``failed``, naming the stage and the error; the stages after
it stay ``pending``, and the next run starts at that stage.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from workbench.worker.asset_status import (
    LOCK_FILE,
    RETRY_HINT,
    BuildState,
    StageState,
    lock_holder,
    write_status,
)

STATUS_EVERY_S = 0.5
"""The status file is rewritten at most this often while a stage advances (seconds)."""


class BuildBusy(RuntimeError):
    """Another process holds this cache's build lock (it is building the same stages)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"the demo assets are already being built by process {pid}")
        self.pid = pid


class Interrupted(BaseException):
    """SIGTERM arrived during the build (raised in the main thread, like KeyboardInterrupt)."""


@dataclass(frozen=True)
class Stage:
    """One step of the build. ``build(advance)`` makes its outputs, calling ``advance(n)`` as
    ``n`` more of ``total`` units are done; ``complete()`` says whether they already exist."""

    name: str
    total: int
    unit: str
    build: Callable[[Callable[[int], None]], None]
    complete: Callable[[], bool]
    seconds_per_unit: float = 0.0
    """The estimate before the stage has measured its own rate (seconds per unit, one core)."""
    provides: dict[str, str] = field(default_factory=dict)
    """Products relative to the cache -> the digest of their ``.complete`` marker."""


@dataclass
class _Tracker:
    """The status dict and its throttled writes."""

    root: Path
    status: dict[str, Any]
    written: float = 0.0

    def save(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.written >= STATUS_EVERY_S:
            write_status(self.root, self.status)
            self.written = now


def _acquire(root: Path, block: bool = False) -> int:
    """Open and lock ``<root>/demo-build.lock`` (exclusive; waiting for it with ``block``, else
    ``BuildBusy``); write our pid."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BuildBusy(lock_holder(root)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


@contextlib.contextmanager
def build_lock(root: Path, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``root``'s build lock, waiting for a build in progress to end first (``log`` is
    told whom it waits for): a worker that builds the demo on demand never builds beside
    ``workbench demo-assets``, and finds what that build made complete."""
    try:
        fd = _acquire(root)
    except BuildBusy as busy:
        if log is not None:
            log(f"waiting for the demo-asset build in process {busy.pid} to end")
        fd = _acquire(root, block=True)
    try:
        yield
    finally:
        os.close(fd)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


def run_stages(
    stages: list[Stage],
    root: Path,
    *,
    stream: TextIO | None = None,
    bar: bool | None = None,
) -> dict[str, Any]:
    """Build ``stages`` in order into ``root`` unless complete; return the final status dict
    (``state`` ``ready`` or ``failed``). ``stream`` (stderr by default) gets the progress bars
    (``bar``: default when it is a terminal) or a line per stage.

    Raises:
        BuildBusy: another process is building in ``root``.
        KeyboardInterrupt, Interrupted: the build was stopped; the status says ``interrupted``
            at the running stage, and the next call resumes there.
    """
    stream = stream if stream is not None else sys.stderr
    bar = stream.isatty() if bar is None else bar
    fd = _acquire(root)
    try:
        old_term = signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:  # not the main thread: SIGTERM keeps its handler
        old_term = None
    rows = [
        {
            "name": s.name,
            "state": StageState.PENDING,
            "done": 0,
            "total": s.total,
            "unit": s.unit,
            "elapsed_s": 0.0,
            "estimate_s": s.total * s.seconds_per_unit,
            "kept": False,
            "error": None,
            "provides": s.provides,
        }
        for s in stages
    ]
    tracker = _Tracker(
        root,
        {
            "state": BuildState.BUILDING,
            "pid": os.getpid(),
            "started_at": time.time(),
            "finished_at": None,
            "failed_stage": None,
            "error": None,
            "traceback": None,
            "stages": rows,
        },
    )
    status = tracker.status
    tracker.save(force=True)
    try:
        for stage, row in zip(stages, rows, strict=True):
            if stage.complete():
                row.update(state=StageState.DONE, done=stage.total, estimate_s=0.0, kept=True)
                tracker.save(force=True)
                stream.write(f"demo assets: {stage.name}: already built, kept\n")
                stream.flush()
                continue
            if not _run_one(stage, row, tracker, stream, bar):
                status.update(state=BuildState.FAILED, failed_stage=stage.name, error=row["error"])
                stream.write(
                    f"demo assets: stage {stage.name!r} failed: {row['error']}\n"
                    f"demo assets: retry with {RETRY_HINT}; the stages already built are kept\n"
                )
                stream.flush()
                break
        else:
            status["state"] = BuildState.READY
    finally:
        status["finished_at"] = time.time()
        tracker.save(force=True)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        os.close(fd)  # releases the lock
    return status


def _run_one(stage: Stage, row: dict, tracker: _Tracker, stream: TextIO, bar: bool) -> bool:
    """Build one stage, keeping ``row`` current; False when it raised (``row["error"]``)."""
    t0 = time.monotonic()
    row["state"] = StageState.RUNNING
    tracker.save(force=True)
    progress = None
    if bar:
        # tqdm comes with huggingface_hub (diffusers, transformers). The size is given, with a
        # fallback: on a pty that reports 0 x 0 (script, some CI) tqdm would draw nothing.
        from tqdm import tqdm

        size = shutil.get_terminal_size((100, 20))
        progress = tqdm(
            total=stage.total,
            desc=f"{stage.name:<14}",
            unit=stage.unit,
            file=stream,
            ncols=min(size.columns, 120),
            nrows=size.lines,
        )
    else:
        stream.write(f"demo assets: {stage.name}: {stage.total} {stage.unit}\n")
        stream.flush()

    def advance(n: int = 1) -> None:
        row["done"] = min(stage.total, row["done"] + n)
        elapsed = time.monotonic() - t0
        rate = elapsed / row["done"] if row["done"] else stage.seconds_per_unit
        row.update(elapsed_s=elapsed, estimate_s=(stage.total - row["done"]) * rate)
        if progress is not None:
            progress.update(n)
        tracker.save()

    try:
        stage.build(advance)
    except (KeyboardInterrupt, Interrupted):
        row.update(state=StageState.INTERRUPTED, elapsed_s=time.monotonic() - t0)
        tracker.status.update(
            state=BuildState.INTERRUPTED,
            failed_stage=stage.name,
            error="the build was stopped (interrupt or SIGTERM)",
        )
        raise
    except Exception as exc:
        row.update(state=StageState.FAILED, error=f"{type(exc).__name__}: {exc}")
        tracker.status["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
        return False
    finally:
        row["elapsed_s"] = time.monotonic() - t0
        if progress is not None:
            progress.close()
    row.update(state=StageState.DONE, done=stage.total, estimate_s=0.0)
    if not bar:
        stream.write(f"demo assets: {stage.name}: done in {row['elapsed_s']:.1f} s\n")
        stream.flush()
    return True
