"""A step left by an out-of-memory error is undone (``MemoryStrategy.abort_step``), on the tiny
Flux under the three runtimes with an emulated card; the lowering rule's numbers; the card itself.

NOTE [ Aborted step ] (runtime/stagehand/weights/abort.py), NOTE [ Lowering rule ]
(runtime/stagehand/strategy/recovery.py)."""

import pytest
import torch

from stagehand.common.card import emulate_card
from stagehand.common.memory import DeviceMemory
from stagehand.common.telemetry import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from stagehand.strategy.recovery import MARGIN_FRACTION, lowered_limits, requested_bytes
from stagehand.weights.registry import BlockState
from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor

# The tiny Flux (8 blocks of ~0.43 MB, ~0.4 MB resident): every block kept (40/30 MB), spill
# above 0.1 MB, the Conductor on: all three runtimes hold something mid-step.
MEMORY = {
    "strategy": "stagehand",
    "gradient_checkpointing": True,
    "stagehand": {
        "pinned_pool_mb": 8,
        "pinned_slab_mb": 1,
        "vram_high_watermark_mb": 40,
        "vram_low_watermark_mb": 30,
        "prefetch_window_blocks": 2,
        "activation_stagehand": {
            "vram_high_watermark_mb": 0.1,
            "vram_low_watermark_mb": 0.05,
            "pinned_pool_classes_mb": [1, 4],
            "slabs_per_class": [8, 2],
            "min_spill_bytes": 1024,
        },
        "conductor_config": {
            "enabled": True,
            "vram_soft_cap_mb": 60,
            "vram_hard_cap_mb": 80,
            "pinned_budget_mb": 64,
        },
    },
}


@pytest.fixture
def no_card():
    """Each test leaves the process without an emulated card (it is process-wide)."""
    yield
    emulate_card(torch.device("cpu"), None)


def train_step(model, strategy, optimizer, step, fail_in=None):
    """One step; ``fail_in``: the phase whose begin shrinks the card to what is in use, so the
    next tracked allocation raises there."""
    inputs = example_inputs(model, seed=step)

    def squeeze(phase):
        if phase == fail_in:
            strategy.memory.capacity_bytes = strategy.memory.tracked_bytes() + 1

    with strategy.step(step):
        with strategy.forward():
            squeeze("forward")
            loss = output_tensor(model(**inputs)).pow(2).mean()
        with strategy.backward():
            squeeze("backward")
            loss.backward()
        with strategy.optimizer(optimizer):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_abort_returns_every_runtime_to_the_state_of_a_strategy_just_built(
    tiny_flux, no_card, phase
):
    model = exact.make_model("flux", tiny_flux, "lora", ordinary=True)
    sink = ListSink()
    strategy = build_strategy(model, MEMORY, device="cpu", telemetry=Telemetry(sink))
    memory, weights, acts = strategy.memory, strategy.weights, strategy.activations
    built = memory.tracked_bytes()
    assert built == weights.resident_bytes > 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    train_step(model, strategy, optimizer, 0)
    kept = [b.index for b in weights.blocks if b.on_device]
    assert kept and memory.tracked_bytes() > built  # blocks kept between steps: not vacuous

    with pytest.raises(torch.OutOfMemoryError, match=r"emulated, tracked") as caught:
        train_step(model, strategy, optimizer, 1, fail_in=phase)
    assert caught.value.in_use_bytes + caught.value.requested_bytes > memory.capacity_bytes
    # Mid-step state the error left, before the abort: the step's records are tagged aborted.
    aborted = [r for r in sink.records if r.get("aborted")]
    assert {(r["source"], r["kind"]) for r in aborted} >= {("stagehand", "step")}
    memory.capacity_bytes = None
    strategy.abort_step()

    assert memory.tracked_bytes() == built  # the figure of a strategy just built
    assert memory.tracked_bytes("activations") == 0
    assert len(acts.registry) == 0 and not acts.transfer.d2h_inflight
    assert all(b.state is BlockState.UNLOADED for b in weights.blocks)
    assert not weights.transfer.inflight and weights.scheduler.order is None
    assert strategy.conductor.transfer.inflight("h2d") == 0
    assert strategy.conductor.transfer.inflight("d2h") == 0
    evicts = [r for r in sink.records if r.get("event") == "evict" and r.get("reason")]
    assert {r["reason"] for r in evicts} <= {"aborted"}
    with pytest.raises(Exception, match="inside step"):
        with strategy.step(9):
            strategy.abort_step()

    # The step runs again, and the run goes on as one whose step 1 never failed.
    for p in trainable:
        p.grad = None
    again = train_step(model, strategy, optimizer, 1)
    strategy.close()
    ref_model = exact.make_model("flux", tiny_flux, "lora", ordinary=True)
    ref = build_strategy(ref_model, MEMORY, device="cpu", telemetry=Telemetry(ListSink()))
    ref_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-3)
    train_step(ref_model, ref, ref_opt, 0)
    assert train_step(ref_model, ref, ref_opt, 1) == again
    ref.close()


