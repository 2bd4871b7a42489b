"""CUDA-only checks: real D2H/H2D streams, pinned pool, inline finalize, allocator peak."""

import pytest
import torch
import torch.nn as nn

from runtime.activations import ActivationRuntime
from runtime.config import ActivationStagehandConfig

pytestmark = pytest.mark.gpu


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(16)]
    ).cuda()


def _step(model, x, runtime=None):
    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    if runtime is None:
        model(x).square().mean().backward()
    else:
        runtime.step_begin(0)
        with runtime.managed_forward():
            loss = model(x).square().mean()
            runtime.backward_begin()
            loss.backward()
        runtime.step_end()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()], torch.cuda.max_memory_allocated()


def test_cuda_spill_all_matches_and_lowers_the_allocator_peak():
    model = _stack()
    x = torch.randn(64, 256, device="cuda")
    ref, peak_plain = _step(model, x)
    config = ActivationStagehandConfig(
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        max_inflight_d2h=1,
        pinned_pool_classes_mb=(1, 4),
        slabs_per_class=(64, 4),
        debug_checksums=True,
    )
    runtime = ActivationRuntime(config, device="cuda", model=model)
    assert runtime.pool._chunks[0].is_pinned()
    for _ in range(2):
        grads, peak_spill = _step(model, x, runtime)
        assert all(torch.equal(a, b) for a, b in zip(ref, grads, strict=True))
    m = runtime.step_metrics()
    assert m["activations_spilled"] > 16  # more than one per step: inline finalize works
    assert runtime.metrics.inline_finalizes > 0
    assert m["activations_restored"] == m["activations_spilled"]
    assert m["stall_count"] == 0
    assert peak_spill < peak_plain
    runtime.close()


def test_cuda_keep_path_returns_none():
    runtime = ActivationRuntime(
        ActivationStagehandConfig(pinned_pool_classes_mb=(1,), slabs_per_class=1), device="cuda"
    )
    runtime.step_begin(0)
    assert runtime.packer(torch.zeros(1024, device="cuda")) is None
    runtime.step_end()
    runtime.close()
