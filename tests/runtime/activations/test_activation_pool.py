"""CPUSpillBackend: size classes, fallback, release by data pointer, slab counts, growth."""

import pytest
import torch
import torch.nn as nn

from stagehand.activations import ActivationRuntime, CPUSpillBackend
from stagehand.config.memory import MB, ActivationStagehandConfig

KB = 1024


def test_smallest_fitting_class_then_larger_then_fallback():
    pool = CPUSpillBackend((0.0625, 0.25, 1), (2, 1, 1))
    assert pool.slab_bytes == (64 * KB, 256 * KB, MB)
    small = [pool.acquire(1000) for _ in range(2)]
    assert all(pooled for _, pooled in small)
    assert [b.numel() for b, _ in small] == [1000, 1000]
    assert pool.free_counts() == (0, 1, 1)
    # Class 0 is empty: the next larger class serves, then the next.
    buf, pooled = pool.acquire(1000)
    assert pooled and pool.free_counts() == (0, 0, 1)
    buf2, pooled2 = pool.acquire(100 * KB)  # fits class 1 (empty) -> class 2
    assert pooled2 and pool.free_counts() == (0, 0, 0)
    # Everything is out: an unpinned tensor outside the pool, counted as a miss.
    miss, pooled3 = pool.acquire(10 * KB)
    assert not pooled3 and miss.numel() == 10 * KB and miss.dtype == torch.uint8
    huge, pooled4 = pool.acquire(2 * MB)  # larger than every class
    assert not pooled4
    assert (pool.hits, pool.misses) == (4, 2)
    assert pool.in_use() == 6


def test_release_returns_slab_to_its_class_by_data_pointer():
    pool = CPUSpillBackend((0.0625, 0.25), 1)
    a, _ = pool.acquire(10)
    b, _ = pool.acquire(200 * KB)
    c, _ = pool.acquire(10)  # class 0 empty -> class 1 empty -> fallback
    assert pool.free_counts() == (0, 0)
    # A view with the same data pointer identifies the slab; the full slab comes back.
    pool.release(b[:5])
    assert pool.free_counts() == (0, 1)
    again, pooled = pool.acquire(256 * KB)
    assert pooled and again.data_ptr() == b.data_ptr() and again.numel() == 256 * KB
    pool.release(a)
    pool.release(c)
    assert pool.free_counts() == (1, 0)
    with pytest.raises(ValueError, match="is free already"):
        pool.release(a)
    with pytest.raises(ValueError, match="is not from this pool"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="positive byte count"):
        pool.acquire(0)


def test_slab_counts_from_int_and_tuple():
    uniform = CPUSpillBackend((0.0625, 0.25, 1), 3)
    assert uniform.slab_counts() == (3, 3, 3)
    assert uniform.total_bytes() == 3 * (64 * KB + 256 * KB + MB)
    per_class = CPUSpillBackend((0.0625, 0.25, 1), (4, 1, 0))
    assert per_class.slab_counts() == (4, 1, 0)
    assert per_class.free_counts() == (4, 1, 0)
    # A class with no slab passes requests on to the next.
    _, pooled = per_class.acquire(300 * KB)
    assert not pooled
    config = ActivationStagehandConfig(pinned_pool_classes_mb=(1, 4), slabs_per_class=2)
    assert config.slab_counts() == (2, 2)


@pytest.mark.parametrize(
    ("classes", "slabs", "match"),
    [
        ((), 1, "at least one size class"),
        ((4, 1), 1, "strictly ascending"),
        ((1, 1), 1, "strictly ascending"),
        ((0, 1), 1, "positive"),
        ((1, 4), (1, 2, 3), "has 3 counts but class_sizes_mb has 2"),
        ((1, 4), (1, -2), "counts >= 0"),
    ],
)
def test_bad_pool_shapes_raise_named_errors(classes, slabs, match):
    with pytest.raises(ValueError, match=match):
        CPUSpillBackend(classes, slabs)


def test_grow_within_budget_and_unknown_class():
    pool = CPUSpillBackend((0.0625, 0.25), 1, growth_budget_mb=0.5)
    assert pool.grow(0.25, 3) == 2  # 0.5 MB buys two 256 KB slabs
    assert pool.slab_counts() == (1, 3)
    assert pool.grow(0.0625, 1) == 0  # budget spent
    assert pool.grown_bytes == 512 * KB
    bufs = [pool.acquire(200 * KB)[1] for _ in range(3)]
    assert bufs == [True, True, True]
    with pytest.raises(ValueError, match=r"no size class of 2 MB; pinned_pool_classes_mb is"):
        pool.grow(2, 1)
    with pytest.raises(ValueError, match="slabs must be >= 0"):
        pool.grow(0.25, -1)


def test_runtime_grows_pool_after_a_step_with_many_misses():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    x = torch.randn(32, 64)  # each saved activation: 8 KB
    config = ActivationStagehandConfig(
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        pinned_pool_classes_mb=(0.0625,),
        slabs_per_class=2,
        pool_growth_miss_threshold=4,
        pinned_growth_budget_mb=0.5,  # 8 more slabs of 64 KB
    )
    runtime = ActivationRuntime(config, device="cpu", model=model)
    misses = []
    for step in range(3):
        runtime.begin_step(step)
        with runtime.managed_forward():
            model(x).sum().backward()
        runtime.end_step()
        m = runtime.step_metrics()
        assert m["pool_hits"] + m["pool_misses"] == m["activations_spilled"] == 12
        misses.append(m["pool_misses"])
    # 12 spills live at once, 2 slabs: 10 misses > threshold, so 8 slabs are added (budget).
    assert misses == [10, 2, 2]
    assert runtime.pool.slab_counts() == (10,)
    runtime.close()
