"""The H2D/D2H engine (``transfer.py``) read against what a GPU does (issue 34): copies that
finish out of issue order are retired, an eviction with nothing to copy back records no D2H
event, gradients that did not change do not travel, and the runtime's own host waits are counted
(``host_waits``) and absent from forward and backward."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from runtime.common import DeviceMemory
from runtime.common.device import TransferEvent
from runtime.config import MB
from runtime.weights.pool import PinnedPool
from runtime.weights.transfer import InFlight, StagedCopy, TransferEngine


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
