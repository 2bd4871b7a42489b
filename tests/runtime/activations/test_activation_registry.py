"""Registry states, watermark hysteresis, in-flight caps and config errors."""

import json

import pydantic
import pytest
import torch

from stagehand.activations import (
    ActivationBudgetManager,
    ActivationRegistry,
    ActivationRuntime,
    ActivationState,
    ActivationStateError,
    ActivationTransferEngine,
)
from stagehand.common.memory import DeviceMemory
from stagehand.config.memory import MB, ActivationStagehandConfig, StagehandSection

S = ActivationState
SMALL_POOL = {"pinned_pool_classes_mb": (0.0625,), "slabs_per_class": 4}


def test_legal_path_and_illegal_transitions_name_both_states():
    registry = ActivationRegistry()
    record = registry.create(0, S.SPILLING, torch.zeros(4))
    for state in (S.SPILLED, S.RESTORING, S.RESTORED, S.RELEASED):
        registry.transition(record, state)
    assert record.state is S.RELEASED
    with pytest.raises(ActivationStateError, match=r"illegal transition RELEASED -> RESTORING"):
        registry.transition(record, S.RESTORING)
    other = registry.create(1, S.SPILLING, torch.zeros(4))
    registry.transition(other, S.SPILLED)
    with pytest.raises(ActivationStateError, match=r"SPILLED -> RESTORED .*RELEASED or RESTORING"):
        registry.transition(other, S.RESTORED)
    kept = registry.create(2, S.KEPT, torch.zeros(4))
    with pytest.raises(ActivationStateError, match="KEPT -> SPILLING"):
        registry.transition(kept, S.SPILLING)
    with pytest.raises(ActivationStateError, match="starts KEPT or SPILLING, got RESTORED"):
        registry.create(3, S.RESTORED, torch.zeros(4))
    with pytest.raises(ActivationStateError, match="forget expects RELEASED, found SPILLED"):
        registry.forget(other)
    registry.forget(record)
    assert registry.counts() == {
        "KEPT": 1,
        "SPILLING": 0,
        "SPILLED": 1,
        "RESTORING": 0,
        "RESTORED": 0,
        "RELEASED": 0,
    }
    with pytest.raises(KeyError, match="no activation record 0"):
        registry.get(record.id)


def test_watermark_hysteresis_on_tracked_memory():
    memory = DeviceMemory("cpu")
    budget = ActivationBudgetManager(memory, high_mb=2, low_mb=1)
    budget.reset()
    steps = [(0.5, False), (2.0, True), (1.5, True), (0.9, False), (1.5, False), (2.5, True)]
    for mb, want in steps:
        delta = int(mb * MB) - memory.tracked_bytes()
        (memory.track if delta >= 0 else memory.untrack)(abs(delta))
        assert budget.pressure() is want, f"at {mb} MB"
    # Bytes not yet reported to DeviceMemory count too.
    memory.untrack(memory.tracked_bytes())
    assert budget.pressure(pending=int(2 * MB)) is True


@pytest.mark.parametrize(
    ("high", "low", "match"),
    [
        (10, 20, r"vram_low_watermark_mb \(20\) must not be above vram_high_watermark_mb"),
        (-1, 0, "vram_high_watermark_mb must be a number of MB >= 0"),
        (10, -5, "vram_low_watermark_mb must be a number of MB >= 0"),
        ("10", 5, "vram_high_watermark_mb must be a number"),
    ],
)
def test_set_watermarks_rejects_bad_values(high, low, match):
    runtime = ActivationRuntime(ActivationStagehandConfig(**SMALL_POOL), device="cpu")
    with pytest.raises(ValueError, match=match):
        runtime.set_watermarks(high, low)
    runtime.set_watermarks(30, 30)
    assert (runtime.budget.high_mb, runtime.budget.low_mb) == (30.0, 30.0)


def test_negative_caps_raise_and_live_knobs_are_validated():
    with pytest.raises(ValueError, match="max_inflight_d2h must be an int >= 0, got -1"):
        ActivationTransferEngine("cpu", max_d2h=-1)
    with pytest.raises(ValueError, match="max_inflight_h2d must be an int >= 1, got 0"):
        ActivationTransferEngine("cpu", max_h2d=0)
    runtime = ActivationRuntime(ActivationStagehandConfig(**SMALL_POOL), device="cpu")
    runtime.transfer.max_d2h = 0
    runtime.transfer.max_h2d = 3
    assert runtime.snapshot() == {"max_d2h": 0, "max_h2d": 3}
    with pytest.raises(ValueError, match="max_inflight_d2h"):
        runtime.transfer.max_d2h = -2
    with pytest.raises(pydantic.ValidationError, match="max_inflight_d2h"):
        ActivationStagehandConfig(max_inflight_d2h=-1)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"vram_high_watermark_mb": 100, "vram_low_watermark_mb": 200}, "must not be above"),
        ({"pinned_pool_classes_mb": [4, 1]}, "strictly ascending"),
        ({"pinned_pool_classes_mb": [1, 4], "slabs_per_class": [1, 2, 3]}, "has 3 counts"),
        ({"pinned_pool_classes_mb": [0, 4]}, "greater than 0"),
        ({"slabs_per_class": -1}, "slabs_per_class"),
        ({"vram_high_watermark_mb": -5}, "vram_high_watermark_mb"),
        ({"spill_everything": True}, "spill_everything"),
    ],
)
def test_config_rejects_bad_fields(fields, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ActivationStagehandConfig(**fields)


def test_config_accepts_the_seed_json_block_verbatim():
    block = json.loads(
        """{"enabled": true, "vram_high_watermark_mb": 16000, "vram_low_watermark_mb": 12000,
        "pinned_pool_classes_mb": [1, 4, 16, 64, 256], "slabs_per_class": [512, 2, 2, 2, 2],
        "max_inflight_d2h": 1, "max_inflight_h2d": 1, "debug_checksums": false,
        "telemetry_enabled": true, "telemetry_file": "activation_telemetry.jsonl"}"""
    )
    section = StagehandSection.model_validate({"activation_stagehand": block})
    config = section.activation_stagehand
    assert config.slab_counts() == (512, 2, 2, 2, 2)
    assert (config.vram_high_watermark_mb, config.vram_low_watermark_mb) == (16000, 12000)
    defaults = ActivationStagehandConfig()
    assert (defaults.vram_high_watermark_mb, defaults.vram_low_watermark_mb) == (20000, 16000)
    assert defaults.recompute_threshold_bytes == 0


def test_step_lifecycle_errors():
    runtime = ActivationRuntime(ActivationStagehandConfig(**SMALL_POOL), device="cpu")
    runtime.begin_step(0)
    with pytest.raises(RuntimeError, match=r"begin_step\(1\) while step 0 is open"):
        runtime.begin_step(1)
    runtime.end_step()
    runtime.close()
    with pytest.raises(RuntimeError, match="closed"):
        runtime.begin_step(2)
    # A closed runtime keeps everything (the packer claims nothing).
    assert runtime.packer(torch.zeros(1024)) is None
