"""The eviction and prefetch policy on tiny block states: exact decisions (NOTE [ Eviction policy ])."""

from dataclasses import dataclass

import pytest

from stagehand.weights.policy import (
    evictable,
    furthest,
    make_room,
    needed_after,
    prefetch,
    release_after_use,
    room_for_use,
    window,
)
from stagehand.weights.scheduler import BlockScheduler

TRAIN_4 = [0, 1, 2, 3, 3, 2, 1, 0]  # a training step of 4 blocks: forward, then backward
TRAIN_3 = [0, 1, 2, 2, 1, 0]


@dataclass
class _Block:
    index: int
    on_device: bool = False
    resident: bool = False
    nbytes: int = 10
    prefetched: bool = False


class _Device:
    """Blocks on a device whose usage is ``base`` plus the loaded blocks' bytes; records evictions."""

    def __init__(self, n: int, loaded=(), resident=(), base: int = 0) -> None:
        self.blocks = [_Block(i, i in loaded or i in resident, i in resident) for i in range(n)]
        self.base = base
        self.evicted: list[int] = []
        self.loaded: list[int] = []

    def usage(self) -> int:
        return self.base + sum(b.nbytes for b in self.blocks if b.on_device)

    def evict(self, block: _Block) -> None:
        block.on_device = False
        self.evicted.append(block.index)

    def load(self, block: _Block) -> bool:
        block.on_device = True
        self.loaded.append(block.index)
        return True


def _trace(order, used, window=1) -> BlockScheduler:
    """A scheduler that traced ``order`` in one step, then saw the uses ``used``."""
    trace = BlockScheduler(window)
    for index in order:
        trace.record_use(index)
    trace.end_step()
    for index in used:
        trace.record_use(index)
    return trace


def test_evictable_is_on_device_not_resident_not_active_not_kept():
    dev = _Device(6, loaded={0, 1, 2, 3, 5}, resident={4})
    assert [b.index for b in evictable(dev.blocks, active={1})] == [0, 2, 3, 5]
    assert [b.index for b in evictable(dev.blocks, active={1}, keep=[3, 0])] == [2, 5]
    assert evictable(dev.blocks, active=set(range(6))) == []


def test_furthest_and_needed_after_follow_the_trace():
    trace = _trace(TRAIN_4, used=[0, 1])  # forward of block 1: next 2, 3, 3, 2, 1, 0
    assert [trace.distance(i) for i in range(4)] == [6, 5, 1, 2]
    blocks = [_Block(i) for i in (0, 1, 3)]
    assert furthest(trace, blocks).index == 0
    assert furthest(trace, []) is None
    # make room for block 2 (needed next): every other is needed later, furthest first
    assert [b.index for b in needed_after(trace, blocks, 2)] == [0, 1, 3]
    # for block 0 (needed last) nothing may go
    assert needed_after(trace, blocks, 0) == []


def test_make_room_evicts_only_blocks_needed_later_furthest_first():
    # Forward, block 0 in use; block 1 prefetched (needed next), block 3 left over (needed third).
    trace = _trace(TRAIN_4, used=[0], window=2)
    assert trace.upcoming() == [1, 2]
    dev = _Device(4, loaded={0, 1, 3})
    fits = make_room(trace, dev.blocks, {0}, dev.blocks[2], 35, dev.usage, dev.evict)
    assert (fits, dev.evicted, dev.usage()) == (True, [3], 20)

    # Room for block 2 only by evicting block 1, needed before it: not done, no room.
    dev = _Device(4, loaded={0, 1, 3})
    fits = make_room(trace, dev.blocks, {0}, dev.blocks[2], 25, dev.usage, dev.evict)
    assert (fits, dev.evicted) == (False, [3])

    # Under the high watermark already: nothing is evicted.
    dev = _Device(4, loaded={0, 1, 3})
    assert make_room(trace, dev.blocks, {0}, dev.blocks[2], 40, dev.usage, dev.evict)
    assert dev.evicted == []


def test_release_after_use_keeps_blocks_under_the_low_watermark():
    trace = _trace(TRAIN_3, used=[0])  # forward: block 0 done, the window holds block 1
    dev = _Device(3, loaded={0, 1})
    release_after_use(trace, dev.blocks, set(), 1000, 1000, dev.usage, dev.evict)
    assert dev.evicted == []  # block 0 stays: usage (20) is under the low watermark
    # Over it: block 0 (needed last, in backward) goes, block 1 (the window's) stays.
    release_after_use(trace, dev.blocks, set(), 1000, 15, dev.usage, dev.evict)
    assert (dev.evicted, dev.usage()) == ([0], 10)


def test_the_window_counts_loads_ahead_and_passes_over_kept_blocks():
    """NOTE [ Prefetch window ]: end of backward, blocks 0 and 1 kept on the device (the next
    step's first two). A window of 1 reaches past them to block 2, the first to load; counted
    in uses, it held block 0 only and left the copy engine idle while 0 and 1 computed."""
    trace = _trace(TRAIN_4, used=TRAIN_4, window=1)
    assert trace.upcoming() == [0]  # the next use
    dev = _Device(4, loaded={0, 1})
    assert [b.index for b in window(trace, dev.blocks)] == [0, 1, 2]
    assert prefetch(trace, dev.blocks, lambda b: True, dev.load) and dev.loaded == [2]
    # Block 2 loaded ahead takes the window's one place: block 3 waits for a use.
    dev.blocks[2].prefetched = True
    assert [b.index for b in window(trace, dev.blocks)] == [0, 1, 2]
    assert prefetch(trace, dev.blocks, lambda b: True, dev.load) and dev.loaded == [2]
    trace.prefetch_window = 2
    assert prefetch(trace, dev.blocks, lambda b: True, dev.load) and dev.loaded == [2, 3]
    # Nothing to load ahead (every block on the device): the window is the whole cycle.
    assert [b.index for b in window(trace, dev.blocks)] == [0, 1, 2, 3]
    assert window(BlockScheduler(2), dev.blocks) == []  # before the trace


