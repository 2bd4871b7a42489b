"""The training worker's own host memory before any model: what a plan's host RAM adds to the
runtimes' buffers.

A worker is a Python process that imports torch, diffusers, transformers, peft and the trainer;
their code and data are resident set size before a weight loads (about 440 MiB on this
project's machine with the CPU build of torch). The plan's host RAM counted only the pinned
pools, block masters, host-cache images and tracked device bytes, so the default run's RSS came
out 3.7x its plan. ``worker_baseline_bytes`` measures a fresh process that imports what the
worker imports, once per planning process. A CUDA worker adds its CUDA context's host memory,
which a CPU machine cannot measure: a GPU plan states the baseline as measured here.

Still not modelled: what stage 1 leaves in the process (the text encoder and VAE are released
before training, but the allocator keeps some of their pages; RSS is a high-water mark). The
host RAM figure is a lower bound: 0.72 of tiny-ci's measured RSS, 0.88 of the default
preset's over two steps (``tests/runtime/plan/test_host_ram.py``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

IMPORTS = "import diffusers, peft, psutil, torch, transformers\nimport runtime.trainer.run\n"
"""What ``workbench train`` imports before it builds anything (``runtime/trainer/run.py``)."""


@functools.cache
def worker_baseline_bytes() -> int:
    """RSS (bytes) of a fresh interpreter after the worker's imports, measured once per
    process (a subprocess, a few seconds); 0 when it cannot be measured (the plan says so)."""
    root = Path(__file__).resolve().parents[2]
    code = IMPORTS + "print(psutil.Process().memory_info().rss)\n"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
            env=env,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0
