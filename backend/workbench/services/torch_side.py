"""The server's torch side (the planner, the worker's pipeline readers and their libraries),
imported the first time a request needs it.

The server starts without torch (``workbench.cli``). Its first plan, pipeline inspection, data
scan, tune or calibration imports the planner with torch, diffusers, transformers and peft:
~700,000 objects the server then keeps for its life. ``import_torch_side`` imports them as a cold
worker does (``workbench.worker.preload.import_frozen``: the cyclic collector paused, then every
object frozen, the server's own with them), so that import runs no full collection (6 before,
each over everything imported so far) and none later scans them: the server's first plan of the
default preset took 8.4-10.1 CPU-s on 2 cores, 6.3-7.9 this way. Later calls return at once.
"""

from __future__ import annotations

import sys
import threading

from workbench.worker.preload import WORKER_LIBRARIES, import_frozen

MODULES = ("workbench.plan", "workbench.worker.pipelines", *WORKER_LIBRARIES)
"""What the server's torch side imports (dotted module names)."""

_lock = threading.Lock()


def _imported() -> bool:
    return all(name in sys.modules for name in MODULES)


def import_torch_side() -> None:
    """Import ``MODULES`` once (``import_frozen``); a no-op once they are imported.

    Raises what their import raises (``ImportError``: a broken install)."""
    if _imported():
        return
    with _lock:
        if not _imported():
            import_frozen(MODULES)
