"""SquareQ changes what the frozen weights are (8 bits), then nothing else: a LoRA run streamed
with ``memory.stagehand.squareq`` computes, bit for bit, what the same model with the same
dequantized weights computes all resident (``dequantized_in_place``): every loss, gradient and
final parameter, for both formats, file-backed and module-backed, fp32 and bf16, on the tiny
diffusers denoisers of the factory (Flux, SD3, LTX-Video transformers, the SDXL-style UNet:
its stages stream, their convolutions stay in the model's dtype) and the defect toys.

Not vacuous: the blocks really loaded their 8-bit images (``h2d_bytes`` is the images' bytes,
under 0.56x of the compute-dtype blocks), and the dequantized weights differ from the
checkpoint's (the reference is not the plain model).
"""

from __future__ import annotations

import pytest
import torch

from runtime.assets import build_model
from runtime.squareq.runtime import dequantized_in_place
from runtime.strategy import build_strategy
from runtime.weights.registry import find_blocks

from .exact import assert_exact, build_toy, make_model, train

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test

FORMATS = ["int8", "fp8_e4m3"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, asset_cache, tiny_flux, tiny_sd3, tiny_video):
    root = tmp_path_factory.mktemp("sq-toys")
    return {
        "dual": build_toy("dual", root / "dual"),
        "flux": tiny_flux,
        "sd3": tiny_sd3,
        "ltx": tiny_video,
        "unet": build_model("unet", "tiny", asset_cache),
    }


def memory(fmt: str, file_backed: bool, cache_dir, **extra) -> dict:
    """Tight watermarks: every block evicted after each use, so every use loads its image."""
    return {
        "strategy": "stagehand",
        "gradient_checkpointing": True,
        "stagehand": {
            "pinned_pool_mb": 4,
            "pinned_slab_mb": 1,
            "prefetch_window_blocks": 1,
            "vram_high_watermark_mb": 0,
            "vram_low_watermark_mb": 0,
            "file_backed": file_backed,
            "squareq": {"format": fmt, "cache_dir": str(cache_dir)},
            **extra,
        },
    }


def reference(arch, folder, fmt, dtype):
    """The plain model (ordinary storage) with its blocks' frozen linear weights dequantized."""
    model = make_model(arch, folder, "lora", "non-reentrant", True, dtype)
    count = dequantized_in_place([m for _, m in find_blocks(model)], fmt)
    assert count > 0
    return train(model)


def check(folders, tmp_path, arch, fmt, file_backed, dtype=torch.float32, **extra):
    model = make_model(arch, folders[arch], "lora", "non-reentrant", dtype=dtype)
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    built = build_strategy(
        model,
        memory(fmt, file_backed, tmp_path / "sq", **extra),
        device="cpu",
        checkpoint_dir=folders[arch],
    )
    weights = built.weights
    assert weights.squareq.enabled
    got = train(model, built)
    assert_exact(reference(arch, folders[arch], fmt, dtype), got)
    # Not vacuous: images streamed, and they are not the plain weights.
    work = built.counters()
    images = [b for b in weights.blocks if b.image is not None]
    assert images and work["blocks_loaded"] > 0
    if "host_cache_mb" in extra and not file_backed:  # the 8-bit images were registered
        assert weights.cache.registered_bytes == sum(b.staged_bytes for b in images)
    ratio = sum(b.staged_bytes for b in images) / sum(b.nbytes for b in images)
    # A UNet's convolutions stay in the model's dtype: only its attention and projections shrink.
    assert ratio <= (0.8 if arch == "unet" else 0.56), ratio
    changed = [
        n for n, p in got.final.items() if "base_layer" in n and not torch.equal(p, plain[n])
    ]
    assert changed


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["flux", "sd3", "ltx", "unet", "dual"])
def test_file_backed_squareq_trains_as_the_dequantized_model(folders, tmp_path, arch, fmt):
    check(folders, tmp_path, arch, fmt, file_backed=True)


@pytest.mark.parametrize("cache_mb", [None, 64], ids=["masters", "registered-images"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_module_backed_squareq_trains_as_the_dequantized_model(folders, tmp_path, fmt, cache_mb):
    """Module-backed: quantized in memory; with a host cache the 8-bit images are registered
    (the host masters become views of them, as on CUDA where they are page-locked)."""
    extra = {} if cache_mb is None else {"host_cache_mb": cache_mb}
    check(folders, tmp_path, "flux", fmt, file_backed=False, **extra)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_squareq_trains_as_the_dequantized_model(folders, tmp_path, fmt):
    """bf16 compute from an fp32 checkpoint: quantized from the bf16 weight the model holds."""
    check(folders, tmp_path, "flux", fmt, file_backed=True, dtype=torch.bfloat16)
