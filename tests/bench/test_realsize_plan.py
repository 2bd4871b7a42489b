"""The plan and the real-size rows choose the same residency: one resolution of ``"auto"``
(the planner's activation estimate included). That a tiny row on the CPU moves what the
planner's simulation of its section predicts is ``tests/bench/test_realsize.py``'s (it reads the
session's one tiny bench run, which ``--dist loadfile`` keeps in one worker with that file)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stagehand.config.memory import MB
from stagehand.strategy.auto import resolve_auto
from workbench.bench.realmodel import (
    REAL_MODELS,
    model_inventory,
    preset_memory,
)
from workbench.bench.realsize import row_memory
from workbench.plan.plan import EFFICIENCY, auto_figures, check_memory, simulate
from workbench.plan.profiles import profile
from workbench.plan.sections import block_sizes, plan_trainable_bytes, weight_section

CARD = 24 * 2**30  # --card-gb 24 and --vram-gb 24: both GiB


def test_the_plan_and_a_card_row_resolve_auto_to_the_same_watermarks():
    """FLUX.1-dev's real config on a 24 GiB card: ``workbench plan --device h100 --vram-gb 24
    --h2d-gbps 55`` and the bench's ``--card-gb 24`` rows resolve ``"auto"`` alike. Before,
    the bench passed an activation peak of 0 and kept ~2 GB more blocks than the plan."""
    spec = REAL_MODELS["flux-dev"]
    memory = check_memory(preset_memory(spec.preset))
    inv = model_inventory("flux-dev", "real")
    h100 = replace(profile("h100"), vram_bytes=CARD, h2d_gbps=55.0)
    planned = weight_section(inv, memory, h100)  # what the plan simulates
    for name in ("stream_file", "preset"):
        row = row_memory(name, "flux-dev", "real", card_bytes=CARD)["stagehand"]
        assert row["vram_high_watermark_mb"] == pytest.approx(planned.vram_high_watermark_mb)
        assert row["vram_low_watermark_mb"] == pytest.approx(planned.vram_low_watermark_mb)
    preset = row_memory("preset", "flux-dev", "real", card_bytes=CARD)["stagehand"]
    act, cond = planned.activation_stagehand, planned.conductor_config
    assert preset["activation_stagehand"]["vram_high_watermark_mb"] == pytest.approx(
        act.vram_high_watermark_mb
    )
    assert preset["conductor_config"]["vram_soft_cap_mb"] == pytest.approx(cond.vram_soft_cap_mb)
    # The plan's own report of the figures, and the activation estimate really is in them:
    # the rule without it keeps exactly the estimate's bytes more.
    figures = auto_figures(inv, memory, h100)
    assert figures["high_mb"] == round(planned.vram_high_watermark_mb, 1)
    assert figures["activation_peak_bytes"] > 10**9  # 1024 px, checkpointed: ~2.1 GB
    zero = resolve_auto(
        memory.stagehand,
        block_sizes=block_sizes(inv),
        trainable=plan_trainable_bytes(inv),
        activation_peak=0,
        card_bytes=CARD,
    )
    gap = zero.vram_high_watermark_mb - planned.vram_high_watermark_mb
    assert gap == pytest.approx(figures["activation_peak_bytes"] / MB)


def test_a_row_left_auto_resolves_with_the_plans_activation_peak():
    """A real-size row on the run's own card keeps ``"auto"`` (no ``--card-gb``): its child
    builds the strategy with the planner's activation estimate, as a run does, which the
    driver computes once; a row resolved for an emulated card, or on the CPU, needs none."""
    from workbench.bench.realsize import row_activation_peak
    from workbench.plan.sections import planned_activations

    auto = row_memory("stream_file", "flux-dev", "real")
    assert auto["stagehand"]["vram_high_watermark_mb"] == "auto"
    inv = model_inventory("flux-dev", "real")
    peak = row_activation_peak("flux-dev", "real", auto, "cuda")
    assert peak == planned_activations(inv, True) > 10**9  # ~2.1 GB at 1024 px, checkpointed
    assert row_activation_peak("flux-dev", "real", auto, "cpu") == 0  # no budget to fit
    card = row_memory("stream_file", "flux-dev", "real", card_bytes=CARD)
    assert row_activation_peak("flux-dev", "real", card, "cuda") == 0  # already in MB


def test_the_plans_window_grows_until_no_use_waits_on_a_copy():
    """NOTE [ Window growth ]: FLUX.1-dev's real config on a 24 GiB card at 55 GB/s. With the
    window the preset leaves to the runtime, the plan's steps run with 2 blocks (it waits on
    copies in flight), then 4, then 8, where no use waits and the step is its compute: the
    all-resident step. The same section with a window of 2 given keeps it, and waits."""
    spec = REAL_MODELS["flux-dev"]
    memory = check_memory(preset_memory(spec.preset))
    assert memory.stagehand.prefetch_window_blocks is None
    inv = model_inventory("flux-dev", "real")
    h100 = replace(profile("h100"), vram_bytes=CARD, h2d_gbps=55.0)
    grown = simulate(inv, memory, h100, EFFICIENCY["gpu"])
    assert [s.window for s in grown] == [2, 2, 4, 8, 8]
    assert grown[1].copy_waits > grown[2].copy_waits > 0 == grown[-1].copy_waits
    assert grown[-1].waits == grown[-1].misses == 0
    assert grown[-1].step_ms == pytest.approx(grown[-1].compute_ms)
    given = memory.model_copy(deep=True)
    given.stagehand.prefetch_window_blocks = 2
    kept = simulate(inv, given, h100, EFFICIENCY["gpu"])
    assert [s.window for s in kept] == [2, 2, 2]
    assert kept[-1].copy_waits > 0 and kept[-1].step_ms > grown[-1].step_ms
