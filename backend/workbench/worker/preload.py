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

Standard library only: the server's fork server and command line import it torch-free, and it
is imported before torch, so that MKL reads ``MKL_CBWR`` below at its first call.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Iterable

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
"""MKL's strict conditional numerical reproducibility (Intel oneMKL's developer guide, "Obtaining
Numerically Reproducible Results"): its matrix products give the same bits on any thread count.
Without it, on an AVX-512 machine MKL splits a small product's inner dimension across threads:
a Linear (8, 384) x (384, 384) came out 1 ulp apart on 1 and 3 threads, where AVX2 machines gave
equal bits. MKL reads it at its first call, so it is set before anything imports torch; a value
the user set is kept. The demo base takes idle cores only under it
(``workbench.worker.demo.threads_reproducible``); on 2 cores it cost no measurable time
(285-315 ms a demo step on two threads either way)."""

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
