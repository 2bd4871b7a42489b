"""ConductorRuntime: zero-cost disable, phase order, telemetry records and debug events."""

import pytest

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import PhaseError
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.conductor.runtime import ConductorRuntime
from stagehand.conductor.telemetry import STEP_FIELDS
from stagehand.conductor.types import DenialReason
from stagehand.config.memory import MB, ConductorConfig
from stagehand.strategy.adapters import StagehandConductorAdapter
from tests.runtime.conductor.runtimes import weight_runtime


def test_disabled_conductor_allocates_nothing_and_returns_at_once():
    rt = ConductorRuntime(ConductorConfig(enabled=False))
    for name in ("budget", "transfer", "coordinator", "policy", "hub", "adapters", "config"):
        assert not hasattr(rt, name), name
    assert vars(rt) == {"_enabled": False}
    rt.begin_step(0)
    rt.enter_forward()
    rt.enter_forward()  # no phase checks when disabled
    assert rt.end_step() is None
    grant = rt.request_transfer("d2h", "speculative")
    assert grant.granted and grant.direction == "d2h"
    assert rt.request_transfer("h2d", "background") is rt.request_transfer("h2d", "background")
    assert rt.reserve("vram", 10**6, mode="hard").granted_mb == 10**6
    assert rt.hints is None and rt.phase is None
    weights = weight_runtime(window=2)
    rt.register_adapter(StagehandConductorAdapter(weights))
    assert weights.conductor is None and weights.scheduler.window_cap is None
    weights.close()
    rt.shutdown()
    assert vars(rt) == {"_enabled": False}


def test_illegal_phase_order_raises_with_expected_and_found():
    rt = ConductorRuntime(ConductorConfig(enabled=True))
    with pytest.raises(PhaseError, match="after no phase expected STEP_BEGIN, got FORWARD"):
        rt.enter_forward()
    rt.begin_step(0)
    with pytest.raises(
        PhaseError, match="after STEP_BEGIN expected FORWARD or STEP_END, got BACKWARD"
    ):
        rt.enter_backward()
    rt.enter_forward()  # the failed call changed nothing
    with pytest.raises(PhaseError, match="after FORWARD .* got OPTIMIZER"):
        rt.enter_optimizer()


def test_phase_scoped_reservations_released_at_the_phase_boundary():
    rt = ConductorRuntime(ConductorConfig(enabled=True, vram_soft_cap_mb=100, vram_hard_cap_mb=100))
    rt.begin_step(0)
    rt.enter_forward()
    scoped = rt.reserve("vram", 60, mode="hard", phase_scoped=True)
    assert rt.reserve("vram", 60, mode="hard").reason is DenialReason.VRAM_BUDGET_EXHAUSTED
    rt.enter_backward()
    assert scoped.released and rt.budget.held_mb("vram") == 0
    assert rt.reserve("vram", 60, mode="hard").granted


def test_step_record_has_the_seed_fields_at_the_configured_interval():
    sink = ListSink()
    memory = DeviceMemory("cpu")
    config = ConductorConfig(
        enabled=True,
        vram_soft_cap_mb=1000,
        vram_hard_cap_mb=1100,
        d2h_slots=4,
        telemetry_interval_steps=2,
    )
    rt = ConductorRuntime(config, memory=memory, telemetry=Telemetry(sink))
    weights = weight_runtime(window=2, inflight=2)
    rt.register_adapter(StagehandConductorAdapter(weights))
    rt.reserve("pinned", 512, mode="hard", owner="stagehand")
    for step in range(3):
        memory.track(300 * MB)
        rt.begin_step(step)
        rt.enter_forward()
        with rt.request_transfer("h2d", "speculative"):
            rt.request_transfer("d2h", "required")  # left held: shows in d2h_inflight
        rt.reserve("vram", 1000, mode="soft", phase_scoped=True)  # partial
        rt.enter_backward()
        rt.enter_optimizer()
        rt.request_transfer("h2d", "speculative")  # suppressed by Rule 2
        rt.end_step()
    records = sink.of("conductor", "step")
    assert [r["step_id"] for r in records] == [0, 2]
    last = records[-1]
    assert list(last)[6 : 6 + len(STEP_FIELDS)] == list(STEP_FIELDS)
    assert last["vram_allocated_mb"] == 900
    assert last["vram_headroom_mb"] == 100
    assert last["pinned_granted_mb"] == 512
    assert (last["h2d_inflight"], last["d2h_inflight"]) == (0, 3)
    # this step: 2 slots granted, 1 suppressed; 1 partial reservation (pinned was step 0)
    assert (last["grant_count"], last["deny_count"], last["partial_count"]) == (2, 1, 1)
    assert set(last["phase_durations"]) == {"forward", "backward", "optimizer"}
    assert all(v >= 0 for v in last["phase_durations"].values())
    assert last["runtime_snapshots"] == {"stagehand": {"prefetch_window": 1, "max_inflight": 1}}
    assert last["rules_fired"] == ["backward_pressure", "optimizer_protection"]
    assert sink.of("conductor", "event") == []  # debug trace off
    rt.shutdown()
    weights.close()


def test_debug_event_trace():
    sink = ListSink()
    config = ConductorConfig(enabled=True, debug_event_trace=True)
    rt = ConductorRuntime(config, telemetry=Telemetry(sink))
    rt.begin_step(0)
    rt.enter_forward()
    with rt.request_transfer("h2d", "required"):
        pass
    rt.reserve("pinned", 10, mode="hard").release()
    rt.end_step()
    events = [r["event"] for r in sink.of("conductor", "event")]
    assert events == [
        "hints",
        "phase",
        "hints",
        "phase",
        "slot_acquire",
        "slot_release",
        "reserve",
        "release",
        "hints",
        "phase",
    ]
    phases = [r["phase"] for r in sink.of("conductor", "event") if r["event"] == "phase"]
    assert phases == ["step_begin", "forward", "step_end"]


def test_shutdown_stops_the_conductor():
    rt = ConductorRuntime(ConductorConfig(enabled=True))
    rt.reserve("pinned", 10, mode="hard")
    rt.shutdown()
    assert rt.budget.held_mb("pinned") == 0
    with pytest.raises(RuntimeError, match="shut down"):
        rt.begin_step(0)
