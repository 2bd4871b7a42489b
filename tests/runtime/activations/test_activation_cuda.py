"""CUDA-only checks: real D2H/H2D streams, pinned pool, inline finalize, allocator peak."""

import pytest
import torch
import torch.nn as nn

from stagehand.activations import ActivationRuntime
from stagehand.config.memory import ActivationStagehandConfig

pytestmark = pytest.mark.gpu


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(16)]
    ).cuda()


def _step(model, x, runtime=None, hold_d2h=False):
    """One step; returns (gradients, allocator peak of the forward, of the whole step), the
    peaks in bytes above what was allocated when the step began (other steps' results stay out),
    read before the gradients are copied."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    if hold_d2h:
        # Hold the D2H stream (~50 ms): every spill's copy is still in flight when the next tensor
        # is saved, so with max_inflight_d2h=1 each further spill first finalizes the one before
        # inline (on a fast GPU a free slot is otherwise always found).
        with torch.cuda.stream(runtime.transfer.d2h.stream):
            torch.cuda._sleep(100_000_000)
    if runtime is None:
        loss = model(x).square().mean()
        forward_peak = torch.cuda.max_memory_allocated() - start
        loss.backward()
    else:
        runtime.begin_step(0)
        with runtime.managed_forward():
            loss = model(x).square().mean()
            forward_peak = torch.cuda.max_memory_allocated() - start
            runtime.backward_begin()
            loss.backward()
        runtime.end_step()
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - start
    return [p.grad.clone() for p in model.parameters()], forward_peak, step_peak


def test_cuda_spill_all_matches_and_lowers_the_allocator_peak():
    """Spill-all on real streams: gradients bit-identical, every spill restored without a stall,
    inline finalize when the D2H slot is busy, and the forward's allocator peak lower by most of
    the spilled bytes (this model's step peak is in backward, where the weight gradients are)."""
    model = _stack()
    x = torch.randn(64, 256, device="cuda")
    _step(model, x)  # the first step allocates cuBLAS's workspaces (one per thread)
    ref, plain_forward, plain_step = _step(model, x)
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
    grads, spill_forward, spill_step = _step(model, x, runtime)
    assert all(torch.equal(a, b) for a, b in zip(ref, grads, strict=True))
    spilled = runtime.step_metrics()["spill_bytes"]
    assert spilled > 0 and plain_forward - spill_forward >= spilled // 2
    assert spill_step <= plain_step + spilled // 8  # restores do not raise the step's peak
    grads, _, _ = _step(model, x, runtime, hold_d2h=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, grads, strict=True))
    m = runtime.step_metrics()
    assert m["activations_spilled"] > 16  # more than one per step: inline finalize works
    assert runtime.metrics.inline_finalizes > 0
    assert m["activations_restored"] == m["activations_spilled"]
    assert m["stall_count"] == 0
    runtime.close()


def test_cuda_keep_path_returns_none():
    runtime = ActivationRuntime(
        ActivationStagehandConfig(pinned_pool_classes_mb=(1,), slabs_per_class=1), device="cuda"
    )
    runtime.begin_step(0)
    assert runtime.packer(torch.zeros(1024, device="cuda")) is None
    runtime.end_step()
    runtime.close()
