"""NOTE [ Who gives way ]: with "auto" the activation watermarks sit above the weight band, so
when the activations need room the weight runtime evicts resident blocks (1 byte moved per byte
freed) before the activation runtime spills (2)."""

import pytest

from stagehand.conductor.arbitration import auto_limits
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from stagehand.weights.defaults import block_bytes
from stagehand.weights.registry import find_blocks
from tests.runtime import exact

from ..strategy.test_auto import _memory, _train


def test_auto_limits_put_the_activation_watermarks_at_the_soft_cap():
    limits = auto_limits(24_000 * MB, 1_000 * MB, 2_000 * MB)
    assert limits.soft_cap_bytes == limits.activation_high_bytes == 22_000 * MB
    assert limits.activation_low_bytes == 21_000 * MB and limits.hard_cap_bytes == 24_000 * MB
    with pytest.raises(ValueError, match="margin"):
        auto_limits(MB, 0, MB)


def test_resident_blocks_give_way_to_activations_before_anything_spills(tiny_flux):
    model = exact.make_model("flux", tiny_flux, "lora", None)
    blocks = sum(block_bytes(find_blocks(model)))
    # A budget that holds every block but not every block and the step's activations.
    strategy = build_strategy(
        model, _memory(1.2 * blocks / MB), device="cpu", checkpoint_dir=tiny_flux
    )
    try:
        _train(model, strategy, steps=3)
        counters = strategy.counters()
        n = len(strategy.weights.blocks)
        assert counters["blocks_evicted"] > 0 and counters["resident_blocks"] < n
        assert counters["tensors_spilled"] == 0  # the activations never had to move
    finally:
        strategy.close()
