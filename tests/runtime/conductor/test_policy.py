"""HeuristicPolicyBridge: the three rules on synthetic pressure, and monotone hints."""

from hypothesis import given, settings
from hypothesis import strategies as st

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase
from stagehand.conductor.policy import HeuristicPolicyBridge, RuntimeLimitHints
from stagehand.conductor.runtime import ConductorRuntime
from stagehand.conductor.types import DenialReason
from stagehand.config.memory import MB, ConductorConfig
from stagehand.strategy.adapters import StagehandConductorAdapter
from tests.runtime.conductor.runtimes import weight_runtime

CONFIG = ConductorConfig(
    enabled=True, vram_soft_cap_mb=1000, vram_hard_cap_mb=1200, h2d_slots=2, d2h_slots=2
)


def _policy(window=3) -> HeuristicPolicyBridge:
    policy = HeuristicPolicyBridge(CONFIG)
    policy.reset(window)
    return policy


def test_base_hints_are_the_slots_and_the_window():
    assert _policy().hints == RuntimeLimitHints(2, 2, 3, False)


def test_rule1_backward_pressure_fires_above_80_percent_only_in_backward():
    policy = _policy()
    assert policy.on_phase(Phase.FORWARD, 950) == RuntimeLimitHints(2, 2, 3, False)
    assert policy.on_phase(Phase.BACKWARD, 800) == RuntimeLimitHints(2, 2, 3, False)  # not > 80%
    policy = _policy()
    policy.on_phase(Phase.FORWARD, 0)
    assert policy.on_phase(Phase.BACKWARD, 801) == RuntimeLimitHints(2, 2, 1, True)
    assert policy.fired == ["backward_pressure"]


def test_rule2_optimizer_protection():
    policy = _policy()
    hints = policy.on_phase(Phase.OPTIMIZER, 0)
    assert hints == RuntimeLimitHints(
        max_inflight_h2d=1, max_inflight_d2h=0, prefetch_window_cap=1, suppress_speculative=True
    )
    assert policy.fired == ["optimizer_protection"]


def test_rule3_contention_backs_off_after_more_than_three_full_checks():
    policy = _policy(window=3)
    assert not policy.on_contention(3)  # 3 is not > 3
    assert policy.on_contention(4)
    assert policy.hints.prefetch_window_cap == 2
    assert policy.on_contention(4)
    assert policy.hints.prefetch_window_cap == 1
    assert not policy.on_contention(9)  # never below 1
    assert policy.fired == ["contention"]


def test_rule3_through_the_runtime_is_progressive():
    """Each run of > 3 full checks shrinks the window by one more block."""
    conductor = ConductorRuntime(CONFIG)
    conductor.begin_step(0)
    conductor.enter_forward()
    held = [conductor.request_transfer("h2d", "required") for _ in range(2)]
    windows = []
    for _ in range(8):
        denied = conductor.request_transfer("h2d", "required")
        assert denied.reason is DenialReason.H2D_SLOTS_EXHAUSTED
        windows.append(conductor.hints.prefetch_window_cap)
    # base window 2 (no weight adapter): 4th full check -> 1, then floor at 1
    assert windows == [2, 2, 2, 1, 1, 1, 1, 1]
    for grant in held:
        grant.release()


def test_reset_at_step_begin():
    policy = _policy()
    policy.on_phase(Phase.OPTIMIZER, 2000)
    assert policy.on_phase(Phase.STEP_BEGIN, 0) == RuntimeLimitHints(2, 2, 3, False)
    assert policy.fired == []


PHASES = [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]

step_plan = st.tuples(
    st.integers(0, 3),  # phases reached: 0 = straight to STEP_END, 3 = full training step
    st.lists(  # per phase: VRAM usage (MB) on entry and full checks during it
        st.tuples(st.floats(0, 1500), st.integers(0, 6)), min_size=3, max_size=3
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(step_plan, min_size=1, max_size=5), st.integers(0, 4))
def test_hints_are_monotone_within_a_step_and_reset_at_the_next(steps, window):
    memory = DeviceMemory("cpu")
    conductor = ConductorRuntime(CONFIG, memory=memory)
    weights = weight_runtime(window=window, inflight=2)
    conductor.register_adapter(StagehandConductorAdapter(weights))
    base = RuntimeLimitHints(2, 2, window, False)
    for step, (reached, per_phase) in enumerate(steps):
        conductor.begin_step(step)
        assert conductor.hints == base
        assert weights.scheduler.window == window
        seen = [conductor.hints]
        knob = [window]
        for phase, (usage_mb, full_checks) in zip(PHASES[:reached], per_phase, strict=False):
            memory.untrack(memory.tracked_bytes())
            memory.track(int(usage_mb * MB))
            getattr(conductor, f"enter_{phase.value}")()
            seen.append(conductor.hints)
            knob.append(weights.scheduler.window)
            held = [conductor.request_transfer("h2d", "critical") for _ in range(2)]
            for _ in range(full_checks):
                conductor.request_transfer("h2d", "critical")
                seen.append(conductor.hints)
                knob.append(weights.scheduler.window)
            for grant in held:
                grant.release()
            if phase is Phase.BACKWARD and usage_mb > 800:
                assert conductor.hints.suppress_speculative
            if phase is Phase.OPTIMIZER:
                assert conductor.hints.max_inflight_d2h == 0
        conductor.end_step()
        seen.append(conductor.hints)
        for earlier, later in zip(seen, seen[1:], strict=False):
            assert later.at_most(earlier), (earlier, later)
            assert later.prefetch_window_cap >= min(1, earlier.prefetch_window_cap)
        assert knob == sorted(knob, reverse=True)  # the knob follows the hints
    conductor.shutdown()
    assert weights.scheduler.window == window and weights.scheduler.window_cap is None
    weights.close()