def test_release_after_use_keeps_the_window_under_the_high_watermark():
    # End of backward: blocks 0 and 1 (the next step's first) kept, 3 (needed last) left over,
    # 2 the window's load. Over the low watermark only block 3 may go: evicting 0 or 1 would
    # load it again at once.
    trace = _trace(TRAIN_4, used=TRAIN_4)
    dev = _Device(4, loaded={0, 1, 3})
    release_after_use(trace, dev.blocks, set(), 100, 15, dev.usage, dev.evict)
    assert (dev.evicted, dev.usage()) == ([3], 20)

    # Every block on the device, none to load ahead: all of them in the window, none goes.
    dev = _Device(4, loaded={0, 1, 2, 3})
    release_after_use(trace, dev.blocks, set(), 100, 5, dev.usage, dev.evict)
    assert (dev.evicted, dev.usage()) == ([], 40)

    # Over the high watermark: any idle block, furthest first, down to the low watermark.
    release_after_use(trace, dev.blocks, set(), 15, 15, dev.usage, dev.evict)
    assert (dev.evicted, dev.usage()) == ([3, 2, 1], 10)


def test_release_after_use_spares_resident_and_active_blocks():
    trace = _trace(TRAIN_3, used=TRAIN_3)
    dev = _Device(3, loaded={0, 2}, resident={1})
    release_after_use(trace, dev.blocks, {2}, 0, 0, dev.usage, dev.evict)
    assert dev.evicted == [0]  # the only idle block left, over both watermarks


def test_room_for_use_evicts_furthest_first_until_the_block_fits():
    # Forward, block 2 needed now and not loaded; 0 (needed last), 1 and 3 idle on the device.
    trace = _trace(TRAIN_4, used=[0, 1, 2])
    dev = _Device(4, loaded={0, 1, 3})
    room_for_use(trace, dev.blocks, {2}, dev.blocks[2], 30, dev.usage, dev.evict)
    assert (dev.evicted, dev.usage()) == ([0], 20)  # 20 + block 2's 10 fits under 30
    # Nothing idle is left: the block loads anyway (it is needed now).
    dev = _Device(4, loaded={1})
    room_for_use(trace, dev.blocks, {1, 2}, dev.blocks[2], 5, dev.usage, dev.evict)
    assert dev.evicted == []


def _cyclic_steps(n: int, high: int, low: int, window: int, steps: int = 4) -> list[list[int]]:
    """The blocks loaded in each step of ``steps`` training steps of ``n`` 10-byte blocks, run
    as the weight runtime runs them: at each use a demand load if needed, then prefetch; after
    it ``release_after_use``, then prefetch."""
    trace = BlockScheduler(window)
    dev = _Device(n)
    active: set[int] = set()

    def fits(block):
        return make_room(trace, dev.blocks, active, block, high, dev.usage, dev.evict)

    def ahead(block):  # a speculative load: loaded ahead until used
        block.prefetched = dev.load(block)
        return block.prefetched

    loads = []
    for _ in range(steps):
        dev.loaded = []
        for index in [*range(n), *reversed(range(n))]:
            block = dev.blocks[index]
            trace.record_use(index)
            active.add(index)
            if not block.on_device:
                dev.load(block)
            block.prefetched = False
            prefetch(trace, dev.blocks, fits, ahead)
            assert dev.usage() <= max(high, low + block.nbytes)
            active.discard(index)
            release_after_use(trace, dev.blocks, active, high, low, dev.usage, dev.evict)
            prefetch(trace, dev.blocks, fits, ahead)
        trace.end_step()
        prefetch(trace, dev.blocks, fits, ahead)
        loads.append(dev.loaded)
    return loads


@pytest.mark.parametrize(
    ("n", "fit", "window", "kept"),
    [(8, 3, 1, 3), (8, 4, 2, 4), (10, 5, 1, 5), (6, 0, 1, 1), (6, 6, 1, 6), (7, 7, 3, 7)],
)
def test_the_cyclic_trace_loads_each_block_that_does_not_fit_twice_a_step(n, fit, window, kept):
    """NOTE [ Eviction policy ]: ``fit`` blocks fit under the low watermark and the window in
    the band above it. After the trace step ``kept`` blocks' worth stay on the device through
    the turns (with ``fit`` 0, the window's: the last forward block is backward's first, the
    last backward block the next forward's first) and the others are loaded once in forward
    and once in backward: 2 x (n - kept) loads a step, none of a block more than twice. Which
    block is loaded where follows the window (NOTE [ Prefetch window ]: it reaches past the
    kept blocks, so the next step's first loads start at the end of backward)."""
    low = 10 * fit
    *_, steady = _cyclic_steps(n, low + 10 * window, low, window)
    assert len(steady) == 2 * (n - kept)
    assert all(steady.count(i) <= 2 for i in range(n))
