"""The resumable stage runner of the demo-asset build (backend/workbench/worker/assets/stages.py) with small stage
functions injected: an interrupted build resumes without rebuilding what it finished, a failing
stage is named with its error and retried from there, two starters never build at once, and the
status file carries each stage's progress. The last test runs the real stages on a tiny spec."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.worker import asset_status
from workbench.worker.asset_status import current, read_status, run_refusal
from workbench.worker.assets import stages as stages_mod
from workbench.worker.assets.cache import build_once, is_complete, spec_hash
from workbench.worker.assets.stages import BuildBusy, Stage, run_stages

REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """Stages writing one file each through ``build_once``; counts how often each was built and
    can fail or be interrupted on demand."""

    def __init__(self, root: Path, names=("one", "two", "three"), total: int = 4) -> None:
        self.root, self.names, self.total = root, names, total
        self.builds: dict[str, int] = dict.fromkeys(names, 0)
        self.fail: dict[str, BaseException] = {}
        self.seen: list[dict] = []  # the status file as a stage saw it mid-build

    def folder(self, name: str) -> Path:
        return self.root / "parts" / name

    def stage(self, name: str) -> Stage:
        def build(advance) -> None:
            if name in self.fail:
                raise self.fail.pop(name)

            def _write(tmp: Path) -> None:
                for _ in range(self.total):
                    advance(1)
                    self.seen.append(read_status(self.root))
                (tmp / "out.txt").write_text(name)
                self.builds[name] += 1

            build_once(self.folder(name), {"name": name}, _write)

        digest = spec_hash({"name": name})
        return Stage(
            name,
            self.total,
            "units",
            build,
            lambda: is_complete(self.folder(name), digest),
            seconds_per_unit=2.0,
            provides={f"parts/{name}": digest},
        )

    def stages(self) -> list[Stage]:
        return [self.stage(n) for n in self.names]


@pytest.fixture(autouse=True)
def every_write(monkeypatch):
    monkeypatch.setattr(stages_mod, "STATUS_EVERY_S", 0.0)  # every advance reaches the file


def _states(status: dict) -> list[tuple[str, str, bool]]:
    return [(s["name"], s["state"], s["kept"]) for s in status["stages"]]


def test_progress_per_stage_reaches_the_status_file(tmp_path, capsys):
    rec = Recorder(tmp_path)
    status = run_stages(rec.stages(), tmp_path, bar=False)
    assert status["state"] == "ready" and rec.builds == {"one": 1, "two": 1, "three": 1}
    first = [s for s in rec.seen if s["stages"][0]["state"] == "running"]
    assert [s["stages"][0]["done"] for s in first] == [1, 2, 3, 4]
    mid = first[1]["stages"][0]  # 2 of 4 done: the estimate left is the measured rate x 2
    assert mid["estimate_s"] == pytest.approx(mid["elapsed_s"], rel=0.5)
    assert first[1]["stages"][1]["state"] == "pending"
    assert first[1]["stages"][1]["estimate_s"] == 8.0  # 4 units x 2 s a priori
    assert [s["state"] for s in read_status(tmp_path)["stages"]] == ["done"] * 3
    assert "one: done in" in capsys.readouterr().err


def test_interrupted_after_stage_one_resumes_without_rebuilding_it(tmp_path):
    rec = Recorder(tmp_path)
    rec.fail["two"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        run_stages(rec.stages(), tmp_path, bar=False)
    status = current(tmp_path)
    assert status["state"] == "interrupted" and status["failed_stage"] == "two"
    assert _states(status) == [
        ("one", "done", False),
        ("two", "interrupted", False),
        ("three", "pending", False),
    ]
    mtime = (rec.folder("one") / "out.txt").stat().st_mtime_ns
    status = run_stages(rec.stages(), tmp_path, bar=False)
    assert status["state"] == "ready"
    assert rec.builds == {"one": 1, "two": 1, "three": 1}  # stage one was not rebuilt
    assert _states(status)[0] == ("one", "done", True)
    assert (rec.folder("one") / "out.txt").stat().st_mtime_ns == mtime


def test_a_failing_stage_is_named_and_the_retry_starts_there(tmp_path, capsys):
    rec = Recorder(tmp_path)
    rec.fail["two"] = OSError(28, "No space left on device")
    status = run_stages(rec.stages(), tmp_path, bar=False)
    assert status["state"] == "failed" and status["failed_stage"] == "two"
    assert status["error"] == "OSError: [Errno 28] No space left on device"
    assert "OSError" in status["traceback"]
    assert _states(status) == [
        ("one", "done", False),
        ("two", "failed", False),
        ("three", "pending", False),
    ]
    err = capsys.readouterr().err
    assert "stage 'two' failed: OSError: [Errno 28] No space left on device" in err
    assert "retry with the dashboard's Retry button" in err
    assert current(tmp_path)["state"] == "failed"
    status = run_stages(rec.stages(), tmp_path, bar=False)
    assert status["state"] == "ready" and status["failed_stage"] is None
    assert rec.builds == {"one": 1, "two": 1, "three": 1}
    assert [s["kept"] for s in status["stages"]] == [True, False, False]


_STARTER = """
import sys, time
from pathlib import Path
from workbench.worker.assets.stages import BuildBusy, Stage, run_stages
root, mark = Path(sys.argv[1]), Path(sys.argv[2])

def build(advance):
    with open(mark, "a") as f:
        f.write("built\\n")
    time.sleep(float(sys.argv[3]))
    (root / "slow.done").write_text("1")
    advance(1)

