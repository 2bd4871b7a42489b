"""NOTE [ Live watermarks ] (``runtime/stagehand/weights/policy.py``): activation (spill) watermarks set
live reach the steady state a run started with them reaches, the weight runtime's included:
both runtimes compare the one device usage with their watermarks, so spilling more or less
moves what the weight watermarks keep. On the tiny Flux under the ``default`` preset's
runtimes, weights at 2.25/1.0 MB: before, spilling from step 2 on streamed 1,705,984 bytes of
block weights a step where a run spilling from the start streamed none (issue 56)."""

from __future__ import annotations

import pytest
import torch

from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.strategy import build_strategy
from tests.runtime import exact
from tests.runtime.live_settle import STEADY, train
from workbench.worker.assets import example_inputs, output_tensor

WEIGHTS = {"vram_high_watermark_mb": 2.25, "vram_low_watermark_mb": 1.0}
SPILL = {"activation_vram_high_watermark_mb": 0.05, "activation_vram_low_watermark_mb": 0.0}
KEEP = {"activation_vram_high_watermark_mb": 26.0, "activation_vram_low_watermark_mb": 20.0}


@pytest.mark.parametrize(
    ("limits", "before"), [(SPILL, KEEP), (KEEP, SPILL)], ids=["spill", "keep"]
)
def test_activation_watermarks_set_live_settle_where_a_start_with_them_does(
    tiny_flux, limits, before
):
    started, _ = train(tiny_flux, {**WEIGHTS, **limits})
    changed, _ = train(tiny_flux, {**WEIGHTS, **before}, live=limits)
    assert changed[STEADY] == started[STEADY]
    assert len(set(started[STEADY])) == 1
    spills = started[STEADY][0].tensors_spilled
    assert (spills > 0) == (limits is SPILL)  # not vacuous: the change moves the spill


def test_under_layer_offload_a_spill_watermark_change_keeps_the_layer_order(tiny_flux):
    """Layer offload keeps layers by its fraction, in a fixed order: nothing to re-derive."""
    model = exact.make_model("flux", tiny_flux, "lora", ordinary=True)
    memory = {"strategy": "layer_offload", "layer_offload_fraction": 0.5}
    memory["enable_activation_offloading"] = True
    sink = ListSink()
    strategy = build_strategy(model, memory, device="cpu", telemetry=Telemetry(sink))
    order = list(strategy.weights.scheduler.order)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        if step == 1:
            strategy.set_limits(SPILL)
        with strategy.step(step):
            with strategy.forward():
                loss = output_tensor(model(**example_inputs(model, seed=step))).pow(2).mean()
            with strategy.backward():
                loss.backward()
            with strategy.optimizer(optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    strategy.close()
    assert strategy.weights.scheduler.order == order
    assert not [r for r in sink.of("stagehand", "block") if r.get("reason") == "limits"]
    assert sink.of("strategy", "limits_applied")[-1]["changed"]  # not vacuous: it applied
