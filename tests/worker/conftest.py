"""Trainer test helpers: presets written from tiny-ci with overrides, runs read back."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.conftest import _device_double, _in_tmp_dir  # noqa: F401
from workbench.contract.preset import PRESETS_DIR
from workbench.contract.preset.merge import merge_overrides
from workbench.worker.assets import ENV_VAR

REPO = Path(__file__).resolve().parents[2]


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
        data = merge_overrides(base, {"name": name, **over})
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


def stage1_steps(recs: list[dict]) -> list[dict]:
    """The ``stagehand/step`` records of stage 1: the text encoders' inference steps (step 0),
    not the step-0 samples drawn before training (tagged ``sampling``)."""
    return [r for r in of(recs, "stagehand", "step") if r["step"] == 0 and not r.get("sampling")]


def start_worker(preset: Path, run_dir: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, ENV_VAR: str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "workbench.cli", "train", str(preset), "--run-dir", str(run_dir)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def run_io():
    """Helpers shared by the trainer tests (test files here are not a package)."""
    from types import SimpleNamespace

    return SimpleNamespace(records=records, of=of, start_worker=start_worker, REPO=REPO)


@pytest.fixture(scope="session")
def flux_pipeline_dir(asset_cache) -> Path:
    """The tiny FluxPipeline folder (CLIP + T5, 3 double + 5 single blocks), built once."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("flux", asset_cache)


@pytest.fixture(scope="session")
def qwenimage_pipeline_dir(asset_cache) -> Path:
    """The tiny QwenImagePipeline folder (Qwen2.5-VL 3 layers, 3 transformer blocks)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("qwenimage", asset_cache)


@pytest.fixture(scope="session")
def wan_pipeline_dir(asset_cache) -> Path:
    """The tiny WanPipeline folder (Wan 2.1 layout: UMT5 3 layers, 3 blocks, 3D VAE z_dim 4)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("wan", asset_cache)


@pytest.fixture(scope="session")
def wan22_pipeline_dir(asset_cache) -> Path:
    """The tiny Wan 2.2 layout: two experts (transformer, transformer_2), boundary 0.875."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("wan22", asset_cache)


@pytest.fixture(scope="session")
def ltx2_pipeline_dir(asset_cache) -> Path:
    """The tiny LTX2Pipeline folder (Gemma 3 3 layers + connectors, 3 blocks, video and audio
    VAEs, vocoder)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("ltx2", asset_cache)


@pytest.fixture(scope="session")
def zimage_pipeline_dir(asset_cache) -> Path:
    """The tiny ZImagePipeline folder (Qwen3 3 layers, 3 layers + 1 + 1 refiners)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("zimage", asset_cache)


@pytest.fixture(scope="session")
def sd3_pipeline_dir(asset_cache) -> Path:
    """The tiny StableDiffusion3Pipeline folder (CLIP-L 3 + CLIP-G 5 layers, T5 3 layers,
    3 joint blocks)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("sd3", asset_cache)


@pytest.fixture(scope="session")
def sdxl_pipeline_dir(asset_cache) -> Path:
    """The tiny StableDiffusionXLPipeline folder (CLIP-L 3 + CLIP-G 5 layers, UNet of 2 levels,
    v-prediction)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("sdxl", asset_cache)


@pytest.fixture(scope="session")
def flux2_pipeline_dir(asset_cache) -> Path:
    """The tiny Flux2KleinPipeline folder (Qwen3 28 tiny layers, 3 double + 5 single blocks)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("flux2", asset_cache)


@pytest.fixture(scope="session")
def wide_images(tmp_path_factory) -> Path:
    """Six 120x60 random images with captions: with ``resolution`` 96 and bucketing they land
    in the 64x128 bucket (non-square latents)."""
    from tests.fixtures.images import captioned_images

    return captioned_images(tmp_path_factory.mktemp("wide-images"))


def write_clip(path: Path, frames: int, size_hw=(60, 120), seed=0) -> None:
    """An MPEG-4 clip of ``frames`` random frames written with PyAV."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width = size_hw
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            arr = (rng.random((*size_hw, 3)) * 255).astype("uint8")
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="session")
def wide_clips(tmp_path_factory) -> Path:
    """Three 9-frame 120x60 MPEG-4 clips and one image (a clip of one frame), captioned."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("wide-clips")
    arr = (np.random.default_rng(9).random((60, 120, 3)) * 255).astype("uint8")
    Image.fromarray(arr).save(folder / "00.png")
    (folder / "00.txt").write_text("a photo of the digit zero")
    for i, word in enumerate(["one", "two", "three"], start=1):
        write_clip(folder / f"{i:02d}.mp4", 9, seed=i)
        (folder / f"{i:02d}.txt").write_text(f"a photo of the digit {word}")
    return folder


