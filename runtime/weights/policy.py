"""Eviction and prefetch policy: which blocks go, which come, over block states and the trace.

# NOTE [ Eviction policy ]
Belady's rule over the traced order (NOTE [ Block trace ] in ``scheduler.py``): of the blocks
that may go, the one needed furthest ahead goes first. The watermarks are a budget: a block
stays on the device after its use while usage is under the low watermark, and the band between
the low and the high one is the prefetch window's room. Four moments decide:

- prefetch (``prefetch``): the window's blocks not on the device are loaded in order; the walk
  stops at the first that does not fit or cannot be loaded (no slab, no copy slot, the
  Conductor's no), so a later block never overtakes an earlier one;
- room for a prefetch (``make_room``): a block is loaded ahead only if it fits under the high
  watermark after evicting idle blocks the order needs *later* than it, furthest first, never
  one needed before it. A block kept because usage was under the low watermark must not stop
  the prefetch of one needed sooner;
- room for a use (``room_for_use``): a block needed now and not on the device (the trace step,
  a prefetch that was skipped) is loaded at once, after evicting idle blocks furthest first
  while it would not fit under the high watermark (it loads anyway when none is left);
- after a use (``release_after_use``): nothing goes while usage is under the low watermark;
  over it, idle blocks go furthest first until it is under again. The window's blocks are
  kept (each would be loaded again at once) unless usage is over the high watermark: then any
  idle block may go, still furthest first.

On a step's cyclic trace (forward 0..N-1, backward N-1..0, the next forward) this keeps the
blocks used soonest: at the end of forward the last blocks (backward's first), at the end of
backward the first ones (the next forward's first). Each block that does not fit under the low
watermark is loaded once in forward and once in backward: 2 x (streamed bytes) of H2D a step,
the minimum for the budget (Belady's rule is optimal for a known sequence). Layer offload's
resident blocks are never candidates (``evictable``); its low watermark is 0.

The choices (``evictable``, ``furthest``, ``needed_after``) are pure: block states, the blocks
in use and the trace in, blocks out. The loops that apply them take the usage reading, the
eviction and the load as callables, and read usage again after each eviction instead of
subtracting the block's bytes: on CUDA an evicted block's bytes count until its D2H copy ended
(``DeviceMemory.release_after``). ``WeightRuntime`` and the planner's simulation
(``plan/simulate.py``) both call these, so a plan follows the schedule the runtime runs.
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


def room_for_use(
    trace: Trace,
    blocks: Iterable[B],
    active: Collection[int],
    block: B,
    high_bytes: float,
    usage: Callable[[], int],
    evict: Callable[[B], None],
) -> None:
    """The evictions before ``block``'s demand load: idle blocks, furthest first, while it would
    not fit under ``high_bytes``."""
    while usage() + block.nbytes > high_bytes:
        victim = furthest(trace, evictable(blocks, active))
        if victim is None:
            break
        evict(victim)


def release_after_use(
    trace: Trace,
    blocks: Iterable[B],
    active: Collection[int],
    high_bytes: float,
    low_bytes: float,
    usage: Callable[[], int],
    evict: Callable[[B], None],
) -> None:
    """The evictions after a block finished a use (it is no longer in ``active``): while usage
    is over ``low_bytes``, the idle block needed furthest ahead, outside the window unless usage
    is over ``high_bytes`` (NOTE [ Eviction policy ])."""
    while usage() > low_bytes:
        keep = () if usage() > high_bytes else trace.upcoming()
        victim = furthest(trace, evictable(blocks, active, keep))
        if victim is None:
            break
        evict(victim)
