"""Adapters: hints become knob writes; every original knob comes back on detach."""

from types import SimpleNamespace

import pytest
import torch

from runtime.common.memory import DeviceMemory
from runtime.common.phases import Phase
from runtime.conductor.adapters import ActStagehandConductorAdapter, StagehandConductorAdapter
from runtime.conductor.policy import RuntimeLimitHints
from runtime.conductor.runtime import ConductorRuntime
from runtime.config import ActivationStagehandConfig, ConductorConfig, StagehandConfig


def weight_runtime(window=3, inflight=2):
    return SimpleNamespace(
        scheduler=SimpleNamespace(prefetch_window=window),
        transfer=SimpleNamespace(max_inflight=inflight),
        snapshot=lambda: {"blocks_loaded": 7},
        conductor=None,
    )


def activation_runtime(d2h=2, h2d=2):
    return SimpleNamespace(transfer=SimpleNamespace(max_d2h=d2h, max_h2d=h2d), conductor=None)


def test_weight_adapter_translates_hints():
    rt = weight_runtime(window=3, inflight=2)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(conductor := object())
    assert rt.conductor is conductor
    adapter.on_phase(Phase.FORWARD, RuntimeLimitHints(4, 2, 2, False))
    assert (rt.scheduler.prefetch_window, rt.transfer.max_inflight) == (
        2,
        2,
    )  # never above originals
    adapter.on_phase(Phase.BACKWARD, RuntimeLimitHints(1, 2, 2, True))
    assert (rt.scheduler.prefetch_window, rt.transfer.max_inflight) == (1, 1)
    assert adapter.snapshot() == {"blocks_loaded": 7, "prefetch_window": 1, "max_inflight": 1}
    adapter.detach()
    assert (rt.scheduler.prefetch_window, rt.transfer.max_inflight, rt.conductor) == (3, 2, None)


def test_weight_adapter_keeps_a_disabled_prefetch_disabled():
    rt = weight_runtime(window=0)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 0, 1, True))
    assert rt.scheduler.prefetch_window == 0


def test_activation_adapter_turns_d2h_off_in_optimizer_only():
    rt = activation_runtime(d2h=2, h2d=3)
    adapter = ActStagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.BACKWARD, RuntimeLimitHints(2, 1, 1, True))
    assert (rt.transfer.max_d2h, rt.transfer.max_h2d) == (1, 2)
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 1, 1, True))
    assert (rt.transfer.max_d2h, rt.transfer.max_h2d) == (0, 1)
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(0, 0, 1, True))
    assert rt.transfer.max_h2d == 1  # restores are never switched off
    adapter.detach()
    assert (rt.transfer.max_d2h, rt.transfer.max_h2d, rt.conductor) == (2, 3, None)


def test_full_step_through_the_conductor_then_detach_restores_every_knob():
    weights, acts = weight_runtime(window=3, inflight=2), activation_runtime(d2h=1, h2d=1)
    before = (
        vars(weights.scheduler).copy(),
        vars(weights.transfer).copy(),
        vars(acts.transfer).copy(),
    )
    conductor = ConductorRuntime(ConductorConfig(enabled=True, h2d_slots=2, d2h_slots=2))
    conductor.register_adapter(StagehandConductorAdapter(weights))
    conductor.register_adapter(ActStagehandConductorAdapter(acts))
    assert weights.conductor is conductor and acts.conductor is conductor
    conductor.begin_step(0)
    conductor.enter_forward()
    conductor.enter_backward()
    conductor.enter_optimizer()
    assert (weights.scheduler.prefetch_window, weights.transfer.max_inflight) == (1, 1)
    assert acts.transfer.max_d2h == 0
    conductor.shutdown()  # detaches mid-way through a tightened step
    after = (vars(weights.scheduler), vars(weights.transfer), vars(acts.transfer))
    assert after == before
    assert weights.conductor is None and acts.conductor is None


def test_live_change_of_an_original_survives_detach():
    rt = weight_runtime(window=3)
    adapter = StagehandConductorAdapter(rt)
    adapter.attach(object())
    adapter.on_phase(Phase.OPTIMIZER, RuntimeLimitHints(1, 0, 1, True))
    adapter.set_original("prefetch_window", 5)
    assert rt.scheduler.prefetch_window == 1  # still under the current hints
    adapter.on_phase(Phase.STEP_BEGIN, RuntimeLimitHints(2, 2, 5, False))
    assert rt.scheduler.prefetch_window == 5
    adapter.detach()
    assert rt.scheduler.prefetch_window == 5
    with pytest.raises(KeyError, match="no knob 'window'"):
        adapter.set_original("window", 1)


def test_attach_names_a_missing_knob():
    rt = SimpleNamespace(scheduler=SimpleNamespace(prefetch_window=1))
    with pytest.raises(AttributeError, match=r"runtime\.transfer\.max_inflight"):
        StagehandConductorAdapter(rt).attach(object())


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_adapters_on_the_real_runtimes_restore_every_knob():
    from runtime.activations import ActivationRuntime
    from runtime.weights import StagehandRuntime

    model = _Blocks()
    memory = DeviceMemory("cpu")
    weights = StagehandRuntime(
        model,
        StagehandConfig(pinned_pool_mb=1, pinned_slab_mb=1, prefetch_window_blocks=3),
        device="cpu",
        memory=memory,
    )
    acts = ActivationRuntime(
        ActivationStagehandConfig(
            pinned_pool_classes_mb=(1,), slabs_per_class=2, max_inflight_d2h=2
        ),
        device="cpu",
        memory=memory,
        model=model,
    )
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
    conductor.shutdown()
    assert {**weights.snapshot(), **acts.snapshot()} == before
    assert weights.conductor is None and acts.conductor is None
    acts.close()
    weights.close()
