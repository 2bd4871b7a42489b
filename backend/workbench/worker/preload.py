"""What a worker imports before its first step, imported with Python's cyclic collector paused.

Importing torch, diffusers, transformers, peft and the worker makes ~760,000 objects that live as
long as the process. While they are made, the collector runs a full (generation-2) collection
each time the objects it tracks grow by a quarter, scanning them all again: 7 such collections
(~1.2 CPU-s on a 2-core machine) in a cold ``workbench train tiny-ci``, and its end's
``gc.collect()`` scans them once more (0.4 CPU-s). ``import_frozen`` pauses the collector while
it imports, then moves everything made so far into the permanent generation (``gc.freeze``),
which no collection scans: that run's collections take ~0.15 CPU-s in all, and the whole run
10.3 CPU-s where it took 14.3. A forked worker inherits the frozen objects (Python's
``gc.freeze`` documentation: the child's collections then write to none of their pages).

Standard library only: the server's fork server and command line import it torch-free.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterable

WORKER_LIBRARIES = (
    "diffusers.models.transformers",
    "diffusers.models.unets",
    "diffusers.models.autoencoders",
    "peft",
    "transformers",
)
"""The libraries a worker imports before its first step, beside its own modules (the model
classes diffusers loads lazily, on first use, among them)."""

TRAIN = ("workbench.cli.train", *WORKER_LIBRARIES)
"""``workbench train``'s module (the worker and the planner) and its libraries: what the command
line imports before a ``train`` and the server's fork server before its first fork."""


def import_frozen(names: Iterable[str]) -> None:
    """Import the modules ``names`` (dotted names) with the cyclic collector paused, then freeze
    every object the process holds (``gc.freeze``) and resume the collector if it was running.

    Raises what the import raises (``ImportError``...); the collector is resumed and what was
    imported so far is frozen all the same."""
    running = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if running:
            gc.enable()
