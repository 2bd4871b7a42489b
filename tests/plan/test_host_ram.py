"""Plans against real worker runs: host RAM (the process itself, its libraries, is part of what
a run holds, as are the pinned pools and the tracked device bytes on CPU) and the default
preset's peak VRAM (its run page showed x1.53 and x3.7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.plan import plan_preset, profile
from workbench.plan.baseline import worker_baseline_bytes
from workbench.worker.assets import ENV_VAR
from workbench.worker.preset import load_preset

REPO = Path(__file__).resolve().parents[2]


def _run(data: dict, tmp_path: Path) -> list[dict]:
    """``workbench train`` on the preset object ``data``; its telemetry records."""
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(data))
    run_dir = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "workbench.cli", "train", str(path), "--run-dir", str(run_dir)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").open()]


def _rss_mb(records: list[dict]) -> float:
    return max(r["rss_mb"] for r in records if r["source"] == "trainer" and r["kind"] == "step")


def test_host_ram_accounts_for_most_of_a_tiny_ci_run(asset_cache, tmp_path, monkeypatch):
    """Before: the plan counted pinned pools and tracked bytes only (tiny-ci: 41 MiB of a
    611 MiB RSS). With the worker's baseline (its imports) it is a lower bound within 30%:
    what stage 1 leaves behind (the released text encoder's pages the allocator keeps) is
    not modelled (``backend/workbench/plan/baseline.py``)."""
    monkeypatch.setenv(ENV_VAR, str(asset_cache))
    name, data = load_preset("tiny-ci")
    rss = _rss_mb(_run(data, tmp_path))
    host = plan_preset(data, profile("cpu"), name=name).to_dict()["host"]
    baseline = worker_baseline_bytes()
    assert baseline > 100 * 2**20 and host["worker_baseline_bytes"] == baseline
    assert host["ram_peak_bytes"] > baseline + host["pinned_bytes"]
    predicted = host["ram_peak_bytes"] / 2**20
    assert 0.7 * rss <= predicted <= rss, (predicted, rss)


@pytest.mark.slow
def test_default_preset_peak_within_5_percent_of_its_run(asset_cache, tmp_path, monkeypatch):
    """The default preset (random weights instead of the digits-trained ones: the same bytes),
    samples drawn before its first step as the demo does, two training steps. Its run page
    showed peak VRAM x1.53 its plan: the trace step after the sampling pass peaked at 58.2 MB
    while every block was evicted after its use; with residency from the budget it peaks at
    38.8 MB against the plan's 38.1."""
    monkeypatch.setenv(ENV_VAR, str(asset_cache))
    name, data = load_preset("default")
    data["model"].pop("pretrained")
    data.update(max_steps=2, checkpoint_every=100)
    data["samples"].update(steps=1, every=100)
    records = _run(data, tmp_path)
    peak = max(r["vram_peak_mb"] for r in records if r["kind"] == "step" and "vram_peak_mb" in r)
    plan = plan_preset(data, profile("cpu"), name=name).to_dict()
    predicted = max(plan["peak_bytes"].values()) / 2**20
    assert abs(predicted / peak - 1) <= 0.05, (predicted, peak)
    rss = _rss_mb(records)
    assert 0.7 * rss <= plan["host"]["ram_peak_bytes"] / 2**20 <= rss
