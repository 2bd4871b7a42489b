"""SquareQ changes what the frozen weights are (8 bits), then nothing else: a LoRA run streamed
with ``memory.stagehand.squareq`` computes, bit for bit, what the same model with the same
dequantized weights computes all resident (``dequantized_in_place``): every loss, gradient and
final parameter, for both formats, file-backed and module-backed, fp32 and bf16, on the tiny
diffusers denoisers of the factory (Flux, SD3, LTX-Video transformers, the SDXL-style UNet:
its stages stream, their convolutions stay in the model's dtype), the defect toys, and the
denoiser of every family's tiny pipeline folder (Flux, SD3, SDXL, Qwen-Image, Wan, Z-Image,
FLUX.2, LTX-2; Wan 2.2's two experts), called through the trainer's own family adapter
(``family.training_pair``, ``family.predict``) on inputs of the shapes the planner derives from
it (``workbench.plan.calls``): every family file-backed in fp32 (both formats where the factory
has no folder of its class), once in bf16 and once module-backed, the formats taking turns.

Not vacuous: the blocks really loaded their 8-bit images (``h2d_bytes`` is the images' bytes,
under 0.56x of the compute-dtype blocks), and the dequantized weights differ from the
checkpoint's (the reference is not the plain model).
"""

from __future__ import annotations

import json

import pytest
import torch

from stagehand.config.memory import SQUAREQ_FORMATS
from stagehand.squareq.runtime import dequantized_in_place
from stagehand.strategy import build_strategy
from stagehand.weights.registry import find_blocks
from workbench.worker.assets import build_model

from .device_double import SLOW, device_double
from .exact import STEPS, Run, assert_exact, build_toy, make_model, train

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test

FORMATS = list(SQUAREQ_FORMATS)


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


REFERENCES: dict[tuple, Run] = {}
"""``reference``'s runs of this module, by what decides them (dropped with the module)."""


@pytest.fixture(scope="module", autouse=True)
def _references():
    yield
    REFERENCES.clear()


def reference(arch, folder, fmt, dtype, cls=None, family=None, steps=STEPS):
    """The plain model (ordinary storage) with its blocks' frozen linear weights dequantized,
    trained (through ``family``'s call, ``family_forward``, when given): once per model folder,
    format, dtype, class, family and steps in this module. The run is deterministic, and what
    the checks vary besides (file- or module-backed, a host cache, the device double) is the
    strategy's, not the reference's: the checks of one model and format compare with one run."""
    key = (str(folder), fmt, dtype, cls, family, steps)
    if key not in REFERENCES:
        model = make_model(arch, folder, "lora", "non-reentrant", True, dtype, cls)
        count = dequantized_in_place([m for _, m in find_blocks(model)], fmt)
        assert count > 0
        forward = None if family is None else family_forward(family, dtype)
        REFERENCES[key] = train(model, steps=steps, forward=forward)
    return REFERENCES[key]


def check(
    folders,
    tmp_path,
    arch,
    fmt,
    file_backed,
    dtype=torch.float32,
    cls=None,
    family=None,
    steps=STEPS,
    **extra,
):
    """``cls``/``family``/``steps``: a pipeline family's transformer class, its adapter (the
    model is called through it, ``family_forward``) and fewer steps (``train``'s)."""
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
    forward = None if family is None else family_forward(family, dtype)
    got = train(model, built, steps=steps, forward=forward)
    assert_exact(reference(arch, folders[arch], fmt, dtype, cls, family, steps), got)
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
    return built


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("file_backed", [True, False], ids=["file-backed", "module-backed"])
def test_squareq_under_the_device_double_with_blocks_kept_across_step_ends(
    folders, tmp_path, dtype, file_backed
):
    """The GPU's conditions on the CPU (``device_double``, a device the host always runs ahead
    of): each image's copy and dequantization queued on the transfer stream and run late, device
    memory poisoned when freed, and a low watermark that keeps some blocks loaded across each
    step's end (module-backed: their images registered, as on CUDA, so exposed blocks copy their
    passthrough weights back into them): the numbers equal the dequantized model's."""
    # The resident weights (0.42 MB fp32, 0.21 bf16) and about one double block's buffer.
    low = 1.0 if dtype == torch.float32 else 0.55
    extra = {"vram_high_watermark_mb": 1000, "vram_low_watermark_mb": low}
    if not file_backed:
        extra["host_cache_mb"] = 64
    fmt = "int8" if file_backed else "fp8_e4m3"
    with device_double(SLOW) as device:
        built = check(folders, tmp_path, "flux", fmt, file_backed, dtype, **extra)
    last = built.weights.step_metrics()  # the last step's record: blocks kept at its end
    assert 0 < last["resident_blocks"] < len(built.weights.blocks) and last["blocks_evicted"]
    assert device.kernels_run > 0 and device.max_pending > 0 and device.poisoned_bytes > 0


