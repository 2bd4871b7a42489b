"""Step boundaries on the phase vocabulary (NOTE [ Step boundaries ] in runtime/weights/runtime.py)."""

import torch

from runtime.common import ListSink, Telemetry
from runtime.common.phases import Phase
from runtime.weights import StagehandRuntime

from ._train import Wide, config

N_BLOCKS = 3


def _runtime():
    torch.manual_seed(0)
    model = Wide(width=16, depth=N_BLOCKS)
    sink = ListSink()
    runtime = StagehandRuntime(model, config(), device="cpu", telemetry=Telemetry(sink))
    return model, runtime, sink


def _forward(model, runtime):
    with runtime.managed_forward():
        return model(torch.randn(2, 16)).pow(2).mean()


def _backward(runtime, loss):
    with runtime.managed_backward():
        loss.backward()


def _steps(sink):
    return [r["step"] for r in sink.of("stagehand", "step")]


def test_begin_step_forward_backward_end_step_are_the_phases():
    model, runtime, sink = _runtime()
    assert runtime.phases.phase is None
    runtime.begin_step(5)
    assert runtime.phases.phase is Phase.STEP_BEGIN
    loss = _forward(model, runtime)
    assert runtime.phases.phase is Phase.FORWARD
    _backward(runtime, loss)
    assert runtime.phases.phase is Phase.BACKWARD
    runtime.end_step()
    assert runtime.phases.phase is Phase.STEP_END
    assert _steps(sink) == [5]
    assert sink.of("stagehand", "step")[0]["step_time_ms"] > 0
    runtime.close()


def test_a_step_begun_by_begin_step_lasts_until_end_step():
    """Gradient accumulation: two forwards and backwards in one explicit step."""
    model, runtime, sink = _runtime()
    runtime.begin_step(0)
    for _ in range(2):
        _backward(runtime, _forward(model, runtime))
    assert (runtime.phases.phase, _steps(sink)) == (Phase.BACKWARD, [])
    runtime.end_step()
    enters = [r for r in sink.of("stagehand", "block") if r["event"] == "enter"]
    assert _steps(sink) == [0] and len(enters) == 2 * 2 * N_BLOCKS
    runtime.close()


def test_without_begin_step_a_forward_after_backward_begins_the_next_step():
    model, runtime, sink = _runtime()
    for _ in range(2):
        _backward(runtime, _forward(model, runtime))
    assert _steps(sink) == [0]
    _forward(model, runtime)
    assert (runtime.step, runtime.phases.phase, _steps(sink)) == (2, Phase.FORWARD, [0, 1])
    runtime.end_step()
    assert _steps(sink) == [0, 1, 2]
    runtime.close()


def test_without_begin_step_forward_only_steps_begin_at_the_first_block_again():
    model, runtime, sink = _runtime()
    with torch.no_grad():
        for _ in range(3):
            _forward(model, runtime)
    runtime.end_step()
    assert _steps(sink) == [0, 1, 2]
    # with gradients on, a second forward without backward is the same step
    _forward(model, runtime)
    _forward(model, runtime)
    runtime.end_step()
    assert _steps(sink) == [0, 1, 2, 3]
    runtime.close()


def test_a_forward_after_end_step_begins_the_next_step():
    model, runtime, sink = _runtime()
    runtime.begin_step(7)
    loss = _forward(model, runtime)
    runtime.end_step()
    _backward(runtime, loss)  # outside a step: no phase entered, no step begun
    assert (runtime.phases.phase, _steps(sink)) == (Phase.STEP_END, [7])
    _forward(model, runtime)
    assert (runtime.step, runtime.phases.phase) == (8, Phase.FORWARD)
    runtime.close()  # closes step 8
    assert _steps(sink) == [7, 8]