def test_the_card_raises_before_counting_and_names_the_figures(no_card):
    memory = DeviceMemory("cpu", capacity_bytes=3 * MB)
    memory.track(2 * MB, "weights")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        memory.track(2 * MB, "activations")
    assert memory.tracked_bytes() == 2 * MB and memory.tracked_bytes("activations") == 0
    assert "Tried to allocate 2.00 MiB" in str(caught.value)
    assert "1.00 MiB free of a 0.00293 GiB card (emulated, tracked)" in str(caught.value)
    assert (caught.value.requested_bytes, caught.value.in_use_bytes) == (2 * MB, 2 * MB)
    assert requested_bytes(caught.value) == 2 * MB
    memory.track(1 * MB, "activations")  # exactly the card: fits
    # The process's card (--card-gb) is what a memory built without one gets.
    emulate_card(torch.device("cpu"), 5 * MB)
    assert DeviceMemory("cpu").card_bytes() == 5 * MB
    emulate_card(torch.device("cpu"), None)
    assert DeviceMemory("cpu").card_bytes() is None
    with pytest.raises(ValueError, match="capacity_bytes"):
        DeviceMemory("cpu", capacity_bytes=0)


def test_cuda_message_gives_the_requested_bytes():
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.6 GiB"
    )
    assert requested_bytes(exc) == 20 * 2**20
    assert requested_bytes(torch.OutOfMemoryError("no figure")) == 0


LIMITS = {
    "vram_high_watermark_mb": 40.0,
    "vram_low_watermark_mb": 30.0,
    "prefetch_window_blocks": 2,
    "max_inflight_transfers": 2,
    "activation_vram_high_watermark_mb": 26.0,
    "activation_vram_low_watermark_mb": 20.0,
    "max_inflight_d2h": 1,
    "max_inflight_h2d": 1,
}


def test_the_lowering_rule_fits_the_failure_with_the_margin():
    card = 37 * MB
    # 36.5 MB in use asking for 1.5 more: 38 MB needed, 33.3 MB under the margin: cut 4.7 MB.
    after = lowered_limits(LIMITS, int(36.5 * MB), card, int(1.5 * MB))
    ceiling = 37 * (1 - MARGIN_FRACTION)
    cut = 38 - ceiling
    assert after["vram_high_watermark_mb"] == pytest.approx(ceiling - cut, abs=1e-3)
    assert after["vram_low_watermark_mb"] == pytest.approx(
        min(30 - cut, 30 * after["vram_high_watermark_mb"] / 40), abs=1e-3
    )
    assert after["activation_vram_high_watermark_mb"] == pytest.approx(26 - cut, abs=1e-3)
    assert after["activation_vram_low_watermark_mb"] == pytest.approx(20 - cut, abs=1e-3)
    assert after["prefetch_window_blocks"] == 1
    assert {k: after[k] for k in ("max_inflight_transfers", "max_inflight_d2h")} == {
        "max_inflight_transfers": 2,
        "max_inflight_d2h": 1,
    }
    # Rounded down to the KB, never up.
    assert all(round(after[k] * 1000) == after[k] * 1000 for k in after if k.endswith("_mb"))


def test_every_lowering_cuts_at_least_the_margin_and_the_floors_end_it():
    limits, seen = dict(LIMITS), 0
    card = 100 * MB
    while (after := lowered_limits(limits, 50 * MB, card)) is not None:
        # Under the card already (a fragment, a scratch tensor): still a cut of the margin.
        assert after["vram_high_watermark_mb"] <= max(0, limits["vram_high_watermark_mb"] - 10)
        limits, seen = after, seen + 1
    assert seen == 4  # 40 -> 30 -> 20 -> 10 -> 0
    assert {limits[k] for k in limits if k.endswith("watermark_mb")} == {0.0}
    assert limits["prefetch_window_blocks"] == 1
    assert lowered_limits({}, 10, 100) is None  # a strategy without limits: nothing to lower
    assert lowered_limits({"prefetch_window_blocks": 0}, 10, 100) is None
    # An unknown card is taken to be what the step needed.
    unknown = lowered_limits(LIMITS, 20 * MB, None)
    assert unknown["vram_high_watermark_mb"] == pytest.approx(18 - 2, abs=1e-3)
    with pytest.raises(ValueError, match="card_bytes"):
        lowered_limits(LIMITS, 1, 0)
