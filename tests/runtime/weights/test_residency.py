"""Residency from the budget (NOTE [ Eviction policy ]): blocks stay on the device while usage is
under the low watermark; each block that does not fit is loaded once in forward and once in
backward. Exact on CPU: the tracked bytes are the runtime's own."""

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.config.memory import MB
from stagehand.weights import WeightRuntime
from tests.runtime.device_double import device_double

from ._train import Wide, config

DEPTH, WIDTH = 8, 64


def _run(kept: int, window: int, steps: int = 3):
    """Train-shaped steps (forward, backward) of a frozen ``Wide`` whose input requires grad, with
    room under the low watermark for ``kept`` blocks (and half a block) and the window above it."""
    torch.manual_seed(0)
    model = Wide(WIDTH, DEPTH).requires_grad_(False)
    sink = ListSink()
    runtime = WeightRuntime(model, config(), device="cpu", telemetry=Telemetry(sink))
    block = runtime.blocks[0].nbytes
    assert {b.nbytes for b in runtime.blocks} == {block} and runtime.resident_bytes == 0
    low = (kept + 0.5) * block
    runtime.set_watermarks((low + window * block) / MB, low / MB)
    runtime.scheduler.prefetch_window = window
    for step in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()
        runtime.begin_step(step)
        with runtime.managed_forward():
            loss = model(x).pow(2).mean()
        with runtime.managed_backward():
            loss.backward()
        runtime.end_step()
    runtime.close()
    return sink, block, low


@pytest.mark.parametrize(("kept", "window"), [(4, 1), (3, 2), (6, 1), (DEPTH, 1)])
def test_blocks_that_fit_stay_and_the_rest_move_twice_a_step(kept, window):
    sink, block, low = _run(kept, window)
    steady = sink.of("stagehand", "step")[-1]
    streamed = DEPTH - kept
    assert steady["blocks_loaded"] == 2 * streamed
    assert steady["h2d_bytes"] == 2 * streamed * block  # 2 x (bytes of the blocks that do not fit)
    # At the step's end the kept blocks and, reaching past them (NOTE [ Prefetch window ]),
    # the window's loads ahead for the next step's forward.
    assert steady["resident_blocks"] == min(DEPTH, kept + window)
    assert steady["prefetch_misses"] == 0
    assert steady["vram_peak_mb"] * MB <= low + window * block
    # The usage oscillates across the low watermark, between post-eviction valleys and the
    # prefetched window above them, never over the high one.
    seen = [r["vram_allocated_mb"] * MB for r in sink.of("stagehand", "block") if r["step"] == 2]
    if streamed:
        assert min(seen) <= low < max(seen) <= low + window * block


def test_low_watermark_zero_keeps_only_the_window():
    """Low 0, window 1: the last forward block is backward's first and the last backward block
    the next forward's first; those stay, every other block moves twice."""
    sink, block, _ = _run(0, 1)
    steady = sink.of("stagehand", "step")[-1]
    assert steady["blocks_loaded"] == 2 * (DEPTH - 1)
    assert steady["h2d_bytes"] == 2 * (DEPTH - 1) * block


@pytest.mark.sync_device  # the lag is this test's own
@pytest.mark.parametrize(("kept", "window"), [(4, 1), (6, 1), (3, 2)])
def test_copies_back_in_flight_evict_no_more_blocks(kept, window):
    """NOTE [ Bytes being freed ]: on a device whose copies end late (the device double, lag
    4), the blocks exposed at a step's end copy their weights back at their eviction and their
    bytes count until that copy ends. The steady steps load, keep and copy back exactly what
    they do on a synchronous device; before, the eviction after a use went on through every
    idle block while usage did not drop (kept 4: 9 and 8 loads in alternate steps)."""
    keys = ("blocks_loaded", "h2d_bytes", "resident_blocks", "d2h_bytes", "prefetch_misses")
    sync, _, _ = _run(kept, window, steps=4)
    with device_double(4) as clock:
        lagged, _, _ = _run(kept, window, steps=4)
    assert clock.max_pending > 0  # copies really were in flight behind the host
    for step in (2, 3):
        want = sync.of("stagehand", "step")[step]
        got = lagged.of("stagehand", "step")[step]
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert want["d2h_bytes"] > 0  # not vacuous: blocks were copied back
