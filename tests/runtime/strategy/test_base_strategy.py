import pydantic
import pytest
import torch

from stagehand.common.phases import PhaseError
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.strategy import build_strategy


def _strategy():
    model = torch.nn.Linear(4, 4)
    sink = ListSink()
    return (
        model,
        sink,
        build_strategy(model, {"strategy": "none"}, device="cpu", telemetry=Telemetry(sink)),
    )


def test_none_strategy_runs_a_step_and_times_phases():
    model, sink, strategy = _strategy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with strategy.step(0):
        with strategy.forward():
            loss = model(torch.ones(2, 4)).pow(2).sum()
        with strategy.backward():
            loss.backward()
        with strategy.optimizer(opt):
            opt.step()
    assert not torch.equal(before, model.weight)
    assert set(strategy.phase_ms) == {"step_begin", "forward", "backward", "optimizer"}
    assert sum(strategy.phase_ms.values()) <= strategy.step_ms


def test_phases_outside_a_step_or_out_of_order_raise():
    _, _, strategy = _strategy()
    with pytest.raises(PhaseError, match="outside a step"):
        with strategy.forward():
            pass
    with pytest.raises(PhaseError, match="after STEP_BEGIN expected"):
        with strategy.step(0):
            with strategy.backward():
                pass
    with pytest.raises(PhaseError, match="do not nest"):
        with strategy.step(1):
            with strategy.step(2):
                pass


def test_a_second_forward_in_a_step_names_how_to_accumulate_gradients():
    model, _, strategy = _strategy()
    with pytest.raises(
        PhaseError, match="gradient accumulation run each micro-batch in a step of its own"
    ):
        with strategy.step(0):
            for _ in range(2):  # two micro-batches in one step
                with strategy.forward():
                    loss = model(torch.ones(2, 4)).sum()
                with strategy.backward():
                    loss.backward()


def test_limits_apply_at_next_step_begin_and_are_acknowledged():
    _, sink, strategy = _strategy()
    strategy.set_limits({"vram_high_watermark_mb": 10, "vram_low_watermark_mb": 5}, "req-1")
    assert sink.of(kind="limits_applied") == []
    with strategy.step(0):
        pass
    (ack,) = sink.of(kind="limits_applied")
    assert ack["request_id"] == "req-1" and ack["step"] == 0 and ack["phase"] == "step_begin"


def test_invalid_limits_name_the_field():
    _, _, strategy = _strategy()
    with pytest.raises(pydantic.ValidationError, match="vram_low_watermark_mb"):
        strategy.set_limits({"vram_high_watermark_mb": 1, "vram_low_watermark_mb": 2})
    with pytest.raises(pydantic.ValidationError, match="prefetch_window_blocks"):
        strategy.set_limits({"prefetch_window_blocks": -1})
    with pytest.raises(pydantic.ValidationError, match="watermark_gb"):
        strategy.set_limits({"watermark_gb": 1})
