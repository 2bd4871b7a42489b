"""``"auto"`` watermarks and caps (NOTE [ Auto watermarks ], NOTE [ Who gives way ]): validated as
a pair, resolved by the strategy at build from the blocks, the trainable bytes and the budget,
and the weight watermarks again after the trace step from the measured activation peak."""

import pydantic
import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.conductor.arbitration import AUTO_PRESSURE_THRESHOLD
from stagehand.config.memory import MB, ConductorConfig, MemoryConfig, StagehandSection
from stagehand.strategy import build_strategy
from stagehand.strategy.auto import trainable_bytes
from stagehand.weights.defaults import block_bytes
from stagehand.weights.registry import find_blocks
from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor

AUTO = {"vram_high_watermark_mb": "auto", "vram_low_watermark_mb": "auto"}
CAP_MB = 4.0  # a tracked budget on the CPU device: the Conductor's soft cap


def test_auto_is_a_pair_of_fields():
    assert StagehandSection(**AUTO).vram_high_watermark_mb == "auto"
    with pytest.raises(pydantic.ValidationError, match='must both be "auto" or both MB'):
        StagehandSection(vram_high_watermark_mb="auto", vram_low_watermark_mb=10)
    with pytest.raises(pydantic.ValidationError, match="vram_high_watermark_mb"):
        StagehandSection(vram_high_watermark_mb="sometimes", vram_low_watermark_mb=10)
    with pytest.raises(pydantic.ValidationError, match="vram_hard_cap_mb and vram_soft_cap_mb"):
        ConductorConfig(vram_soft_cap_mb="auto", vram_hard_cap_mb=100)
    assert ConductorConfig(vram_soft_cap_mb="auto", vram_hard_cap_mb="auto").enabled is False


def _memory(soft_cap_mb: float | str) -> dict:
    hard = soft_cap_mb if soft_cap_mb == "auto" else soft_cap_mb * 2
    return MemoryConfig.model_validate(
        {
            "strategy": "stagehand",
            "gradient_checkpointing": False,
            "stagehand": {
                **AUTO,
                "pinned_pool_mb": 4,
                "pinned_slab_mb": 1,
                "prefetch_window_blocks": 1,
                "activation_stagehand": {"enabled": True, **AUTO},
                "conductor_config": {
                    "enabled": True,
                    "vram_soft_cap_mb": soft_cap_mb,
                    "vram_hard_cap_mb": hard,
                },
            },
        }
    )


def _train(model, strategy, steps=2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        with strategy.step(step):
            with strategy.forward():
                loss = output_tensor(model(**example_inputs(model, seed=step))).pow(2).mean()
            with strategy.backward():
                loss.backward()
            with strategy.optimizer(opt):
                opt.step()
                opt.zero_grad(set_to_none=True)


def test_the_strategy_resolves_auto_from_the_budget_then_from_the_measured_peak(tiny_flux):
    model = exact.make_model("flux", tiny_flux, "lora", None)
    sizes = block_bytes(find_blocks(model))
    trainable = trainable_bytes(model)
    assert trainable > 0
    sink = ListSink()
    strategy = build_strategy(
        model, _memory(CAP_MB), device="cpu", telemetry=Telemetry(sink), checkpoint_dir=tiny_flux
    )
    try:
        # At build: the soft cap less the trainable bytes and twice the window (no margin on a
        # tracked device, no planned activations).
        window = max(sizes)
        high = (CAP_MB * MB - trainable - window) / MB
        assert strategy.weights.high_mb == pytest.approx(high)
        assert strategy.weights.low_mb == pytest.approx(high - window / MB)
        act = strategy.section.activation_stagehand
        assert (act.vram_high_watermark_mb, act.vram_low_watermark_mb) == (
            CAP_MB,
            CAP_MB - window / MB,
        )
        cond = strategy.section.conductor_config
        assert (cond.vram_soft_cap_mb, cond.backward_pressure_threshold) == (
            CAP_MB,
            AUTO_PRESSURE_THRESHOLD,
        )
        _train(model, strategy)
        # After the trace step the measured activation peak (kept saved tensors, tracked)
        # lowered both weight watermarks by it, through the live limits.
        built, applied = [
            r for r in sink.of("strategy", "limits_applied") if r["request_id"] == "auto"
        ]
        # At build: what "auto" became, for the run page's limits in force.
        assert built["changed"]["vram_high_watermark_mb"] == ["auto", pytest.approx(high)]
        assert built["changed"]["activation_vram_high_watermark_mb"] == ["auto", CAP_MB]
        old, new = applied["changed"]["vram_high_watermark_mb"]
        assert old == pytest.approx(high) and 0 < new < old
        low_old, low_new = applied["changed"]["vram_low_watermark_mb"]
        assert old - new == pytest.approx(low_old - low_new)
        assert strategy.weights.high_mb == new
    finally:
        strategy.close()


def test_a_budget_too_small_names_the_figures(tiny_flux):
    model = exact.make_model("flux", tiny_flux, "lora", None)
    with pytest.raises(ValueError, match="auto watermarks: the device's 0 MB"):
        build_strategy(model, _memory(0.01), device="cpu", checkpoint_dir=tiny_flux)


def test_no_budget_on_a_cpu_device_keeps_every_block(tiny_flux):
    model = exact.make_model("flux", tiny_flux, "lora", None)
    strategy = build_strategy(model, _memory("auto"), device="cpu", checkpoint_dir=tiny_flux)
    try:
        _train(model, strategy, steps=2)
        counters = strategy.counters()
        assert counters["blocks_loaded"] == 0 and counters["resident_blocks"] == len(
            strategy.weights.blocks
        )
    finally:
        strategy.close()


def test_an_inference_strategy_writes_no_limits_record(tiny_flux):
    # The samples at a run's end stream through a strategy of their own: its "auto" figures
    # are not the run's live limits, and a limits_applied record of it reset the run's
    # limits in force (GET /api/runs/{id}/limits, Compare) to them at the last step.
    model = exact.make_model("flux", tiny_flux, "lora", None)
    sink = ListSink()
    strategy = build_strategy(
        model,
        _memory(CAP_MB),
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=tiny_flux,
        mode="inference",
    )
    try:
        assert strategy.weights.high_mb < CAP_MB  # "auto" resolved all the same
        for step in range(2):
            with torch.no_grad(), strategy.step(step), strategy.forward():
                model(**example_inputs(model, seed=step))
    finally:
        strategy.close()
    assert sink.of("strategy", "limits_applied") == []