PIPELINE_FAMILIES = ["flux", "sd3", "sdxl", "qwenimage", "wan", "zimage", "flux2", "ltx2"]
"""Every family the trainer trains from a pipeline folder (``workbench.worker.pipelines``)."""


def family_forward(family, dtype=torch.float32, seed_base: int = 100):
    """``forward(model, step)``: one training call of ``family`` in ``dtype`` (the run's
    ``model.dtype``) as the trainer's loop makes it
    (``family.training_pair`` then ``family.predict``: a Wan 2.2 expert's sigmas in its range,
    SDXL's integer timesteps) on seeded random latents and text of the shapes the planner
    derives through the same adapter (``workbench.plan.calls.latent_shape``: 32 px, 5 frames
    for a video family, 8 caption tokens, batch 1, uniform timesteps)."""
    from types import SimpleNamespace

    from workbench.plan.calls import latent_shape, pooled_dim
    from workbench.worker.families import Text

    preset = SimpleNamespace(
        batch_size=1,
        resolution=32,
        data=SimpleNamespace(frames=5 if family.video else None, max_caption_tokens=8),
        timestep_distribution="uniform",
        logit_mean=0.0,
        logit_std=1.0,
    )

    shape = latent_shape(family, preset, dtype)  # one value for every step: derived once

    def forward(model, step):
        g = torch.Generator().manual_seed(seed_base + step)
        b, tokens = shape[0], preset.data.max_caption_tokens
        text = Text(
            hidden=torch.randn(b, tokens, family.text_dim(model), generator=g).to(dtype),
            mask=torch.ones(b, tokens, dtype=torch.long),
            pooled=torch.randn(b, pooled_dim(model.config), generator=g).to(dtype),
        )
        x0, noise = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        x_t, t, _ = family.training_pair(x0, noise, g, preset)
        return family.predict(model, x_t, t, text)

    return forward


@pytest.fixture(scope="module")
def pipeline_families(asset_cache, tmp_path_factory):
    """Each family's adapter bound to its tiny pipeline folder (``tests/fixtures``); Wan 2.2's
    two-expert folder once per expert (``wan22-high_noise``, ``wan22-low_noise``), from a copy
    whose experts' files all have one modification time (as a Nix store or an image built
    with ``SOURCE_DATE_EPOCH`` has them): the experts' files then have the same names, sizes,
    headers and times, only their bytes differ."""
    import os
    import shutil

    from tests.fixtures.pipelines import build_pipeline
    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    cache = asset_cache / "trainer-cache"
    bound = {}
    for name in PIPELINE_FAMILIES:
        info = inspect_pipeline(build_pipeline(name, asset_cache))
        bound[name] = adapter_for(info, cache, torch.float32)
    wan22 = tmp_path_factory.mktemp("wan22") / "wan22-tiny"
    shutil.copytree(build_pipeline("wan22", asset_cache), wan22)
    for path in wan22.glob("transformer*/*.safetensors"):
        os.utime(path, ns=(10**9, 10**9))
    info = inspect_pipeline(wan22)
    for expert in info.experts:
        bound[f"wan22-{expert}"] = adapter_for(info, cache, torch.float32, expert=expert)
    return bound


