"""The trainer's parts on real tensors and files: data folders, latent packing, flow matching,
gradient checkpointing verification, progress output."""

import io

import pytest
import torch
from PIL import Image

from workbench.worker.data import (
    batch_indices,
    buckets,
    group_by_shape,
    load_sample,
    target_size,
)
from workbench.worker.families import flow_pair, pack_2x2, sample_sigmas, unpack_2x2
from workbench.worker.loop import enable_checkpointing, lr_lambda
from workbench.worker.progress import Progress
from workbench.worker.scan import DataError, scan_folder


def _img(path, w, h, value=255):
    Image.new("RGB", (w, h), (value, 0, 0)).save(path)


def test_scan_folder_pairs_captions_and_limits(tmp_path):
    for i in range(3):
        _img(tmp_path / f"{i}.png", 32, 16)
    (tmp_path / "0.txt").write_text("a red box\n")
    samples = scan_folder(tmp_path, default_caption="untitled", limit=2).samples
    assert [(s.files[0].name, s.caption) for s in samples] == [
        ("0.png", "a red box"),
        ("1.png", "untitled"),
    ]
    with pytest.raises(DataError, match="is not a folder"):
        scan_folder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no usable image"):
        scan_folder(tmp_path / "empty").check()


def test_frame_stacks_for_video(tmp_path):
    clip = tmp_path / "clip"
    clip.mkdir()
    for i in range(5):
        _img(clip / f"{i:03d}.png", 16, 16, value=i * 50)
    (tmp_path / "clip.txt").write_text("a fading box")
    (sample,) = scan_folder(tmp_path, frames=3).samples
    x = load_sample(sample, 16, bucketing=False)  # (F, 3, H, W)
    assert x.shape == (3, 3, 16, 16) and sample.caption == "a fading box"
    assert x[:, 0, 0, 0].tolist() == pytest.approx([-1.0, 50 / 127.5 - 1, 100 / 127.5 - 1])
    short = scan_folder(tmp_path, frames=6)
    assert [(s.file, s.reason) for s in short.bad] == [
        ("clip/", "clip has 5 frames, expected at least 6")
    ]
    with pytest.raises(DataError, match="no usable image"):
        short.check()


def test_center_crop_and_buckets(tmp_path):
    _img(tmp_path / "wide.png", 64, 32)
    (sample,) = scan_folder(tmp_path).samples
    assert load_sample(sample, 32, bucketing=False).shape == (3, 32, 32)
    assert buckets(256) == [(192, 320), (256, 256), (320, 192), (384, 192)]
    assert target_size((32, 64), 256, bucketing=True) == (192, 320)  # nearest to 1:2
    x = load_sample(sample, 256, bucketing=True)
    assert x.shape == (3, 192, 320) and x.min() >= -1 and x.max() <= 1


def test_batches_come_from_one_bucket_and_depend_only_on_the_generator():
    groups = group_by_shape([(4, 8, 8), (4, 8, 16), (4, 8, 8), (4, 8, 16), (4, 8, 8)])
    assert groups == {(4, 8, 8): [0, 2, 4], (4, 8, 16): [1, 3]}
    a = batch_indices(groups, 4, torch.Generator().manual_seed(3))
    b = batch_indices(groups, 4, torch.Generator().manual_seed(3))
    assert a == b and len({tuple(groups_of(groups, i)) for i in a}) == 1


def groups_of(groups, i):
    return next(k for k, v in groups.items() if i in v)


def test_flux_packing_round_trips():
    x = torch.randn(2, 4, 6, 8)
    packed = pack_2x2(x)  # (B, 3*4 tokens, 16)
    assert packed.shape == (2, 12, 16)
    assert torch.equal(unpack_2x2(packed, 4, 6, 8), x)
    # token (0, 0) holds the 2x2 patch of every channel at rows 0-1, cols 0-1
    assert torch.equal(packed[0, 0].view(4, 2, 2), x[0, :, :2, :2])


def test_flow_pair_and_sigmas():
    x0, noise = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    sigma = torch.tensor([0.0, 0.5, 1.0])
    x_t, target = flow_pair(x0, noise, sigma)
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[2], noise[2])
    assert torch.allclose(x_t[1], (x0[1] + noise[1]) / 2)
    assert torch.equal(target, noise - x0)
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(4000, "logit_normal", g)
    assert 0 < s.min() and s.max() < 1 and abs(float(s.mean()) - 0.5) < 0.02
    assert float(((s > 0.25) & (s < 0.75)).float().mean()) > 0.6  # mass in the middle
    u = sample_sigmas(4000, "uniform", g)
    assert abs(float(((u > 0.25) & (u < 0.75)).float().mean()) - 0.5) < 0.05


def test_gradient_checkpointing_is_verified_not_swallowed(tiny_flux, tiny_vae):
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(tiny_flux)
    enable_checkpointing(model)
    assert model.is_gradient_checkpointing
    # A model without support raises (the seed's bug 5 was exactly this, swallowed).
    from diffusers import ModelMixin

    class NoCheckpointing(ModelMixin):
        _supports_gradient_checkpointing = False

    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        enable_checkpointing(NoCheckpointing())
    assert AutoencoderKL  # imported for parity with the factory VAE


def test_lr_schedule_warmup_then_cosine():
    from workbench.worker.preset import validate_preset

    p = validate_preset(
        {
            "model": {"factory": "flux"},
            "max_steps": 10,
            "scheduler": {"scheduler": "cosine", "warmup_steps": 2},
        }
    )
    f = lr_lambda(p)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(6) == pytest.approx(0.5) and f(10) == pytest.approx(0.0)


def test_progress_plain_lines_without_a_terminal():
    out = io.StringIO()
    p = Progress(out, tty=False, log_every=5)
    for step in range(1, 11):
        p.step(step, 10, 1.0 / step, 0.1)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "5/10", "10/10"]
    assert "\r" not in out.getvalue() and "ETA" in lines[0]


def test_progress_bar_on_a_terminal():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p.stage("cache", 5, 10, "encoding images")
    p.step(1, 4, 0.5, 0.2)
    p.step(4, 4, 0.25, 0.2)
    text = out.getvalue()
    assert text.count("\r") == 3 and "[############............]" in text
    assert "step 4/4 loss 0.2500" in text and text.endswith("\n")


def test_two_encoder_folders_alike_in_names_sizes_and_times_are_not_one_cache_entry(tmp_path):
    """The embedding caches key a folder by its path too: two folders whose files agree on
    names, sizes and mtimes (Wan 2.2's experts, images built with SOURCE_DATE_EPOCH) but hold
    other weights must not share cached embeddings."""
    import os

    from safetensors.torch import save_file

    from workbench.worker.encode import _folder_id, cache_key

    for name, value in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"w": torch.full((4,), value)}, str(folder / "model.safetensors"))
        os.utime(folder / "model.safetensors", ns=(10**18, 10**18))
    a, b = _folder_id(tmp_path / "a"), _folder_id(tmp_path / "b")
    assert a[1:] == b[1:]  # names, sizes and times agree
    assert cache_key(kind="text", encoder=a) != cache_key(kind="text", encoder=b)
