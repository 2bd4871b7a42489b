"""Adapters: hints become caps the runtimes apply to their own settings; the user's settings
are never written, so a live change survives a cap, and detach clears every cap. Tested on the
real runtimes (``runtimes.py``)."""

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase
from stagehand.conductor.policy import RuntimeLimitHints
from stagehand.conductor.runtime import ConductorRuntime
from stagehand.config.memory import ConductorConfig
from stagehand.strategy.adapters import ActStagehandConductorAdapter, StagehandConductorAdapter
from stagehand.weights.scheduler import BlockScheduler
from tests.runtime.conductor.runtimes import activation_runtime, weight_runtime


def test_weight_adapter_caps_the_window_and_copies_in_flight():
    rt = weight_runtime(window=3, inflight=2)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(conductor := object())
    assert rt.conductor is conductor
    adapter.on_phase(Phase.FORWARD, RuntimeLimitHints(4, 2, 2, False))
    assert rt.snapshot() == {"prefetch_window": 2, "max_inflight": 2}  # never above the user's
    adapter.on_phase(Phase.BACKWARD, RuntimeLimitHints(1, 2, 2, True))
    assert rt.snapshot() == {"prefetch_window": 1, "max_inflight": 1}
    assert (rt.scheduler.prefetch_window, rt.transfer.max_inflight) == (3, 2)  # not written
    assert adapter.snapshot() == rt.snapshot()
    adapter.detach()
    assert rt.snapshot() == {"prefetch_window": 3, "max_inflight": 2} and rt.conductor is None
    assert (rt.scheduler.window_cap, rt.transfer.inflight_cap) == (None, None)
    rt.close()


def test_a_capped_window_prefetches_fewer_blocks():
    scheduler = BlockScheduler(3)
    scheduler.order = [0, 1, 2, 3]
    assert scheduler.upcoming() == [0, 1, 2]
    scheduler.window_cap = 1
    assert scheduler.upcoming() == [0]
    scheduler.prefetch_window = 0  # the user's setting below the cap wins
    assert scheduler.upcoming() == []


def test_weight_adapter_keeps_a_disabled_prefetch_disabled():
    rt = weight_runtime(window=0)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 0, 1, True))
    assert rt.snapshot()["prefetch_window"] == 0
    rt.close()


def test_activation_adapter_turns_d2h_off_in_optimizer_only():
    rt = activation_runtime(d2h=2, h2d=3)
    adapter = ActStagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.BACKWARD, RuntimeLimitHints(2, 1, 1, True))
    assert rt.snapshot() == {"max_d2h": 1, "max_h2d": 2}
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 1, 1, True))
    assert rt.snapshot() == {"max_d2h": 0, "max_h2d": 1}
    assert not rt.transfer.can_spill()
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(0, 0, 1, True))
    assert rt.snapshot()["max_h2d"] == 1  # restores are never switched off
    adapter.detach()
    assert rt.snapshot() == {"max_d2h": 2, "max_h2d": 3} and rt.conductor is None
    rt.close()


def test_a_live_change_under_a_cap_takes_effect_when_the_cap_goes():
    rt = weight_runtime(window=3)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 0, 1, True))
    rt.scheduler.prefetch_window = 5  # live limits, while the Conductor caps the window
    assert rt.snapshot()["prefetch_window"] == 1
    adapter.on_phase(Phase.STEP_BEGIN, RuntimeLimitHints(2, 2, 5, False))
    assert rt.snapshot()["prefetch_window"] == 5
    adapter.detach()
    assert rt.snapshot()["prefetch_window"] == 5
    rt.close()


def test_a_full_step_through_the_conductor_then_shutdown_clears_every_cap():
    memory = DeviceMemory("cpu")
    weights = weight_runtime(window=3, inflight=2, memory=memory)
    acts = activation_runtime(d2h=2, h2d=1, memory=memory)
    before = {**weights.snapshot(), **acts.snapshot()}
    assert before == {"prefetch_window": 3, "max_inflight": 2, "max_d2h": 2, "max_h2d": 1}
    conductor = ConductorRuntime(ConductorConfig(enabled=True), memory=memory)
    conductor.register_adapter(StagehandConductorAdapter(weights))
    conductor.register_adapter(ActStagehandConductorAdapter(acts))
    assert weights.conductor is conductor and acts.conductor is conductor
    conductor.begin_step(0)
    conductor.enter_forward()
    conductor.enter_backward()
    conductor.enter_optimizer()
    tightened = {**weights.snapshot(), **acts.snapshot()}
    assert tightened == {"prefetch_window": 1, "max_inflight": 1, "max_d2h": 0, "max_h2d": 1}
    record = conductor.end_step()
    assert record["runtime_snapshots"] == {
        "stagehand": {"prefetch_window": 1, "max_inflight": 1},
        "activation_stagehand": {"max_d2h": 0, "max_h2d": 1},
    }
    conductor.shutdown()  # detaches mid-way through a tightened step
    assert {**weights.snapshot(), **acts.snapshot()} == before
    assert weights.conductor is None and acts.conductor is None
    acts.close()
    weights.close()


def test_slots_of_finished_copies_are_reclaimed_before_a_full_pool_denies():
    from stagehand.common.telemetry import Telemetry
    from stagehand.config.memory import StagehandConfig
    from stagehand.weights import WeightRuntime
    from tests.runtime.conductor.runtimes import Blocks
    from tests.runtime.device_double import device_double

    config = StagehandConfig(pinned_pool_mb=4, pinned_slab_mb=1, max_inflight_transfers=2)
    with device_double(100) as clock:  # copies run only when the test lets the device go
        rt = WeightRuntime(Blocks(), config, device="cpu", telemetry=Telemetry())
        rt.scheduler.order = [0, 1, 2, 3]
        conductor = ConductorRuntime(ConductorConfig(enabled=True, h2d_slots=2))
        conductor.register_adapter(StagehandConductorAdapter(rt))
        conductor.begin_step(0)
        conductor.enter_forward()
        for block in rt.blocks[:2]:
            assert rt._load_ahead(block)  # each holds a slot until its copy is retired
        assert conductor.transfer.inflight("h2d") == 2
        in_flight = conductor.request_transfer("h2d", "speculative")
        assert in_flight.reason.value == "h2d_slots_exhausted"  # both copies still running
        clock.drain()  # both copies finished; the runtime has not retired them
        grant = conductor.request_transfer("h2d", "speculative")
        assert grant.granted and conductor.transfer.inflight("h2d") == 1
        grant.release()
        conductor.shutdown()
        rt.close()
