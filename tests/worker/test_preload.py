"""``workbench.worker.preload``: a cold ``workbench train`` imports its libraries with the cyclic
collector paused and freezes what they made, so no full collection scans them again."""

import json
import os
import subprocess
import sys

PROBE = r"""
import gc, json, sys

full = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                    and full.append(len(gc.get_objects(2))))
from workbench.cli import main
try:
    main(["train", "--help"])  # the command's imports, then argparse's exit
except SystemExit:
    pass
report = {"full_during_imports": len(full), "frozen": gc.get_freeze_count(),
          "enabled": gc.isenabled(), "torch": "torch" in sys.modules, "peft": "peft" in sys.modules}
gc.collect()
report["scanned_after"] = len(gc.get_objects(2))

from workbench.worker.preload import import_frozen
try:
    import_frozen(["json", "workbench.no_such_module"])
    report["raised"] = None
except ImportError as exc:
    report["raised"] = type(exc).__name__
report["enabled_after_error"] = gc.isenabled()
print(json.dumps(report))
"""


def test_a_cold_train_freezes_its_libraries_and_no_full_collection_scans_them():
    """``workbench train``'s imports (the worker, the planner, diffusers, transformers, peft) run
    with no full collection (7 before, each over every object made so far) and end frozen:
    100,000 objects or more, and a full collection afterwards scans under a tenth of that. An
    import that fails leaves the collector running."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["torch"] and report["peft"]
    assert report["full_during_imports"] == 0
    assert report["frozen"] >= 100_000
    assert report["enabled"]
    assert report["scanned_after"] < report["frozen"] / 10
    assert report["raised"] == "ModuleNotFoundError"
    assert report["enabled_after_error"]


GEMM = r"""
import json, os, sys
import workbench.worker.preload  # before torch, as the command line, worker and fork server
import torch
from workbench.worker.demo import threads_reproducible

torch.manual_seed(0)
unequal = []
# The demo base's products, among them a Linear (8, 384) x (384, 384) that an AVX-512 machine's
# MKL gave 1 ulp apart on 1 and 3 threads outside the strict mode.
for m, n, k in [(8, 384, 384), (1, 64, 384), (8, 64, 1536), (64, 64, 1536), (256, 64, 1536)]:
    a, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    outs = []
    for threads in (1, 3):
        torch.set_num_threads(threads)
        outs.append(torch.nn.functional.linear(a, w, b))
    if not torch.equal(*outs):
        unequal.append([m, n, k])
print(json.dumps({"mode": os.environ.get("MKL_CBWR"), "reproducible": threads_reproducible(),
                  "mkl": torch.backends.mkl.is_available(), "unequal": unequal}))
"""


def test_matrix_products_give_the_same_bits_on_any_thread_count():
    """A process that imports ``preload`` first (the command line, the worker, the fork server)
    runs MKL in its strict reproducible mode: the same bits on 1 and 3 threads, which the demo
    base's ``CoreShare`` relies on. A mode the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", GEMM], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["mode"] == "AUTO,STRICT"
    assert got["unequal"] == []
    assert got["reproducible"] is got["mkl"]
    env["MKL_CBWR"] = "COMPATIBLE"
    out = subprocess.run(
        [sys.executable, "-c", GEMM], env=env, capture_output=True, text=True, check=True
    )
    kept = json.loads(out.stdout.splitlines()[-1])
    assert kept["mode"] == "COMPATIBLE" and kept["reproducible"] is False
