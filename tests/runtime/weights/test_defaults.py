"""Pipeline settings a preset leaves out (``runtime/stagehand/weights/defaults.py``): derived from the
blocks and the card, the same in the runtime and the planner, given ones kept."""

from __future__ import annotations

import pytest
import torch

from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights import WeightRuntime
from stagehand.weights.defaults import CPU, Pipeline, block_bytes, pipeline, resolve
from stagehand.weights.registry import find_blocks
from workbench.plan.inventory import add_lora, meta_model
from workbench.plan.profiles import profile
from workbench.plan.reference import FLUX_DEV_CONFIG, FLUX_LORA_TARGETS, flux_dev_plan

from ._train import make_model

GB = 1024 * MB


@pytest.fixture(scope="module")
def flux_dev_sizes() -> list[int]:
    """FLUX.1-dev's blocks (LoRA r16 on the attention projections), built on ``meta``."""
    model = meta_model("FluxTransformer2DModel", FLUX_DEV_CONFIG, torch.bfloat16)
    add_lora(model, 16, FLUX_LORA_TARGETS)
    return block_bytes(find_blocks(model))


def test_flux_dev_on_an_80_gb_card(flux_dev_sizes):
    sizes = flux_dev_sizes
    assert len(sizes) == 19 + 38
    largest = max(sizes)
    assert largest == 680_450_048  # a double-stream block, 649 MiB
    got = pipeline(sizes, cuda=True, vram_bytes=80 * GB, cpus=16)
    # 1 GiB ahead / 649 MiB -> 2 blocks (the window of today's default: peak VRAM unchanged);
    # twice as many copies in flight; one 649 MB slab per copy plus one; 8 of 16 cores read.
    assert got == Pipeline(
        prefetch_window_blocks=2,
        max_inflight_transfers=4,
        pinned_slab_mb=649,
        pinned_pool_mb=5 * 649,
        reader_threads=8,
    )
    assert got.pinned_slab_mb * MB >= largest  # no block takes the direct path


def test_flux_dev_on_a_12_gb_card_keeps_the_window_within_a_tenth_of_it(flux_dev_sizes):
    got = pipeline(flux_dev_sizes, cuda=True, vram_bytes=12 * GB, cpus=4)
    # 1.2 GB holds one block besides the one in use.
    assert (got.prefetch_window_blocks, got.max_inflight_transfers) == (1, 2)
    assert (got.pinned_pool_mb, got.reader_threads) == (3 * 649, 2)


def test_a_tiny_model(tiny_flux):
    sizes = block_bytes(find_blocks(make_model("flux", tiny_flux)))
    assert len(sizes) == 4 and max(sizes) < MB
    # Small blocks: as deep as the model allows (every other block ahead), 1 MB slabs.
    assert pipeline(sizes, cuda=True, vram_bytes=80 * GB, cpus=2) == Pipeline(3, 6, 1, 7, 2)
    assert pipeline(sizes, cuda=False) == CPU == Pipeline(2, 2, 1024, 8192, 0)


def test_resolve_keeps_what_the_preset_gives():
    sizes = [300 * MB, 650 * MB]
    given = StagehandConfig(prefetch_window_blocks=3, pinned_slab_mb=700)
    got = resolve(given, sizes, cuda=True, vram_bytes=80 * GB, cpus=8)
    assert got.prefetch_window_blocks == 3 and got.max_inflight_transfers == 2  # n - 1 = 1, x2
    assert (got.pinned_slab_mb, got.pinned_pool_mb) == (700, 3 * 700)
    pool_only = resolve(StagehandConfig(pinned_pool_mb=100), sizes, cuda=True, vram_bytes=0)
    assert (pool_only.pinned_pool_mb, pool_only.pinned_slab_mb) == (100, 100)
    # On CPU a given slab keeps the pool of before (8192 MB, allocated on use).
    cpu = resolve(StagehandConfig(pinned_slab_mb=1), sizes, cuda=False)
    assert (cpu.pinned_slab_mb, cpu.pinned_pool_mb, cpu.prefetch_window_blocks) == (1, 8192, 2)


def test_the_runtime_runs_with_the_derived_settings(tiny_flux):
    model = make_model("flux", tiny_flux)
    config = StagehandConfig(vram_high_watermark_mb=1000, vram_low_watermark_mb=1000)
    runtime = WeightRuntime(model, config, device="cpu", checkpoint_dir=tiny_flux)
    assert runtime.scheduler.prefetch_window == 2 and runtime.transfer.max_inflight == 2
    assert (runtime.pool.slab_bytes, runtime.pool.pool_bytes) == (1024 * MB, 8192 * MB)
    assert runtime.transfer.readers is None
    assert runtime.config.prefetch_window_blocks == 2  # the resolved config
    runtime.close()


def test_the_planner_simulates_the_derived_pipeline():
    memory = {
        "strategy": "stagehand",
        "gradient_checkpointing": True,
        "stagehand": {"vram_high_watermark_mb": 60000, "vram_low_watermark_mb": 50000},
    }
    plan = flux_dev_plan("h100", 1024, memory)
    host = plan.to_dict()["host"]
    assert host["pinned_bytes"] - host["host_cache_bytes"] == 5 * 649 * MB  # the derived pool
    # host_cache_mb left out: on a GPU every frozen block may be cached (the LoRA is resident).
    assert host["host_cache_bytes"] == plan.inventory.block_bytes
    assert profile("h100").vram_bytes > 12 * GB