stage = Stage("slow", 1, "units", build, lambda: (root / "slow.done").exists())
try:
    print(run_stages([stage], root, bar=False)["state"])
except BuildBusy as exc:
    print("busy", exc.pid)
"""


def _starter(root: Path, mark: Path, sleep_s: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-c", _STARTER, str(root), str(mark), str(sleep_s)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_concurrent_starters_build_once(tmp_path):
    mark = tmp_path / "builds.txt"
    procs = [_starter(tmp_path, mark, 2.0) for _ in range(2)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs[0].startswith("busy ") and outs[1] == "ready", outs
    assert int(outs[0].split()[1]) in {p.pid for p in procs}  # it names the builder
    assert mark.read_text() == "built\n"
    assert asset_status.lock_holder(tmp_path) is None  # released when the builder ended


def test_a_killed_build_leaves_no_lock_and_reads_as_interrupted(tmp_path):
    mark = tmp_path / "builds.txt"
    proc = _starter(tmp_path, mark, 60.0)
    deadline = time.monotonic() + 30
    while not mark.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    assert asset_status.lock_holder(tmp_path) == proc.pid
    assert current(tmp_path)["state"] == "building"
    with pytest.raises(BuildBusy):
        run_stages([], tmp_path, bar=False)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    status = current(tmp_path)
    assert status["state"] == "interrupted" and status["failed_stage"] == "slow"
    assert status["running"] is False and status["stages"][0]["state"] == "interrupted"


def test_real_stages_on_a_tiny_spec_make_what_the_refusal_checks(tmp_path, monkeypatch):
    """The real builder (digits, demo VAE, base, samples, factory models) with 2 steps each on
    the tiny transformer at 32 px: a run of that demo is refused before and allowed after, by
    the markers on disk, and a second build keeps every stage."""
    from workbench.worker.demo import DemoSpec
    from workbench.worker.demo_stages import all_stages

    spec = DemoSpec(
        size="tiny", resolution=32, vae_steps=2, vae_batch=4, base_steps=2, base_batch=4
    )
    config = {
        "model": {"factory": "flux", "size": "tiny", "pretrained": "digits"},
        "data": {"factory": "digits"},
        "resolution": 32,
    }
    assert "build them with" in run_refusal(config, tmp_path)
    status = run_stages(all_stages(tmp_path, spec), tmp_path, bar=False)
    assert status["state"] == "ready"
    assert [s["name"] for s in status["stages"]] == [
        "digits",
        "demo VAE",
        "demo base",
        "demo samples",
        "factory models",
    ]
    assert run_refusal(config, tmp_path) is None
    provides = {k: v for s in status["stages"] for k, v in s["provides"].items()}
    assert set(provides) == {"data/digits-32px", "models/flux-tiny-digits"}
    demo = tmp_path / "models" / "flux-tiny-digits"
    assert json.loads((demo / "demo.json").read_text())["base"]["steps"] == 2
    assert not (tmp_path / "build" / "flux-tiny-digits").exists()  # the parts are gone
    # A marker that does not hold the recorded digest is not "built": the run is refused.
    marker = demo / asset_status.MARKER
    good = marker.read_text()
    marker.write_text("stale\n")
    assert "models/flux-tiny-digits" in run_refusal(config, tmp_path)
    marker.write_text(good)
    again = run_stages(all_stages(tmp_path, spec), tmp_path, bar=False)
    assert [s["kept"] for s in again["stages"]] == [True] * 5


def test_an_on_demand_build_waits_for_the_running_one(tmp_path):
    """``build_demo`` (a worker's on-demand build) takes the same lock, waiting for
    ``workbench demo-assets`` to end: it then finds that build's output complete."""
    from workbench.worker.assets.stages import build_lock

    mark = tmp_path / "builds.txt"
    proc = _starter(tmp_path, mark, 1.5)
    deadline = time.monotonic() + 30
    while not mark.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    said: list[str] = []
    with build_lock(tmp_path, said.append):
        assert (tmp_path / "slow.done").exists()  # the other build ended before we got the lock
        assert asset_status.lock_holder(tmp_path) is not None
    assert said == [f"waiting for the demo-asset build in process {proc.pid} to end"]
    assert proc.wait(timeout=30) == 0 and mark.read_text() == "built\n"


def test_the_stages_are_checked_without_importing_diffusers(tmp_path):
    """Listing the build's stages and checking which are built (what ``workbench demo-assets``
    does before its first stage and before it finds another build running) imports neither
    diffusers nor its model classes: their keys read diffusers' version from its metadata, the
    version the library itself gives."""
    code = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "from workbench.worker.demo import demo_spec\n"
        "from workbench.worker.demo_stages import all_stages\n"
        f"stages = all_stages(Path({str(tmp_path)!r}), demo_spec())\n"
        "done = [s.complete() for s in stages]\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'diffusers')\n"
        "from workbench.worker.assets.models import model_spec\n"
        "from workbench.worker.demo import demo_key\n"
        "import diffusers\n"
        "keys = [model_spec('flux', 'tiny')['diffusers'], demo_key()['diffusers']]\n"
        "print(json.dumps([[s.name for s in stages], done, loaded, keys, diffusers.__version__]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names, done, loaded, keys, version = json.loads(out.stdout.splitlines()[-1])
    assert names == ["digits", "demo VAE", "demo base", "demo samples", "factory models"]
    assert done == [False] * 5
    assert loaded == []
    assert keys == [version, version]