def check_family(family, tmp_path, fmt, file_backed=True, dtype=torch.float32, **extra):
    """``check`` on the transformer ``family`` trains, called as the trainer calls it, for two
    steps (SquareQ's cache in ``tmp_path / "sq"``)."""
    import diffusers

    folder = family.transformer_dir
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    arch = "unet" if cls is diffusers.UNet2DConditionModel else family.name
    check({arch: folder}, tmp_path, arch, fmt, file_backed, dtype, cls, family, 2, **extra)


def alternating(names):
    """``(name, format)`` params: each family once, the formats taking turns."""
    return [
        pytest.param(n, FORMATS[i % 2], id=f"{n}-{FORMATS[i % 2]}") for i, n in enumerate(names)
    ]


FACTORY_FAMILIES = 3
"""Flux, SD3, SDXL: their denoisers' classes stream file-backed in fp32 in both formats above
(the factory's folders); through their pipeline adapters, once each, the formats in turn."""


@pytest.mark.parametrize(
    "name, fmt",
    alternating(PIPELINE_FAMILIES[:FACTORY_FAMILIES])
    + [
        pytest.param(n, f, id=f"{n}-{f}")
        for n in PIPELINE_FAMILIES[FACTORY_FAMILIES:]
        for f in FORMATS
    ],
)
def test_pipeline_family_squareq_trains_as_the_dequantized_model(
    pipeline_families, tmp_path, name, fmt
):
    """The denoiser a pipeline folder trains, called as the trainer calls it, streamed
    file-backed in 8 bits in fp32: as the resident dequantized model, for two steps."""
    check_family(pipeline_families[name], tmp_path, fmt)


@pytest.mark.parametrize("name, fmt", alternating(PIPELINE_FAMILIES))
def test_pipeline_family_bf16_squareq_trains_as_the_dequantized_model(
    pipeline_families, tmp_path, name, fmt
):
    """bf16 compute, file-backed: the cache quantizes the fp32 checkpoint's weights cast to
    bf16, as the resident bf16 model dequantizes its own."""
    check_family(pipeline_families[name], tmp_path, fmt, dtype=torch.bfloat16)


@pytest.mark.parametrize("name, fmt", alternating(PIPELINE_FAMILIES[1:] + PIPELINE_FAMILIES[:1]))
def test_pipeline_family_module_backed_squareq_trains_as_the_dequantized_model(
    pipeline_families, tmp_path, name, fmt
):
    """Module-backed, quantized in memory (each family in the other format than its bf16
    case). int8 turns: fp32, the host masters, the LoRA adapters streamed with their blocks
    (over ``resident_trainable_max_fraction`` in these tiny blocks). fp8_e4m3 turns: bf16,
    the adapters resident (as a real model's, a small fraction) and the 8-bit images
    registered in a host cache."""
    family = pipeline_families[name]
    if fmt == "int8":
        check_family(family, tmp_path, fmt, file_backed=False)
    else:
        resident = {"host_cache_mb": 64, "resident_trainable_max_fraction": 1.0}
        check_family(family, tmp_path, fmt, False, torch.bfloat16, **resident)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wan22_experts_squareq_train_as_the_dequantized_model(pipeline_families, tmp_path, fmt):
    """Wan 2.2's two experts (``transformer``: sigmas in [0.875, 1], ``transformer_2``: in
    [0, 0.875)), each streamed file-backed in 8 bits with one SquareQ cache folder between
    them, as two runs of one workbench share it: each trains as its own resident dequantized
    expert (``pipeline_families``: their files differ in their bytes only). Not vacuous: the
    experts' weights differ, and each got its own cache entry."""
    from safetensors.torch import load_file

    high, low = (pipeline_families[f"wan22-{e}"] for e in ("high_noise", "low_noise"))
    assert (high.transformer_dir.name, low.transformer_dir.name) == ("transformer", "transformer_2")
    a, b = (
        {k: v for f in e.transformer_dir.glob("*.safetensors") for k, v in load_file(f).items()}
        for e in (high, low)
    )
    assert (
        a
        and a.keys() == b.keys()
        and not any(torch.equal(a[k], b[k]) for k in a if a[k].dim() == 2)
    )
    for expert in (high, low):
        check_family(expert, tmp_path, fmt)
    assert len(list((tmp_path / "sq").glob(f"squareq-{fmt}-*"))) == 2
