"""Step boundaries on the phase vocabulary (NOTE [ Step boundaries ] in runtime/stagehand/weights/steps.py):
the rule alone, then through the runtime on a tiny model."""

import torch

from stagehand.common import ListSink, Telemetry
from stagehand.common.phases import Phase
from stagehand.weights import WeightRuntime
from stagehand.weights.steps import StepBoundaries

from ._train import Wide, config

N_BLOCKS = 3


def _rule(inference=False):
    """``StepBoundaries`` whose runtime callbacks only log (and enter/leave the step)."""
    log = []

    def begin(step):
        log.append(("begin", step))
        steps.enter_step(step, explicit=False)

    def end():
        log.append("end")
        steps.leave_step()

    steps = StepBoundaries(inference=inference, begin=begin, end=end)
    return steps, log


def test_rule_without_begin_step_training():
    steps, log = _rule()
    steps.forward(0)
    steps.forward(1)
    steps.forward(0)  # gradients on, no backward yet: the same step
    assert (log, steps.phases.phase, steps.step) == ([("begin", 0)], Phase.FORWARD, 0)
    steps.backward()
    steps.backward()
    assert steps.phases.phase is Phase.BACKWARD
    steps.forward(0)  # a forward after backward began: the next step
    assert log == [("begin", 0), "end", ("begin", 1)]
    assert (steps.phases.phase, steps.step, steps.first_block) == (Phase.FORWARD, 1, 0)


def test_rule_without_begin_step_forward_only():
    steps, log = _rule(inference=True)
    for index in (0, 1, 2, 0, 1, 2):
        steps.forward(index)
    assert log == [("begin", 0), "end", ("begin", 1)]
    steps, log = _rule()
    with torch.no_grad():
        for index in (3, 4, 3):  # the first block again, forward only
            steps.forward(index)
    assert log == [("begin", 0), "end", ("begin", 1)]


def test_rule_in_a_step_begun_by_begin_step():
    steps, log = _rule(inference=True)
    steps.enter_step(5, explicit=True)
    steps.forward(0)
    steps.forward(0)
    steps.backward()
    steps.forward(0)  # gradient accumulation: same step, the phase stays BACKWARD
    assert (log, steps.phases.phase, steps.step) == ([], Phase.BACKWARD, 5)
    steps.leave_step()
    steps.forward(0)  # no step open: the next one begins
    assert (log, steps.step, steps.explicit) == ([("begin", 6)], 6, False)


def test_rule_backward_before_forward_and_outside_a_step():
    steps, _ = _rule()
    steps.enter_step(0, explicit=True)
    steps.backward()  # of a forward run before begin_step: this step's
    assert steps.phases.phase is Phase.BACKWARD
    steps.leave_step()
    steps.backward()  # no step open: no phase entered
    assert (steps.open, steps.phases.phase) == (False, Phase.STEP_END)


def _runtime():
    torch.manual_seed(0)
    model = Wide(width=16, depth=N_BLOCKS)
    sink = ListSink()
    runtime = WeightRuntime(model, config(), device="cpu", telemetry=Telemetry(sink))
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
