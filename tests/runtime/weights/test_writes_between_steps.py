"""Frozen module-backed block weights written between steps (defect 5): the user's
code loads a state dict (or swaps EMA weights) after a step, while some blocks are still on the
device. The host masters are views of the image the H2D copy reads, so a write to a block still
PREFETCHING raced its copy (old or torn weights next step), and a block left GPU_READY took the
write on the device and lost it at eviction (frozen blocks were never copied back). Every later
step must see the write exactly, under a device that lags the host."""

from __future__ import annotations

import pytest
import torch

from stagehand.strategy import build_strategy
from stagehand.weights.errors import LostWriteError
from tests.runtime import exact
from tests.runtime.device_double import device_double
from tests.runtime.test_exactness import memory_section

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test


def _run(path, section=None, lag=0):
    """LoRA training (frozen block weights) with, after each step, an evaluation forward and
    every weight scaled by a ``load_state_dict``; the evaluations' sums and the ``exact.Run``."""
    with device_double(lag):
        model = exact.make_model("dual", path, "lora", ordinary=section is None)
        built = build_strategy(
            model, section or {"strategy": "none"}, device="cpu", checkpoint_dir=path
        )
        evals: list[float] = []

        def after_step(strategy):
            with strategy.step(100 + len(evals)):
                with torch.no_grad(), strategy.forward():
                    evals.append(model(**exact.inputs_for(model, 9)).sum().item())
            with torch.no_grad():
                model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})

        run = exact.train(model, built, steps=4, after_step=after_step)
    return run, evals


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = exact.build_toy("dual", tmp_path_factory.mktemp("dual") / "dual")
    return path, _run(path)


@pytest.mark.parametrize("host_cache_mb", [None, 64], ids=["masters", "images"])
@pytest.mark.parametrize("low_mb", [0, 1000], ids=["evicted-after-use", "kept-loaded"])
def test_frozen_weights_written_between_steps_reach_every_later_step(toy, host_cache_mb, low_mb):
    """Module-backed frozen blocks, their masters as they are or moved into one image each
    (``host_cache_mb``); blocks evicted after each use (the step's end prefetches the next
    step's first blocks: PREFETCHING while the user writes) or kept loaded (GPU_READY)."""
    path, (reference, reference_evals) = toy
    section = memory_section("stream-module", True)
    section["stagehand"].update(
        vram_high_watermark_mb=1000, vram_low_watermark_mb=low_mb, prefetch_window_blocks=2
    )
    if host_cache_mb is not None:
        section["stagehand"]["host_cache_mb"] = host_cache_mb
    got, evals = _run(path, section, lag=4)
    exact.assert_exact(reference, got)
    assert evals == reference_evals


@pytest.mark.parametrize(
    ("file_backed", "squareq", "kept_as"),
    [
        (True, None, "streams read-only from its checkpoint file"),
        (False, {"format": "int8"}, "is held on the host by SquareQ in 8 bits"),
    ],
    ids=["file-backed", "squareq-module-backed"],
)
def test_a_write_a_block_cannot_keep_is_refused_by_name(
    toy, tmp_path, file_backed, squareq, kept_as
):
    """Blocks kept loaded at a step's end whose weights have no host copy to take a write
    (read from the checkpoint file; quantized by SquareQ, its host holding 8 bits): a state
    dict loaded between steps would be lost at eviction, so the next step refuses it by name."""
    path, _ = toy
    section = memory_section("stream-file" if file_backed else "stream-module", True)
    section["stagehand"].update(vram_high_watermark_mb=1000, vram_low_watermark_mb=1000)
    if squareq is not None:
        section["stagehand"]["squareq"] = {**squareq, "cache_dir": str(tmp_path)}
    with pytest.raises(LostWriteError, match=rf"parameter '.+\.weight' .* but it {kept_as}"):
        _run(path, section, lag=4)
