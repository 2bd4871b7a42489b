"""Eviction and prefetch policy: which blocks go, which come, over block states and the trace.

# NOTE [ Eviction policy ]
Belady's rule over the traced order (NOTE [ Block trace ] in ``scheduler.py``): of the blocks
that may go, the one needed furthest ahead goes first. Three moments decide:

- prefetch (``prefetch``): the window's blocks not on the device are loaded in order; the walk
  stops at the first that does not fit or cannot be loaded (no slab, no copy slot, the
  Conductor's no), so a later block never overtakes an earlier one;
- room for a prefetch (``make_room``): a block is loaded ahead only if it fits under the high
  watermark after evicting idle blocks the order needs *later* than it, furthest first, never
  one needed before it. A block kept only because usage was under the low watermark must not
  stop the prefetch of one needed sooner;
- after a use (``release_after_use``): the block just used goes when the window does not need
  it; over the low watermark, whichever idle block is needed furthest ahead, this one or
  another (at the end of backward the block just used is the next step's first, and evicting
  it instead of the second makes every step begin with a stall); then what the window does not
  need until usage is under the low watermark.

The choices (``evictable``, ``furthest``, ``needed_after``) are pure: block states, the blocks
in use and the trace in, blocks out. The three loops that apply them take the usage reading, the
eviction and the load as callables, and read usage again after each eviction instead of
subtracting the block's bytes: on CUDA an evicted block's bytes count until its D2H copy ended
(``DeviceMemory.release_after``). ``StagehandRuntime`` and the planner's simulation
(``runtime/plan/simulate.py``) both call these, so a plan follows the schedule the runtime runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, TypeVar


class BlockLike(Protocol):
    """What the policy reads of a block (``runtime.weights.registry.Block``, the planner's)."""

    index: int
    nbytes: int
    resident: bool
    """Never evicted (layer offload's resident set)."""

    @property
    def on_device(self) -> bool:
        """Loaded or being loaded (PREFETCHING or GPU_READY)."""
        ...


class Trace(Protocol):
    """The traced order and its cursor (``BlockScheduler``), read only."""

    def upcoming(self, count: int | None = None) -> list[int]: ...

    def distance(self, index: int) -> int: ...


B = TypeVar("B", bound=BlockLike)


# -- choices (pure) ------------------------------------------------------------------------------
def evictable(blocks: Iterable[B], active: Collection[int], keep: Collection[int] = ()) -> list[B]:
    """The blocks that may be evicted now, in block order: on the device, not resident, not in
    use (``active``: indices of blocks between a use's begin and end), not in ``keep``."""
    return [
        b
        for b in blocks
        if b.on_device and not b.resident and b.index not in active and b.index not in keep
    ]


def furthest(trace: Trace, blocks: Iterable[B]) -> B | None:
    """The one of ``blocks`` needed furthest ahead in ``trace`` (the first of equals), None when
    there is none."""
    return max(blocks, key=lambda b: trace.distance(b.index), default=None)


def needed_after(trace: Trace, blocks: Iterable[B], index: int) -> list[B]:
    """Those of ``blocks`` needed later than block ``index``, furthest first: what may make room
    for ``index`` without evicting a block needed before it."""
    horizon = trace.distance(index)
    later = [b for b in blocks if trace.distance(b.index) > horizon]
    return sorted(later, key=lambda b: trace.distance(b.index), reverse=True)


# -- the loops that apply them (NOTE [ Eviction policy ]) ----------------------------------------
# ``usage()``: device bytes in use now; ``evict(block)``: evicts one (usage drops, perhaps later).


def prefetch(
    trace: Trace,
    blocks: Sequence[B],
    fits: Callable[[B], bool],
    load: Callable[[B], bool],
) -> bool:
    """Load the window's blocks that are not on the device, in the trace's order: ``fits(block)``
    makes room for it (``make_room``), ``load(block)`` issues its copy. Returns False when the
    walk stopped at a block that did not fit or was not loaded (a prefetch skipped)."""
    for index in trace.upcoming():
        block = blocks[index]
        if block.on_device:
            continue
        if not fits(block) or not load(block):
            return False
    return True


def make_room(
    trace: Trace,
    blocks: Iterable[B],
    active: Collection[int],
    block: B,
    high_bytes: float,
    usage: Callable[[], int],
    evict: Callable[[B], None],
) -> bool:
    """Whether ``block`` fits under ``high_bytes`` after evicting idle blocks the trace needs
    later than it, furthest first (each eviction only while it does not fit yet)."""
    need = high_bytes - block.nbytes
    if usage() <= need:
        return True
    for victim in needed_after(trace, evictable(blocks, active), block.index):
        if usage() <= need:
            break
        evict(victim)
    return usage() <= need


def release_after_use(
    trace: Trace,
    blocks: Iterable[B],
    active: Collection[int],
    block: B,
    low_bytes: float,
    usage: Callable[[], int],
    evict: Callable[[B], None],
) -> None:
    """The evictions after ``block`` (on the device, not resident, no longer in ``active``)
    finished a use: itself when the window does not need it; over ``low_bytes`` the idle block
    needed furthest ahead; then, while over ``low_bytes``, idle blocks outside the window,
    furthest first."""
    if block.index not in trace.upcoming():
        evict(block)
    elif usage() > low_bytes:
        evict(furthest(trace, evictable(blocks, active)))  # never None: ``block`` is idle
    while usage() > low_bytes:
        victim = furthest(trace, evictable(blocks, active, keep=trace.upcoming()))
        if victim is None:
            break
        evict(victim)
