"""The local model and data factory (backend/workbench/worker/assets)."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from workbench.worker.assets import (
    MODEL_SPECS,
    AssetError,
    build_digits,
    build_model,
    cache_root,
    example_inputs,
    load_text_encoder,
    model_class,
    output_tensor,
)

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture(scope="session")
def tiny_unet(asset_cache) -> Path:
    """Tiny UNet2DConditionModel folder (arch name ``unet``)."""
    return build_model("unet", "tiny", asset_cache)


def _hashes(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if f.is_file()
    }


def _load_sharded(arch: str, folder: Path):
    assert (folder / INDEX).is_file()
    shards = sorted(folder.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((folder / INDEX).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    return model_class(arch).from_pretrained(folder)


@pytest.mark.parametrize(
    ("arch", "fixture", "out_shape"),
    [
        ("flux", "tiny_flux", (1, 16, 16)),  # 8x8 latent -> 4x4 packed tokens of 4*2*2
        ("sd3", "tiny_sd3", (1, 4, 8, 8)),
        ("ltx", "tiny_video", (1, 2 * 8 * 8, 4)),
        ("unet", "tiny_unet", (1, 4, 8, 8)),
    ],
)
def test_tiny_transformer_lora_step(arch, fixture, out_shape, request):
    from peft import LoraConfig

    model = _load_sharded(arch, request.getfixturevalue(fixture))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    model.train()
    kwargs = example_inputs(model, latent_hw=(8, 8), text_len=8, frames=2)
    assert all(not v.requires_grad for v in kwargs.values() if isinstance(v, torch.Tensor))
    out = output_tensor(model(**kwargs))
    assert tuple(out.shape) == out_shape
    out.pow(2).mean().backward()

    lora_b = [(n, p) for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b
    for name, p in lora_b:
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    base = [n for n, p in model.named_parameters() if "lora_" not in n]
    assert base
    assert all(model.get_parameter(n).grad is None for n in base)


def test_tiny_vae_roundtrip(tiny_vae):
    vae = _load_sharded("vae", tiny_vae)
    assert vae.config.latent_channels == 4
    image = example_inputs(vae, latent_hw=(4, 4))["sample"]
    assert image.shape == (1, 3, 32, 32)
    with torch.no_grad():
        latents = vae.encode(image).latent_dist.sample(generator=torch.Generator().manual_seed(0))
        assert latents.shape == (1, 4, 4, 4)
        recon = output_tensor(vae.decode(latents))
    assert recon.shape == (1, 3, 32, 32)
    assert torch.isfinite(recon).all()


def test_digits_folder(digits_dir):
    from PIL import Image
    from sklearn.datasets import load_digits

    pngs = sorted(digits_dir.glob("*.png"))
    txts = sorted(digits_dir.glob("*.txt"))
    assert len(pngs) == len(txts) == 1797
    assert [p.stem for p in pngs] == [t.stem for t in txts]
    labels = load_digits().target
    assert labels[0] == 0
    assert (digits_dir / "00000.txt").read_text().strip() == "a handwritten digit zero"
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    caption = (digits_dir / "00017.txt").read_text().strip()
    assert caption == f"a handwritten digit {names[labels[17]]}"
    with Image.open(digits_dir / "00000.png") as im:
        assert im.mode == "RGB" and im.size == (64, 64)
        assert im.getextrema()[0][1] > 200  # bright strokes on black


def test_build_is_deterministic_and_idempotent(tmp_path):
    a = build_model("flux", "tiny", tmp_path / "a")
    b = build_model("flux", "tiny", tmp_path / "b")
    assert a != b
    assert _hashes(a) == _hashes(b)
    before = {f.name: f.stat().st_mtime_ns for f in a.iterdir()}
    assert build_model("flux", "tiny", tmp_path / "a") == a  # no-op
    assert {f.name: f.stat().st_mtime_ns for f in a.iterdir()} == before
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_digits_second_call_is_noop(digits_dir):
    marker = digits_dir / ".complete"
    mtime = marker.stat().st_mtime_ns
    assert build_digits(digits_dir.parent.parent) == digits_dir
    assert marker.stat().st_mtime_ns == mtime


def test_unknown_arch_and_size(tmp_path):
    with pytest.raises(AssetError, match="flux.*sd3.*ltx.*unet.*vae"):
        build_model("dalle", "tiny", tmp_path)
    with pytest.raises(AssetError, match="tiny.*small.*large"):
        build_model("flux", "huge", tmp_path)
    assert isinstance(AssetError("x"), ValueError)
    assert MODEL_SPECS[("flux", "tiny")]["joint_attention_dim"] == 384
    assert MODEL_SPECS[("unet", "tiny")]["cross_attention_dim"] == 384


def test_unwritable_cache_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "cache"  # can't create a folder inside a file, even as root
    with pytest.raises(AssetError) as info:
        build_model("flux", "tiny", bad)
    assert str(bad) in str(info.value)
    assert "STAGEHAND_WORKBENCH_CACHE" in str(info.value)


def test_cache_root_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEHAND_WORKBENCH_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("STAGEHAND_WORKBENCH_CACHE")
    assert cache_root(create=False) == Path("~/.cache/stagehand-workbench").expanduser()


def test_what_the_tests_start_uses_the_runs_cache_not_the_users():
    """``tests/conftest.py``: the processes a test run starts get a cache folder of the run's
    own (a temp folder of its first process), never ``~/.cache/stagehand-workbench``."""
    import subprocess
    import sys
    import tempfile

    run_cache = Path(os.environ["STAGEHAND_TEST_RUN_CACHE"])
    assert run_cache.is_dir() and run_cache.name.startswith("stagehand-test-cache-")
    assert run_cache.parent == Path(tempfile.gettempdir())
    code = "from workbench.worker.assets import cache_root; print(cache_root(create=False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (
        Path(out.stdout.strip()) == run_cache != Path("~/.cache/stagehand-workbench").expanduser()
    )


def test_minilm_embeds(minilm_dir):
    assert (minilm_dir / "config.json").is_file()
    tokenizer, model = load_text_encoder()
    assert model.config.hidden_size == 384
    batch = tokenizer(
        ["a handwritten digit seven", "a red bicycle in the rain"],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape[0] == 2 and hidden.shape[-1] == 384
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    assert not torch.allclose(pooled[0], pooled[1], atol=1e-3)
    cos = torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=0)
    assert cos < 0.99
