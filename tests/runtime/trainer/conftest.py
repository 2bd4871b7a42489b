"""Trainer test helpers: presets written from tiny-ci with overrides, runs read back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.assets import ENV_VAR
from runtime.preset import PRESETS_DIR

REPO = Path(__file__).resolve().parents[3]


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


@pytest.fixture
def cache_env(asset_cache, monkeypatch):
    """The trainer builds/reads factory models and its stage-1 cache in the session cache."""
    monkeypatch.setenv(ENV_VAR, str(asset_cache))
    return asset_cache


@pytest.fixture
def make_preset(tmp_path):
    """``make_preset(**overrides) -> Path`` of tiny-ci merged with ``overrides``."""

    def make(name="test", **over) -> Path:
        base = json.loads((PRESETS_DIR / "tiny-ci.json").read_text())
        data = deep_merge(base, {"name": name, **over})
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        return path

    return make


def records(run_dir: Path) -> list[dict]:
    """The run's telemetry; a torn last line (a writer mid-line) is left out."""
    text = (run_dir / "telemetry.jsonl").read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines]


def of(recs: list[dict], source: str, kind: str) -> list[dict]:
    return [r for r in recs if r["source"] == source and r["kind"] == kind]


def start_worker(preset: Path, run_dir: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, ENV_VAR: str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "backend.cli", "train", str(preset), "--run-dir", str(run_dir)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def run_io():
    """Helpers shared by the trainer tests (test files here are not a package)."""
    from types import SimpleNamespace

    return SimpleNamespace(records=records, of=of, start_worker=start_worker, REPO=REPO)
