"""Bad input to the layer-offload strategy fails at set-up, naming the field."""

import pydantic
import pytest
import torch

from stagehand.config.memory import MemoryConfig
from stagehand.layer_offload import resident_count
from stagehand.strategy import build_strategy

from ._helpers import layer_offload, make_model


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "most"])
def test_fraction_outside_0_1_names_the_field(tiny_sd3, fraction):
    model = make_model("sd3", tiny_sd3)
    names = [type(m).__name__ for m in model.transformer_blocks]
    with pytest.raises(pydantic.ValidationError) as info:
        build_strategy(model, layer_offload(fraction, True), device="cpu")
    assert [e["loc"] for e in info.value.errors()] == [("layer_offload_fraction",)]
    with pytest.raises(pydantic.ValidationError, match="layer_offload_fraction"):
        MemoryConfig.model_validate(layer_offload(fraction, False))
    # Nothing was installed on the model.
    assert [type(m).__name__ for m in model.transformer_blocks] == names


@pytest.mark.parametrize("fraction", [-0.5, 1.01, float("nan"), True])
def test_resident_count_refuses_bad_fractions(fraction):
    with pytest.raises(ValueError, match="layer_offload_fraction"):
        resident_count(fraction, 57)


@pytest.mark.parametrize(
    ("fraction", "n", "resident"),
    [(0.9, 57, 6), (0.0, 57, 57), (1.0, 57, 0), (0.5, 4, 2), (0.9, 4, 1), (0.3, 10, 7)],
)
def test_resident_count_is_the_seeds_rule(fraction, n, resident):
    # Flux 1 Dev at 0.9: 51 of 57 offloaded, 6 resident (the seed's figures).
    assert resident_count(fraction, n) == resident


def test_weight_watermarks_are_not_live_limits(tiny_sd3):
    model = make_model("sd3", tiny_sd3)
    strategy = build_strategy(model, layer_offload(0.5, True), device="cpu")
    with pytest.raises(ValueError, match="vram_low_watermark_mb.*layer_offload_fraction"):
        strategy.set_limits({"vram_low_watermark_mb": 10})
    strategy.set_limits({"max_inflight_transfers": 1, "activation_vram_high_watermark_mb": 5})
    with strategy.step(0):
        pass
    assert strategy.weights.transfer.max_inflight == 1
    assert strategy.activations.budget.high_mb == 5
    strategy.close()
    assert all(p.device == torch.device("cpu") and p.numel() for p in model.parameters())
