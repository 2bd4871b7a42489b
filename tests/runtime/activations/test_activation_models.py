"""Activation spill on the tiny diffusers transformers: gradients bitwise equal to no hooks.

Three SGD steps of a LoRA model (fp32, CPU) with the runtime spilling everything (watermark 0),
spilling from a middle watermark, and spilling everything under gradient checkpointing; the
gradients of every step must equal those of the same steps without hooks, and the step records
must add up.
"""

import pytest
import torch

from stagehand.activations import ActivationRuntime
from stagehand.common.memory import DeviceMemory
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MB, ActivationStagehandConfig
from workbench.bench.activations import lora_model, train_steps

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test

STEPS = 3
POOL = {"pinned_pool_classes_mb": (0.0625, 0.25, 1), "slabs_per_class": (64, 16, 4)}
MODELS = [("flux", "tiny_flux"), ("sd3", "tiny_sd3"), ("ltx", "tiny_video")]


def _run(arch, folder, checkpointing=False, **fields):
    model = lora_model(arch, folder, checkpointing=checkpointing)
    if not fields:
        return train_steps(model, STEPS), None
    sink = ListSink()
    memory = DeviceMemory("cpu")
    config = ActivationStagehandConfig(**POOL, **fields)
    runtime = ActivationRuntime(
        config, device="cpu", memory=memory, telemetry=Telemetry(sink), model=model
    )
    out = train_steps(model, STEPS, runtime)
    # Everything of the step was released: nothing tracked, no record, no buffer out.
    assert memory.tracked_bytes() == 0
    assert len(runtime.registry) == 0
    assert runtime.pool.in_use() == 0
    assert [r["activations_spilled"] for r in sink.of("activation_stagehand", "step")] == [
        m["activations_spilled"] for m in out["metrics"]
    ]
    runtime.close()
    return out, runtime


def _assert_same_grads(ref, out):
    for step, (want, got) in enumerate(zip(ref["grads"], out["grads"], strict=True)):
        assert len(want) == len(got) > 0
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"
    assert any(bool(g.abs().sum() > 0) for g in ref["grads"][-1])


def _assert_counters(metrics, *, all_restored=True):
    for m in metrics:
        assert m["activations_saved"] == m["activations_kept"] + m["activations_spilled"]
        assert m["pool_hits"] + m["pool_misses"] == m["activations_spilled"]
        if all_restored:
            assert m["activations_restored"] == m["activations_spilled"]
            assert m["restore_bytes"] == m["spill_bytes"]
            assert m["stall_count"] + m["prefetch_hits"] == m["activations_restored"]


@pytest.mark.parametrize(("arch", "fixture"), MODELS)
def test_gradients_match_without_hooks(arch, fixture, request):
    folder = request.getfixturevalue(fixture)
    ref, _ = _run(arch, folder)

    keep, _ = _run(arch, folder, vram_high_watermark_mb=1e9, vram_low_watermark_mb=0)
    _assert_same_grads(ref, keep)
    keep_peak = keep["metrics"][-1]["vram_peak_mb"]
    assert all(m["activations_spilled"] == 0 for m in keep["metrics"])
    assert keep_peak > 0

    # Watermark 0: every eligible saved tensor spills (min_spill_bytes 0: tiny ones too).
    spill, _ = _run(
        arch, folder, vram_high_watermark_mb=0, vram_low_watermark_mb=0, min_spill_bytes=0
    )
    _assert_same_grads(ref, spill)
    _assert_counters(spill["metrics"])
    last = spill["metrics"][-1]
    assert last["activations_spilled"] > last["activations_saved"] // 4
    assert last["spill_bytes"] > 0
    assert last["vram_peak_mb"] < keep_peak / 2

    # Middle watermark: spilling starts once half of the KEEP-only peak is kept.
    middle, _ = _run(
        arch, folder, vram_high_watermark_mb=keep_peak / 2, vram_low_watermark_mb=keep_peak / 4
    )
    _assert_same_grads(ref, middle)
    _assert_counters(middle["metrics"])
    m = middle["metrics"][-1]
    assert 0 < m["activations_spilled"] < last["activations_spilled"]
    assert last["vram_peak_mb"] < m["vram_peak_mb"] < keep_peak


@pytest.mark.parametrize(("arch", "fixture"), MODELS)
def test_gradient_checkpointing_composes(arch, fixture, request):
    folder = request.getfixturevalue(fixture)
    ref, _ = _run(arch, folder)
    plain, _ = _run(arch, folder, vram_high_watermark_mb=0, vram_low_watermark_mb=0)
    ckpt, _ = _run(
        arch, folder, checkpointing=True, vram_high_watermark_mb=0, vram_low_watermark_mb=0
    )
    _assert_same_grads(ref, ckpt)
    _assert_counters(ckpt["metrics"])
    # Tensors checkpointing recomputes are never saved, so never spilled: only the block
    # inputs and what runs outside the checkpointed blocks reach the runtime.
    with_ckpt, without = ckpt["metrics"][-1], plain["metrics"][-1]
    assert 0 < with_ckpt["activations_saved"] < without["activations_saved"] / 3
    assert 0 < with_ckpt["activations_spilled"] < without["activations_spilled"]


def test_tracked_peak_counts_kept_tensors(tiny_flux):
    """On CPU, kept saved tensors are the tracked figure: spilling lowers the peak, and the
    figure returns to zero once backward has released everything."""
    model = lora_model("flux", tiny_flux)
    memory = DeviceMemory("cpu")
    config = ActivationStagehandConfig(**POOL, vram_high_watermark_mb=1e9)
    runtime = ActivationRuntime(config, device="cpu", memory=memory, model=model)
    train_steps(model, 1, runtime)
    peak = runtime.step_metrics()["vram_peak_mb"]
    assert peak * MB == memory.peak_bytes() > 0
    assert memory.tracked_bytes("activations") == 0
    runtime.set_watermarks(0, 0)
    train_steps(model, 1, runtime)
    assert runtime.step_metrics()["vram_peak_mb"] < peak / 2
    runtime.close()
