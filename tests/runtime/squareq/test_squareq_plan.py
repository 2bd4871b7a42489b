"""The plan follows SquareQ's format: FLUX.1-dev (bf16, built on meta from its config, LoRA r16)
planned on a 24 GB card with ``squareq`` moves and caches the 8-bit images: <= 0.52x of bf16's
bytes per step and in the host cache, which fits 12 GB (22.6 GB of bf16 blocks without it)."""

import math

import pytest

from stagehand.config.memory import MB
from workbench.plan.plan import check_memory
from workbench.plan.reference import flux_dev_plan, streaming_memory
from workbench.plan.sections import block_sizes, weight_section


@pytest.fixture(scope="module")
def plain() -> dict:
    """The bf16 plan both formats are compared with, planned once (~5 s)."""
    return flux_dev_plan("rtx4090", 1024, streaming_memory(18000, 14000, 16000)).to_dict()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_flux_dev_plan_in_8_bits(fmt, plain):
    quantized = streaming_memory(18000, 14000, 16000)
    quantized["stagehand"]["squareq"] = {"format": fmt}
    planned = flux_dev_plan("rtx4090", 1024, quantized)
    got = planned.to_dict()
    assert got["blocks_loaded"] == plain["blocks_loaded"] > 0  # every block still loaded
    assert got["h2d_bytes"] <= 0.52 * plain["h2d_bytes"]
    cache, cache_bf16 = got["host"]["host_cache_bytes"], plain["host"]["host_cache_bytes"]
    assert cache <= 0.52 * cache_bf16 and cache <= 12 * 1024 * MB
    assert cache_bf16 > 22 * 1000 * MB  # the 22.6 GB a 32 GB host cannot cache
    # The pool's slabs stage the 8-bit images too: as many slabs, each the largest image's MB.
    pool, pool_bf16 = (
        got["host"]["pinned_bytes"] - cache,
        plain["host"]["pinned_bytes"] - cache_bf16,
    )
    # The weight runtime's pool is as many slabs, each the largest image's MB (the activation
    # spill's pool, also pinned, unchanged).
    inv = planned.inventory
    slab_bf16 = math.ceil(max(block_sizes(inv)) / MB)
    slab = math.ceil(max(b.image_bytes for b in inv.blocks) / MB)
    section = weight_section(inv, check_memory(quantized), planned.profile)
    assert section.pinned_slab_mb == slab and 0.45 * slab_bf16 < slab <= 0.52 * slab_bf16
    slabs = section.pinned_pool_mb // slab
    assert pool_bf16 - pool == slabs * (slab_bf16 - slab) * MB > 0
    print(
        f"{fmt}: h2d {got['h2d_bytes'] / 1e9:.2f} GB/step vs {plain['h2d_bytes'] / 1e9:.2f}; "
        f"host cache {cache / 1e9:.2f} GB vs {cache_bf16 / 1e9:.2f}; "
        f"step {got['step_ms']['total']:.0f} ms vs {plain['step_ms']['total']:.0f}; "
        f"slab {slab} MB vs {slab_bf16}, weight pool {section.pinned_pool_mb} MB"
    )
