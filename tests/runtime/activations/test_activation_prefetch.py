"""Predictive restore in backward order: stalls (restores issued at unpack time) vanish after
the trace step, against every restore stalling without it."""

import pytest
import torch
import torch.nn as nn

from stagehand.activations import ActivationRuntime
from stagehand.config.memory import ActivationStagehandConfig
from workbench.bench.activations import lora_model, train_steps

STEPS = 3


class Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _config(**fields):
    return ActivationStagehandConfig(
        vram_high_watermark_mb=0,
        vram_low_watermark_mb=0,
        min_spill_bytes=0,
        pinned_pool_classes_mb=(0.0625, 0.25),
        slabs_per_class=(256, 8),
        **fields,
    )


def _mlp_steps(runtime, model, backward_begin=True):
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    grads, metrics = [], []
    for step in range(STEPS):
        runtime.begin_step(step)
        with runtime.managed_forward():
            loss = model(x).square().mean()
            if backward_begin:
                runtime.backward_begin()
            loss.backward()
        runtime.end_step()
        metrics.append(runtime.step_metrics())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.fixture
def stack():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(16)])


@pytest.mark.sync_device  # the schedule of a device whose copies land at once
def test_stalls_vanish_after_the_trace_step_on_a_16_block_stack(stack):
    off = ActivationRuntime(_config(predictive_restore=False), device="cpu", model=stack)
    grads_off, reactive = _mlp_steps(off, stack)
    on = ActivationRuntime(_config(predictive_restore=True), device="cpu", model=stack)
    grads_on, predictive = _mlp_steps(on, stack)
    for a, b in zip(grads_off, grads_on, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for m in reactive:
        assert m["activations_spilled"] > 16 * 4
        assert m["stall_count"] == m["activations_restored"] == m["activations_spilled"]
        assert m["prefetch_hits"] == 0
    for m in predictive:
        assert m["stall_count"] + m["prefetch_hits"] == m["activations_spilled"]
    # Reverse pack order already predicts most of a plain stack; the trace predicts all of it.
    assert predictive[0]["stall_count"] < predictive[0]["activations_spilled"] // 4
    assert [m["stall_count"] for m in predictive[1:]] == [0] * (STEPS - 1)
    assert on.planner.traced
    for runtime in (off, on):
        runtime.close()


def test_without_backward_begin_only_the_first_unpack_stalls(stack):
    runtime = ActivationRuntime(_config(restore_ahead=1), device="cpu", model=stack)
    _, metrics = _mlp_steps(runtime, stack, backward_begin=False)
    assert [m["stall_count"] for m in metrics[1:]] == [1] * (STEPS - 1)
    runtime.close()


def test_trace_fixes_what_reverse_pack_order_misses_on_tiny_flux(tiny_flux):
    """Flux's joint attention unpacks its saved tensors far from reverse pack order: the
    first step stalls often with a window of 1, the traced steps never."""
    model = lora_model("flux", tiny_flux)
    runtime = ActivationRuntime(_config(restore_ahead=1), device="cpu", model=model)
    out = train_steps(model, STEPS, runtime)
    stalls = [m["stall_count"] for m in out["metrics"]]
    assert stalls[0] > 10
    assert stalls[1:] == [0] * (STEPS - 1)
    off_model = lora_model("flux", tiny_flux)
    off = ActivationRuntime(_config(predictive_restore=False), device="cpu", model=off_model)
    reactive = train_steps(off_model, STEPS, off)
    assert [m["stall_count"] for m in reactive["metrics"]] == [
        m["activations_spilled"] for m in reactive["metrics"]
    ]
    for a, b in zip(out["grads"], reactive["grads"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    runtime.close()
    off.close()
