"""The H2D/D2H engine (``transfer.py``) read against what a GPU does: copies that
finish out of issue order are retired, an eviction with nothing to copy back records no D2H
event, gradients that did not change do not travel, and the runtime's own host waits are counted
(``host_waits``) and absent from forward and backward."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from stagehand.common import DeviceMemory
from stagehand.common.device import TransferEvent
from stagehand.config.memory import MB
from stagehand.strategy import build_strategy
from stagehand.weights.pool import PinnedPool
from stagehand.weights.readers import StagedCopy
from stagehand.weights.transfer import InFlight, TransferEngine
from tests.runtime import exact
from tests.runtime.device_double import device_double
from tests.runtime.test_exactness import memory_section


class Grant:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_copies_finished_behind_a_head_still_reading_are_retired():
    """Defect 1: the head is a block still being read by a reader thread; the copy issued after
    it (a block image's, at once) finished. Its slab and its Conductor grant come back now;
    before, only a finished head was retired, so a later finished copy kept both until the
    head's read ended (the prefetches were denied ``h2d_slots_exhausted``)."""
    pool = PinnedPool(2 * MB, MB, pin=False, timeout_s=1)
    engine = TransferEngine(torch.device("cpu"), pool, DeviceMemory("cpu"), None, max_inflight=2)
    reading: Future = Future()
    head_slab, done_slab = pool.try_acquire("head"), pool.try_acquire("next")
    head_grant, done_grant = Grant(), Grant()
    engine.inflight.append(InFlight(None, StagedCopy(reading), head_slab, head_grant))
    engine.inflight.append(InFlight(None, TransferEvent(None), done_slab, done_grant))
    assert pool.try_acquire("third") is None  # both slabs held

    assert engine.retire()
    assert done_grant.released == 1 and done_slab.holder is None
    assert head_grant.released == 0 and head_slab.holder == "head"
    assert [e.staging for e in engine.inflight] == [head_slab] and engine.has_capacity()
    assert not engine.retire()  # nothing more finished

    reading.set_result(TransferEvent(None))  # the head's read ended and its copy finished
    assert engine.retire() and not engine.inflight
    assert head_grant.released == 1 and pool.used_bytes == 0


def _steps(model, built, lag, steps, set_to_none) -> dict[int, tuple]:
    """``steps`` AdamW steps under the lagging ``lag``; per step: the host waits the double saw and the strategy
    counted in forward and backward (read inside the backward, before its closing waits), the
    bytes copied back during the forward, and whether every trainable ``.grad`` is the same
    tensor after the forward as before."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    weights, seen = built.weights, {}
    for step in range(steps):
        with built.step(step):
            waits, counted = lag.host_waits, built.counters()["host_waits"]
            grads, d2h = [p.grad for p in params], weights.transfer.back.bytes
            with built.forward():
                loss = model(**exact.inputs_for(model, step)).pow(2).mean()
            kept = all(a is b for a, b in zip(grads, (p.grad for p in params), strict=True))
            forward_d2h = weights.transfer.back.bytes - d2h
            with built.backward():
                loss.backward()
                seen[step] = (
                    lag.host_waits - waits,
                    built.counters()["host_waits"] - counted,
                    forward_d2h,
                    kept,
                )
            with built.optimizer(opt):
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
    built.close()
    return seen


@pytest.mark.parametrize("strategy", ["stream-module", "stream-file"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("behind", [4, 8])
def test_no_host_wait_in_forward_or_backward_under_a_device_double(
    tmp_path, strategy, method, behind
):
    """Defect 7: the runtime's own host waits are counted (``host_waits``) and none falls in a
    forward or backward, under a device 4 or 8 operations behind the host with prefetches
    evicted before their use (high watermark above a block, low at 0). Before: the eviction of
    a PREFETCHING block waited on the host, and so did the load after an empty D2H event; and
    with the window reaching past kept blocks (NOTE [ Prefetch window ]) a prefetch of a block
    evicted one use before waited for its copy back (it now gives up and is retried)."""
    path = exact.build_toy("dual", tmp_path / "dual")
    with device_double(behind) as lag:
        model = exact.make_model("dual", path, method, "non-reentrant")
        memory = memory_section(strategy, True)
        memory["stagehand"].update(vram_high_watermark_mb=1000, prefetch_window_blocks=2)
        built = build_strategy(model, memory, device="cpu", checkpoint_dir=path)
        seen = _steps(model, built, lag, 3, set_to_none=True)
        assert lag.max_pending >= 1
    assert [(double, counted) for double, counted, *_ in seen.values()] == [(0, 0)] * 3


def test_unchanged_gradients_stay_on_the_host_through_a_forward(tmp_path):
    """Defect 3: with ``zero_grad(set_to_none=False)`` every trainable block keeps a gradient;
    a forward does not change it, so its eviction copies nothing back and keeps the host tensor
    (before: each forward copied every gradient to the device and back: ``d2h_bytes`` of all
    the gradients, a fresh host tensor each). The training stays exact (gradient accumulation:
    ``test_copy_back.py``)."""
    path = exact.build_toy("dual", tmp_path / "dual")
    with device_double(4) as lag:
        model = exact.make_model("dual", path, "full", "non-reentrant")
        memory = memory_section("stream-module", True)
        memory["stagehand"]["prefetch_window_blocks"] = 0  # no block exposed at a step's end
        built = build_strategy(model, memory, device="cpu", checkpoint_dir=path)
        seen = _steps(model, built, lag, 3, set_to_none=False)
    assert seen[0][2] == 0  # step 0: no gradient yet
    assert [(d2h, kept) for _, _, d2h, kept in seen.values()][1:] == [(0, True)] * 2
