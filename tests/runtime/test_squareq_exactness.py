"""SquareQ changes what the frozen weights are (8 bits), then nothing else: a LoRA run streamed
with ``memory.stagehand.squareq`` computes, bit for bit, what the same model with the same
dequantized weights computes all resident (``dequantized_in_place``): every loss, gradient and
final parameter, for both formats, file-backed and module-backed, fp32 and bf16, on the tiny
diffusers denoisers of the factory (Flux, SD3, LTX-Video transformers, the SDXL-style UNet:
its stages stream, their convolutions stay in the model's dtype), the defect toys, and the
transformer of each other family's tiny pipeline folder (Qwen-Image, Wan, Z-Image, FLUX.2,
LTX-2), called through the trainer's own family adapter (``family.predict``) on inputs of the
shapes the planner derives from it (``runtime.plan.calls``).

Not vacuous: the blocks really loaded their 8-bit images (``h2d_bytes`` is the images' bytes,
under 0.56x of the compute-dtype blocks), and the dequantized weights differ from the
checkpoint's (the reference is not the plain model).
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime.assets import build_model
from runtime.squareq.runtime import dequantized_in_place
from runtime.strategy import build_strategy
from runtime.weights.registry import find_blocks

from .exact import STEPS, assert_exact, build_toy, make_model, train

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


def reference(arch, folder, fmt, dtype, cls=None, forward=None, steps=STEPS):
    """The plain model (ordinary storage) with its blocks' frozen linear weights dequantized."""
    model = make_model(arch, folder, "lora", "non-reentrant", True, dtype, cls)
    count = dequantized_in_place([m for _, m in find_blocks(model)], fmt)
    assert count > 0
    return train(model, steps=steps, forward=forward)


def check(
    folders,
    tmp_path,
    arch,
    fmt,
    file_backed,
    dtype=torch.float32,
    cls=None,
    forward=None,
    steps=STEPS,
    **extra,
):
    """``cls``/``forward``/``steps``: a pipeline family's transformer class, its training call
    (``family_forward``) and fewer steps (``train``'s)."""
    model = make_model(arch, folders[arch], "lora", "non-reentrant", dtype=dtype, cls=cls)
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    built = build_strategy(
        model,
        memory(fmt, file_backed, tmp_path / "sq", **extra),
        device="cpu",
        checkpoint_dir=folders[arch],
    )
    weights = built.weights
    assert weights.squareq.enabled
    got = train(model, built, steps=steps, forward=forward)
    assert_exact(reference(arch, folders[arch], fmt, dtype, cls, forward, steps), got)
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


PIPELINE_FAMILIES = ["qwenimage", "wan", "zimage", "flux2", "ltx2"]


def family_forward(family, seed_base: int = 100):
    """``forward(model, step)``: one training call of ``family`` (``family.predict``, as the
    trainer makes it) on seeded random latents, text and sigmas of the shapes the planner
    derives through the same adapter (``runtime.plan.calls.latent_shape``: 32 px, 5 frames
    for a video family, 8 caption tokens, batch 1)."""
    from types import SimpleNamespace

    from runtime.plan.calls import latent_shape, pooled_dim
    from runtime.trainer.families import Text

    preset = SimpleNamespace(
        batch_size=1,
        resolution=32,
        data=SimpleNamespace(frames=5 if family.video else None, max_caption_tokens=8),
    )

    def forward(model, step):
        dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
        shape = latent_shape(family, preset, dtype)
        g = torch.Generator().manual_seed(seed_base + step)
        b, tokens = shape[0], preset.data.max_caption_tokens
        text = Text(
            hidden=torch.randn(b, tokens, family.text_dim(model), generator=g).to(dtype),
            mask=torch.ones(b, tokens, dtype=torch.long),
            pooled=torch.randn(b, pooled_dim(model.config), generator=g).to(dtype),
        )
        sigma = torch.rand(b, generator=g).to(dtype)
        x_t = torch.randn(shape, generator=g).to(dtype)
        return family.predict(model, x_t, sigma, text)

    return forward


@pytest.fixture(scope="module")
def pipeline_families(asset_cache):
    """Each family's adapter bound to its tiny pipeline folder (``tests/fixtures``)."""
    from runtime.trainer.pipelines import adapter_for, inspect_pipeline
    from tests.fixtures.pipelines import build_pipeline

    bound = {}
    for name in PIPELINE_FAMILIES:
        info = inspect_pipeline(build_pipeline(name, asset_cache))
        bound[name] = adapter_for(info, asset_cache / "trainer-cache", torch.float32)
    return bound


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", PIPELINE_FAMILIES)
def test_pipeline_family_squareq_trains_as_the_dequantized_model(
    pipeline_families, tmp_path, name, fmt
):
    """The transformer a pipeline folder trains, called as the trainer calls it, streamed
    file-backed in 8 bits: as the resident dequantized model, for two steps."""
    import diffusers

    family = pipeline_families[name]
    folder = family.transformer_dir
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    check(
        {name: folder},
        tmp_path,
        name,
        fmt,
        file_backed=True,
        cls=cls,
        forward=family_forward(family),
        steps=2,
    )
