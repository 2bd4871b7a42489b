"""``workbench.worker.preload``: a cold ``workbench train`` imports its libraries with the cyclic
collector paused and freezes what they made, so no full collection scans them again."""

import json
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