def pipeline_preset(tmp_path: Path, pipeline: Path, data_dir: Path, name="pipe", **over) -> Path:
    """tiny-ci's memory section (weight streaming, activation spill, Conductor) on a pipeline
    folder: 4 steps of batch 2 on 64x128 images, validation, a sample and a checkpoint every 2
    steps."""
    base = json.loads((PRESETS_DIR / "tiny-ci.json").read_text())
    # The tiny transformer's activations are a few KB: spill above 20 KB so spill happens.
    base["memory"]["stagehand"]["activation_stagehand"].update(
        vram_high_watermark_mb=0.02, vram_low_watermark_mb=0.01
    )
    # Every block of these transformers fits under tiny-ci's 0.5 MB low watermark and would stay
    # (NOTE [ Eviction policy ]): low 0 so the blocks stream.
    base["memory"]["stagehand"]["vram_low_watermark_mb"] = 0
    data_section = {"path": str(data_dir), "bucketing": True, "max_caption_tokens": 16}
    preset = {
        "name": name,
        "model": {"path": str(pipeline), "dtype": "float32"},
        "adapter": {"rank": 4, "alpha": 4},
        "memory": base["memory"],
        "learning_rate": 1e-3,
        "resolution": 96,
        "batch_size": 2,
        "max_steps": 4,
        "seed": 0,
        "validation_every": 2,
        "validation_samples": 1,
        "checkpoint_every": 2,
        "samples": {"prompts": ["a photo of the digit seven"], "steps": 2, "every": 2},
        "data": data_section,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(merge_overrides(preset, over)))
    return path


def train_twice(preset: Path, tmp: Path) -> tuple[Path, Path]:
    """Two ``workbench train`` runs of ``preset`` on one asset cache (``tmp/cache``): the second
    must reuse what the first cached. Returns the two run folders."""
    from workbench.worker.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(tmp / "cache"))
        first, second = tmp / "first", tmp / "second"
        assert main([str(preset), "--run-dir", str(first)]) == 0
        assert main([str(preset), "--run-dir", str(second)]) == 0
    return first, second


def assert_streamed_and_spilled(recs: list[dict]) -> None:
    """Stage 2 evicted blocks and spilled activations (weight streaming and spill were on)."""
    assert sum(r["blocks_evicted"] for r in of(recs, "stagehand", "step") if r["step"]) > 0
    assert sum(r["activations_spilled"] for r in of(recs, "activation_stagehand", "step")) > 0


def assert_cache_reused(second: Path, steps: list[dict]) -> None:
    """The second run on one cache reused both stage-1 caches and repeated ``steps``' losses."""
    messages = [r["message"] for r in of(records(second), "trainer", "stage")]
    assert any(m.startswith("text embeddings reused") for m in messages)
    assert any(m.startswith("latents reused") for m in messages)
    again = [s["loss"] for s in of(records(second), "trainer", "step")]
    assert again == [s["loss"] for s in steps]


def resume_after(first: Path, step: int) -> tuple[Path, int]:
    """``first`` resumed from its ``checkpoints/step-<step>`` as ``POST /api/runs/{id}/resume``
    resumes a run killed after step ``step + 1``: a new folder holds the ``config.json`` the
    worker wrote, that checkpoint and the stream up to step ``step + 1``'s ``trainer/step``
    record, and ``workbench train DIR/config.json --resume`` runs on the asset cache ``first``
    was trained on (``train_twice``). Returns the resumed run's folder and the last ``seq``
    the killed worker wrote."""
    from workbench.worker.cli import main

    resumed = first.parent / f"{first.name}-resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(first / "config.json", resumed / "config.json")
    shutil.copytree(
        first / "checkpoints" / f"step-{step}", resumed / "checkpoints" / f"step-{step}"
    )
    recs = records(first)
    killed = next(r for r in of(recs, "trainer", "step") if r["step"] == step + 1)
    head = recs[: recs.index(killed) + 1]
    (resumed / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in head))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, str(first.parent / "cache"))
        assert main([str(resumed / "config.json"), "--run-dir", str(resumed), "--resume"]) == 0
    return resumed, killed["seq"]


def trainable_params(recs: list[dict]) -> int:
    """The trainable parameter count the last ``train`` stage of the stream reported."""
    messages = [r["message"] for r in of(recs, "trainer", "stage")]
    counts = [m.split()[0] for m in messages if m.endswith(" trainable parameters")]
    return int(counts[-1].replace(",", ""))


def assert_resumes_as_uninterrupted(first: Path, step: int = 2) -> None:
    """``first`` resumed after ``step`` (``resume_after``) trains the checkpoint's adapter (as
    many trainable parameters) and repeats ``first``'s losses, validation losses and LoRA
    exactly (each step's batch, noise and sigmas are a function of the seed and the step)."""
    import torch
    from safetensors.torch import load_file

    resumed, killed_seq = resume_after(first, step)
    want, got = records(first), records(resumed)
    assert got[-1]["kind"] == "run_finished" and got[-1]["status"] == "succeeded", got[-1]
    assert trainable_params(got) == trainable_params(want) > 0
    assert len([r for r in of(got, "trainer", "run_started") if r["resume"]]) == 1
    again = {r["step"]: r for r in of(got, "trainer", "step") if r["seq"] > killed_seq}
    expect = {r["step"]: r for r in of(want, "trainer", "step") if r["step"] > step}
    assert sorted(again) == sorted(expect)
    for n, rec in again.items():
        assert rec["loss"] == expect[n]["loss"], n
        if "val_loss" in expect[n]:
            assert rec["val_loss"] == expect[n]["val_loss"], n
    lora = "lora/pytorch_lora_weights.safetensors"
    a, b = load_file(str(first / lora)), load_file(str(resumed / lora))
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), name


@pytest.fixture(scope="session")
def pipe_io():
    """Helpers of the pipeline tests, for module-scoped fixtures too."""
    from types import SimpleNamespace

    return SimpleNamespace(
        records=records,
        of=of,
        preset=pipeline_preset,
        train_twice=train_twice,
        assert_resumes=assert_resumes_as_uninterrupted,
    )
