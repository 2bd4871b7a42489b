"""Early-stopped recomputation and aborted layers leave no layer stale on the device."""

import pytest
import torch
from torch.utils.checkpoint import _StopRecomputationError, set_checkpoint_early_stop

from stagehand.common import ListSink, Telemetry
from stagehand.strategy import build_strategy
from workbench.worker.assets import example_inputs, output_tensor

from ._helpers import assert_same_training, layer_offload, make_model, train


@pytest.fixture(scope="module")
def reference(tiny_flux):
    return train(make_model("flux", tiny_flux))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recompute"])
def test_recomputation_never_leaves_a_layer(tiny_flux, reference, early_stop):
    model = make_model("flux", tiny_flux)
    strategy = build_strategy(model, layer_offload(0.9, True), device="cpu")
    manager = strategy.manager
    n = len(strategy.weights.blocks)
    left = []
    with set_checkpoint_early_stop(early_stop):
        out = train(
            model,
            strategy,
            on_backward=lambda step: left.append(manager.offloaded_on_device()),
        )
    assert_same_training(reference, out)
    # Early stop: the recomputation ends before the block returns, so ``after_layer`` never
    # fires in backward (the seed's stale-layer bug); a full recomputation reaches it.
    assert manager.stats["after_layer_forward"] == 2 * n
    assert manager.stats["after_layer_recompute"] == (0 if early_stop else 2 * n)
    # Either way: at most one offloaded layer on the device whenever a layer starts, and
    # none once backward is over. Nothing needed the stale-layer eviction.
    assert manager.on_device_max <= 1
    assert left == [[], []]
    assert manager.stats["stale_evictions"] == 0
    strategy.close()


def test_aborted_layer_is_evicted_before_the_next_layer(tiny_flux, reference):
    """A layer whose forward stops with ``_StopRecomputationError`` after its weights were
    loaded (what an early-stopped recomputation does to a block) stays on the device until the
    next ``before_layer`` evicts it as stale."""
    model = make_model("flux", tiny_flux)
    sink = ListSink()
    strategy = build_strategy(
        model, layer_offload(0.9, True), device="cpu", telemetry=Telemetry(sink)
    )
    manager = strategy.manager
    last = strategy.weights.blocks[-1]  # single_transformer_blocks.1, offloaded
    assert not last.resident
    wrapper = model.single_transformer_blocks[1]

    def stop(*_):
        raise _StopRecomputationError()

    inputs = example_inputs(model, seed=0)
    x = torch.zeros(1, 4, 64)
    with strategy.step(0):
        with strategy.forward():
            handles = [m.register_forward_pre_hook(stop) for m in wrapper.layer.children()]
            with pytest.raises(_StopRecomputationError):
                wrapper(hidden_states=x, encoder_hidden_states=x, temb=torch.zeros(1, 64))
            for handle in handles:
                handle.remove()
            assert manager.offloaded_on_device() == [last.index]  # no end boundary fired
            loss = output_tensor(model(**inputs)).pow(2).mean()
        with strategy.backward():
            loss.backward()
    assert loss.item() == reference[0][0]
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.grad, reference[1][0][name]), name
    assert manager.stats["stale_evictions"] == 1
    stale = [r for r in sink.of("stagehand", "block") if r.get("reason") == "stale"]
    assert [(r["event"], r["block"], r["step"]) for r in stale] == [("evict", last.index, 0)]
    assert manager.offloaded_on_device() == []
    strategy.close()
