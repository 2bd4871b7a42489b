"""The training worker's own host memory before any model: what a plan's host RAM adds to the
runtimes' buffers.

A worker is a Python process that imports torch, diffusers, transformers, peft and the trainer;
their code and data are resident set size before a weight loads (about 440 MiB on this
project's machine with the CPU build of torch). The plan's host RAM counted only the pinned
pools, block masters, host-cache images and tracked device bytes, so the default run's RSS came
out 3.7x its plan. ``worker_baseline_bytes`` measures a fresh process that imports what the
worker imports (10-15 s on a loaded 2-core machine), once per machine and software versions:
the figure is kept in the asset cache (``worker-baseline.json``, keyed by the interpreter and
the versions of torch, diffusers, transformers and peft) and in the process. A CUDA worker adds its CUDA context's host memory,
which a CPU machine cannot measure: a GPU plan states the baseline as measured here.

Still not modelled: what stage 1 leaves in the process (the text encoder and VAE are released
before training, but the allocator keeps some of their pages; RSS is a high-water mark). The
host RAM figure is a lower bound: 0.72 of tiny-ci's measured RSS, 0.88 of the default
preset's over two steps (``tests/plan/test_host_ram.py``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from workbench.worker.assets.cache import AssetError, cache_root

IMPORTS = "import diffusers, peft, psutil, torch, transformers\nimport workbench.worker.run\n"
"""What ``workbench train`` imports before it builds anything (``backend/workbench/worker/run.py``)."""


def _key() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [sys.executable]
    for name in ("torch", "diffusers", "transformers", "peft"):
        try:
            parts.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name}: none")
    return " ".join(parts)


@functools.cache
def worker_baseline_bytes() -> int:
    """RSS (bytes) of a fresh interpreter after the worker's imports: the asset cache's
    figure for this interpreter and these versions, else measured now (a subprocess) and kept
    there; 0 when it cannot be measured."""

    try:
        path = cache_root() / "worker-baseline.json"
    except AssetError:  # no writable cache: measured for this process only
        return _measure()
    key = _key()
    try:
        known = json.loads(path.read_text())
        if known.get("key") == key and int(known["rss_bytes"]) > 0:
            return int(known["rss_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rss = _measure()
    if rss:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "rss_bytes": rss}))
            tmp.replace(path)
        except OSError:
            pass
    return rss


def _measure() -> int:
    code = IMPORTS + "print(psutil.Process().memory_info().rss)\n"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0
