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


SKIPPED = r"""
import json, sys, tempfile
from pathlib import Path

from workbench.services.calibration import Calibrator
from workbench.store import Store

store = Store(Path(tempfile.mkdtemp()) / "workbench.db")
runs = {}
for name, status, device_name in [("cancelled", "cancelled", "NVIDIA GeForce RTX 4090"),
                                  ("no profile", "succeeded", "Tesla T4")]:
    run_id = store.create_run(name, "tiny-ci", {"name": name}, "default")
    started = {"seq": 0, "time": 100.0, "source": "trainer", "kind": "run_started",
               "device": "cuda:0", "device_name": device_name}
    store.ingest(run_id, [(0, 100.0, "trainer", "run_started", None, None, json.dumps(started))], 1)
    store.update_run(run_id, status=status)
    runs[name] = run_id
calibrator = Calibrator(store)
got = {name: calibrator.calibrate(run_id) for name, run_id in runs.items()}
print(json.dumps({"got": got, "skipped": {n: calibrator.skipped[i] for n, i in runs.items()},
                  "torch": "torch" in sys.modules}))
"""


def test_runs_the_calibration_skips_import_no_torch():
    """A server whose finished runs are all skipped by calibration (not succeeded; a device
    without a plan profile) never imports the torch side for them: the synthetic dashboard
    servers imported it for every first finished run (~10 CPU-s each) to skip it."""
    out = subprocess.run(
        [sys.executable, "-c", SKIPPED], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["got"] == {"cancelled": None, "no profile": None}
    assert (
        report["skipped"]["cancelled"] == "only succeeded runs are calibrated; this one cancelled"
    )
    assert (
        report["skipped"]["no profile"] == "its device (Tesla T4) has no plan profile to calibrate"
    )
    assert report["torch"] is False
