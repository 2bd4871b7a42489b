"""With SquareQ the weight runtime's pinned slabs stage the 8-bit images: the slab and pool
derived for a card follow the bytes staged (``defaults.staged_sizes``), about half of bf16's,
and the plan's pinned figure is the pool the runtime derives, with the format and without."""

import math

import pytest
import torch

from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights import WeightRuntime, setup
from stagehand.weights.defaults import block_bytes, resolve, staged_sizes
from stagehand.weights.registry import find_blocks
from workbench.plan.inventory import add_lora, meta_model
from workbench.plan.plan import plan_model
from workbench.plan.profiles import profile
from workbench.plan.reference import FLUX_LORA_TARGETS
from workbench.worker.assets import example_inputs

CONFIG = {  # FLUX's layout at 512 wide: ~7.5 MB blocks in bf16, several slabs' worth
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 64,
    "num_attention_heads": 8,
    "joint_attention_dim": 64,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 24, 24),
}
CARD = profile("h100")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux512")
    FluxTransformer2DModel.from_config(CONFIG).to(torch.bfloat16).save_pretrained(path)
    return path


def runtime_pool(folder, squareq, cache, monkeypatch) -> tuple[int, int, list[int]]:
    """``(slab, pool)`` bytes the runtime derives for its blocks on ``CARD``, and the bytes it
    stages per block. A CPU run takes the CPU's fixed pool, so the sizes its set-up passes to
    ``resolve`` are recorded and resolved for the card."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    add_lora(model, 4, FLUX_LORA_TARGETS)
    expected = block_bytes(find_blocks(model))  # before set-up moves the weights
    calls = []
    monkeypatch.setattr(setup, "resolve", lambda *a, **k: calls.append((a, k)) or resolve(*a, **k))
    section = {"squareq": {"format": squareq, "cache_dir": str(cache)}} if squareq else {}
    config = StagehandConfig(vram_high_watermark_mb=1000, vram_low_watermark_mb=0, **section)
    rt = WeightRuntime(model, config, device="cpu", checkpoint_dir=folder)
    staged = [b.staged_bytes for b in rt.blocks]
    assert rt.squareq.enabled == (squareq is not None)
    rt.close()
    [((_, sizes), kwargs)] = calls  # one resolve, after SquareQ.attach
    assert list(sizes) == expected
    assert kwargs["staged"] == staged_sizes(squareq is not None, staged)
    got = resolve(
        StagehandConfig(), sizes, staged=kwargs["staged"], cuda=True, vram_bytes=CARD.vram_bytes
    )
    return got.pinned_slab_mb * MB, got.pinned_pool_mb * MB, staged


def planned_pinned(squareq) -> int:
    """The plan's pinned bytes less its host cache: the weight runtime's pool."""
    model = meta_model("FluxTransformer2DModel", CONFIG, torch.bfloat16)
    add_lora(model, 4, FLUX_LORA_TARGETS)
    memory = {
        "strategy": "stagehand",
        "gradient_checkpointing": True,
        "stagehand": {"vram_high_watermark_mb": 60000, "vram_low_watermark_mb": 50000},
    }
    if squareq:
        memory["stagehand"]["squareq"] = {"format": squareq}
    inputs = example_inputs(model, latent_hw=(8, 8), text_len=8, device="meta")
    host = plan_model(model, inputs, memory, CARD).to_dict()["host"]
    return host["pinned_bytes"] - host["host_cache_bytes"]


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_slabs_follow_the_8_bit_images_in_the_runtime_and_the_plan(
    folder, tmp_path, monkeypatch, fmt
):
    slab16, pool16, staged16 = runtime_pool(folder, None, tmp_path, monkeypatch)
    slab8, pool8, staged8 = runtime_pool(folder, fmt, tmp_path, monkeypatch)
    # Exact figures from the block sizes: one slab holds the largest staged block, rounded up
    # to a MB; the pool one slab per copy in flight plus one (the same count in both).
    assert slab16 == math.ceil(max(staged16) / MB) * MB >= 4 * MB
    assert slab8 == math.ceil(max(staged8) / MB) * MB
    assert pool16 // slab16 == pool8 // slab8 > 1
    assert 0.45 < slab8 / slab16 < 0.6 and 0.45 < pool8 / pool16 < 0.6
    # The plan's pinned figure is the runtime's pool, with and without the format.
    assert planned_pinned(None) == pool16
    assert planned_pinned(fmt) == pool8
    print(
        f"{fmt}: slab {slab8 / MB:.0f} MB vs {slab16 / MB:.0f}; pool {pool8 / MB:.0f} vs {pool16 / MB:.0f}"
    )
