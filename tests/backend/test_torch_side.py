"""``workbench.services.torch_side``: the server's first request that needs torch imports the
planner and the worker's libraries as a cold worker does (collector paused, then frozen)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import gc, json, sys, tempfile
from pathlib import Path

from tests.backend.inprocess import in_process
from workbench.worker.preset import load_preset

freezes = []
freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), freeze())[1]
client = in_process(Path(tempfile.mkdtemp()) / "data")
report = {"torch_at_start": "torch" in sys.modules}
full = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                    and full.append(len(gc.get_objects(2))))
_, config = load_preset("tiny-ci")
response = client.post("/api/plan", json={"preset": config, "device": "rtx4090"})
report.update(status=response.status_code, fits=response.json().get("fits"),
              full=len(full), frozen=gc.get_freeze_count(), enabled=gc.isenabled(),
              modules=all(m in sys.modules for m in ("torch", "diffusers", "peft", "transformers")))
again = client.post("/api/plan", json={"preset": config, "device": "rtx4090"})
report.update(again=again.status_code, freezes=len(freezes))
client.__exit__(None, None, None)
print(json.dumps(report))
"""


def test_the_first_plan_imports_torch_with_no_full_collection_and_freezes_it():
    """The app starts without torch; its first ``POST /api/plan`` imports the planner, torch,
    diffusers, transformers and peft with no full collection (6 before) and freezes 100,000
    objects or more; a second plan freezes nothing again (the import is done once)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["torch_at_start"] is False
    assert report["status"] == 200 and report["fits"] is True
    assert report["modules"] and report["enabled"]
    assert report["full"] == 0
    assert report["frozen"] >= 100_000
    assert report["again"] == 200 and report["freezes"] == 1
