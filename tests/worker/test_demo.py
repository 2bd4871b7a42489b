"""The demo's trained models (backend/workbench/worker/demo.py), on a reduced build: the tiny transformer
and fewer steps than the demo's, so the figures asserted are what a short training reaches."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from workbench.worker.demo import (
    CoreShare,
    DemoSpec,
    caption_text,
    deterministic,
    encode,
    nearest_class_means,
    pretrain_base,
    sample_check,
)
from workbench.worker.demo_stages import build_demo

# The demo's recipe (its steps, schedules and training sigmas) at 32 px (4x4 latents, 4 packed
# tokens) on the tiny transformer, with 2/3 of the VAE batch and 5x the base's learning rate (the
# tiny transformer is 6x narrower): ~25 s on one core. MINI only checks bytes.
SPEC = DemoSpec(size="tiny", resolution=32, vae_batch=16, base_lr=8e-3)
MINI = DemoSpec(size="tiny", resolution=32, vae_steps=2, vae_batch=4, base_steps=2, base_batch=4)


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"), SPEC)


def test_vae_reconstructs_held_out_digits(demo):
    """Held-out digits (seen by neither model) come back through the trained VAE with a fifth
    of the random VAE's error, and the latents the trainer caches have zero mean, unit variance."""
    from diffusers import AutoencoderKL

    from workbench.worker.assets.digits import digit_pixels

    report = json.loads((demo / "demo.json").read_text())["vae"]
    assert report["random_held_out_mse"] > 0.3  # a random decoder: colour noise
    assert report["held_out_mse"] < report["random_held_out_mse"] / 5
    vae = AutoencoderKL.from_pretrained(demo / "vae")
    assert vae.config.scaling_factor == report["scaling_factor"]
    images, _ = digit_pixels(SPEC.resolution)
    pixels = torch.from_numpy(images[:512]).float().div(127.5).sub(1.0)[:, None].repeat(1, 3, 1, 1)
    z = encode(vae, pixels)  # (512, 4, 4, 4), as stage 1 caches them
    assert z.shape == (512, 4, 4, 4)
    assert abs(float(z.mean())) < 0.1 and 0.8 < float(z.std()) < 1.2


def test_base_samples_follow_their_prompts(demo):
    """Samples are nearest to the mean image of their own prompt's digit at three times chance
    (4 of 40) or more, and the same check on the random-initialised transformer is near chance."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from workbench.worker.assets.digits import digit_pixels
    from workbench.worker.assets.models import instantiate

    report = json.loads((demo / "demo.json").read_text())
    assert report["base"]["loss_last_10_mean"] < 0.8 * report["base"]["loss_first"]
    shards = list((demo / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 2  # sharded, as the weight runtime streams it
    model = FluxTransformer2DModel.from_pretrained(demo / "transformer")
    vae = AutoencoderKL.from_pretrained(demo / "vae")
    images, labels = digit_pixels(SPEC.resolution)
    held = slice(len(images) - SPEC.held_out, None)
    pixels = torch.from_numpy(images[held]).float().div(127.5).sub(1.0)[:, None]
    text = caption_text(SPEC.max_tokens)
    trained = sample_check(model, vae, text, pixels, torch.from_numpy(labels[held]), SPEC)
    assert trained == report["samples"]  # the loaded folder samples as the build did
    random = sample_check(instantiate("flux", "tiny"), vae, text, pixels,
                          torch.from_numpy(labels[held]), SPEC)  # fmt: skip
    assert trained["sample_matches"] >= 12, trained
    assert random["sample_matches"] <= 8, random


def test_nearest_class_means_picks_the_digit():
    from workbench.worker.assets.digits import digit_pixels

    images, labels = digit_pixels(16)
    pixels = torch.from_numpy(images).float().div(127.5).sub(1.0)[:, None]
    labels = torch.from_numpy(labels)
    means = torch.stack([pixels[labels == d, 0].mean(0) for d in range(10)])
    assert nearest_class_means(means, pixels, labels).tolist() == list(range(10))


def test_build_is_deterministic_and_a_second_call_is_a_no_op(tmp_path):
    first, again = build_demo(tmp_path / "a", MINI), build_demo(tmp_path / "b", MINI)
    assert first != again
    hashes = _hashes(first)
    assert {"vae/config.json", "transformer/config.json", "demo.json"} <= set(hashes)
    assert _hashes(again) == hashes  # the same bytes, weights and report alike
    marker = (again / ".complete").stat().st_mtime_ns
    assert build_demo(tmp_path / "b", MINI) == again
    assert (again / ".complete").stat().st_mtime_ns == marker


def test_pretrained_is_for_the_flux_factory():
    from workbench.worker.preset import validate_preset

    ok = validate_preset({"model": {"factory": "flux", "size": "tiny", "pretrained": "digits"}})
    assert ok.model.pretrained == "digits"
    with pytest.raises(ValueError, match='pretrained "digits" is built for model.factory "flux"'):
        validate_preset({"model": {"factory": "sd3", "size": "tiny", "pretrained": "digits"}})


@pytest.mark.parity
def test_the_base_trains_to_the_same_bytes_on_any_number_of_threads():
    """The demo base may take idle cores (``CoreShare``) because its bytes do not depend on the
    thread count: the demo's own size and batch, 1 thread against 3 (matrices large enough that
    ATen splits them across threads)."""
    spec = DemoSpec(base_steps=3)
    g = torch.Generator().manual_seed(0)
    latents, labels = torch.randn(64, 4, 8, 8, generator=g), torch.randint(10, (64,), generator=g)
    text = caption_text(spec.max_tokens)
    states = []
    for threads in (1, 3):
        with deterministic():
            torch.set_num_threads(threads)
            model, losses = pretrain_base(latents, labels, text, spec)
            assert torch.get_num_threads() == threads
        states.append((losses, model.state_dict()))
    (losses_1, state_1), (losses_3, state_3) = states
    assert losses_1 == losses_3
    assert state_1.keys() == state_3.keys()
    assert all(torch.equal(state_1[k], state_3[k]) for k in state_1)


def test_core_share_leaves_a_core_another_process_holds():
    """With other processes spinning on all cores but one, CoreShare offers one thread; a call
    too soon after the last repeats it. (Whether it offers more on an idle machine, or beside a
    niced process, depends on what else runs beside the suite; the build's log line shows it.)"""
    import subprocess
    import sys
    import time

    share = CoreShare()
    if share.cores > 8:
        pytest.skip(f"{share.cores} cores: too many to fill with spinning processes")
    assert share.threads() == 1  # nothing measured yet

    def busy() -> int:
        spin = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(share.cores - 1)
        ]
        try:
            time.sleep(0.3)
            share.threads()  # restart the interval with the spinners running
            time.sleep(0.8)
            return share.threads()
        finally:
            for proc in spin:
                proc.kill()
                proc.wait()

    assert busy() == 1
    assert share.threads() == 1  # too soon to measure: the last answer
