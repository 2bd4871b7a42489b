"""The ``"auto"`` watermark rule (NOTE [ Auto watermarks ] in ``runtime/stagehand/weights/auto.py``)."""

import pytest

from stagehand.config.memory import MB
from stagehand.weights.auto import auto_watermarks, margin_bytes

GiB = 2**30


def test_high_leaves_room_for_activations_trainables_window_and_margin():
    # A 24 GiB card, 3 GiB of activations, 300 MB of LoRA + AdamW, a 1 GiB window.
    margin = margin_bytes(24 * GiB, cuda=True)
    assert margin == GiB + int(0.05 * 24 * GiB)
    high, low = auto_watermarks(24 * GiB, 3 * GiB, 300 * MB, GiB, margin)
    assert high == 24 * GiB - 3 * GiB - 300 * MB - GiB - margin
    assert low == high - GiB
    assert margin_bytes(24 * GiB, cuda=False) == 0  # tracked bytes: nothing uncounted


def test_a_window_exactly_left_is_low_zero():
    assert auto_watermarks(10 * MB, 2 * MB, MB, 3 * MB, MB) == (3 * MB, 0)


def test_a_budget_too_small_names_every_figure():
    with pytest.raises(ValueError) as err:
        auto_watermarks(24 * GiB, 20 * GiB, 300 * MB, GiB, 2 * GiB)
    message = str(err.value)
    for figure in ("24576 MB", "20480 MB", "300 MB", "1024 MB", "2048 MB", "leave 724 MB"):
        assert figure in message
    assert "vram_high_watermark_mb" in message


@pytest.mark.parametrize("name", ["device_bytes", "activation_peak_bytes", "window_bytes"])
@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_a_figure_that_is_not_a_byte_count_is_named(name, value):
    figures = dict(
        device_bytes=GiB, activation_peak_bytes=0, trainable_bytes=0, window_bytes=0, margin_bytes=0
    )
    figures[name] = value
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 0"):
        auto_watermarks(**figures)
