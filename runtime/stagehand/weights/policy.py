"""Eviction and prefetch policy: which blocks go, which come, over block states and the trace.

# NOTE [ Eviction policy ]
Belady's rule over the traced order (NOTE [ Block trace ] in ``scheduler.py``): of the blocks
that may go, the one needed furthest ahead goes first. The watermarks are a budget: a block
stays on the device after its use while usage is under the low watermark, and the band between
the low and the high one is the prefetch window's room. Four moments decide:

- prefetch (``prefetch``): the window's blocks (``window``) not on the device are loaded in
  order; the walk stops at the first that does not fit or cannot be loaded (no slab, no copy
  slot, the Conductor's no), so a later block never overtakes an earlier one;
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

# NOTE [ Prefetch window ]
The window is counted in blocks *loaded ahead*, not in uses: it runs along the trace from the
cursor through the ``trace.window``-th block that is not on the device or was loaded ahead and
not used since (``prefetched``). Blocks the watermarks kept on the device lie inside it and take
no place in it, so a run of kept blocks does not hide the next load from the prefetch: the copy
engine works while they compute. Before, the window was the next ``trace.window`` blocks used,
kept or not; after a run of kept blocks the first streamed one was issued only ``window`` uses
ahead, and a planned FLUX.1-dev step on a 24 GiB card waited 48 ms on copies in flight where
it now waits 40 (``workbench plan``, h100 profile, 2 blocks). The device bytes the window holds
are unchanged: at most ``trace.window`` blocks loaded ahead.

# NOTE [ Window growth ]
The watermarks decide what stays on the card; the window decides how early a load's copy is
issued. A load hides when its copy ends before the compute reaches its use; it does not when a
run of streamed blocks copies slower than it computes (FLUX.1-dev's single blocks in forward:
~5.7 ms of copy, ~4.2 of compute, planned on an H100 at 50 GB/s) and the copy engine, held to
the window, starts that run too late. A deeper window starts it during the kept blocks'
compute. The watermarks still bound the bytes loaded ahead (``"auto"`` sizes the band from the
*derived* window's blocks, NOTE [ Auto watermarks ], and growth leaves them as they are). On the
issue 44 GPU run the derived window of 2 left 15 of 23 loads waiting; the planner's simulation
of that card (``workbench plan``, FLUX.1-dev, 24 GiB, h100 profile) waits on 24 copies for 39.8
ms a step with 2, on 10 for 12.8 ms with 4 and on none with 8: 835.1 ms, the all-resident step,
with the same 23 blocks resident and 14.0 GB moved instead of 14.4. Where the band is short (16 GiB), prefetches
deep in the window make room by evicting kept blocks (``make_room``): with 8 no block stays
resident, 26.9 GB move instead of 28.9 and the step takes 851 ms instead of 1066, 15 ms of it
waits that a deeper window does not remove.

So when the preset leaves ``prefetch_window_blocks`` to the runtime, the window follows the
measured waits: after a steady step (traced before it, the same order after it) in which any use
waited on its prefetched block's copy still in flight (``ComputeWaits``: timed on the device on
CUDA), the next step runs with twice the window (``grown_window``), up to the blocks less one and
``MAX_GROWN_WINDOW``. It never shrinks, so a run settles within a few steps. The planner's
simulation applies the same rule to its simulated waits (``backend/workbench/plan/simulate.py``), so a plan streams
the steps a run will. A window the user gives (in the preset or as a live limit) is kept as it is.

# NOTE [ Live watermarks ]
The rules above have more than one steady state for the same watermarks: a block kept on the
device lies inside the window for free (NOTE [ Prefetch window ]) and the window's blocks are
kept while usage is under the high watermark, so once every block is on the device the window
spans the whole order and nothing goes, whatever the low watermark says. Which state a run
reaches depends on where it came from. A run started with 3/0 MB traces with nothing kept and
settles where it streams; the same 3/0 set live after 40/30 (every block kept) kept every block
and moved 0 bytes a step: on the tiny Flux of the tests (4 blocks, the ``default`` preset's
section) 1,705,984 bytes of H2D a step from the start against 0 live, and on the ``default``
preset's own model (8 blocks) 4 blocks resident and 2.89 MB a step against 8 and 0.

So a live watermark change re-derives what a start with those watermarks derives: at the next
step begin (``WeightRuntime.set_watermarks`` marks it due) every loaded block that is not
resident (layer offload's) is evicted (``stagehand/block`` ``evict`` records, ``reason:
"limits"``), the trace is dropped (``BlockScheduler.retrace``) and a derived window that grew
goes back to the derived one (NOTE [ Window growth ]): that step is a trace step under the new
watermarks, as a run's first step is, and the steps after it follow the same schedule as a run
started with them (``tests/runtime/weights/test_live_settle.py``: resident blocks, H2D bytes
and the tracked peak of every steady step equal). The price is that one step's loads: each
block a demand load, once.

# NOTE [ Bytes being freed ]
On CUDA an evicted block's bytes count in ``usage()`` until the copy that still reads them ends
(a module-backed block's copy back, ``DeviceMemory.release_after``): the allocator cannot reuse
them yet. Re-reading usage after each eviction is right where a block must really fit (room
for a prefetch or a use), but after a use it over-evicted: each eviction left usage where it
was, so the loop went on through every idle block, and each was loaded again later. Under the
device double (``STAGEHAND_TEST_LAG=4``, ``tests/runtime/weights/test_residency.py``) a budget
of 4 of 8 blocks loaded 8 and 9 blocks in alternate steps instead of 8. ``release_after_use``
counts the bytes of the blocks it evicted that usage still holds as freed.

A block loaded again while its copy back is in flight, without a host image to copy from, must
wait on the host for that copy before staging its masters. A prefetch gives up instead
(``TransferEngine.load``) and is retried at the next use; the window, reaching past kept blocks,
otherwise reloaded a block evicted one use earlier and waited (``test_transfer_engine.py``).
A use still waits: under the double at lag 8, 1 host wait a step with 4 of 8 blocks kept.

The choices (``evictable``, ``furthest``, ``needed_after``, ``window``, ``grown_window``) are
pure: block states, the blocks in use and the trace in, blocks out. The loops that apply them take the usage reading, the
eviction and the load as callables, and read usage again after each eviction instead of
subtracting the block's bytes: on CUDA an evicted block's bytes count until its D2H copy ended
(``DeviceMemory.release_after``); ``release_after_use`` also counts its own evictions as freed
(NOTE [ Bytes being freed ]). ``WeightRuntime`` and the planner's simulation
(``backend/workbench/plan/simulate.py``) both call these, so a plan follows the schedule the runtime runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar


class BlockLike(Protocol):
    """What the policy reads of a block (``stagehand.weights.registry.Block``, the planner's)."""

    index: int
    nbytes: int
    resident: bool
    """Never evicted (layer offload's resident set)."""
    prefetched: bool
    """Loaded ahead of its use and not used since."""

    @property
    def on_device(self) -> bool:
        """Loaded or being loaded (PREFETCHING or GPU_READY)."""
        ...


class Trace(Protocol):
    """The traced order and its cursor (``BlockScheduler``), read only."""

    @property
    def window(self) -> int:
        """Blocks loaded ahead of their use at most (NOTE [ Prefetch window ])."""
        ...

    def ahead(self) -> Iterator[int]: ...

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


def window(trace: Trace, blocks: Sequence[B]) -> list[B]:
    """The prefetch window (NOTE [ Prefetch window ]): the blocks the trace uses next, soonest
    first, through the ``trace.window``-th that is loaded ahead of its use (not on the device,
    or ``prefetched``); blocks kept on the device in between belong to it. Empty before the
    trace."""
    out: list[B] = []
    ahead = 0
    if trace.window <= 0:
        return out
    for index in trace.ahead():
        block = blocks[index]
        out.append(block)
        if not block.on_device or block.prefetched:
            ahead += 1
            if ahead == trace.window:
                break
    return out


MAX_GROWN_WINDOW = 32
"""The deepest window growth reaches (NOTE [ Window growth ]): the window's walk runs at every
use, along the blocks kept in between as well."""


def grown_window(window: int, waits: int, blocks: int) -> int:
    """The window for the next step after a steady step that ran with ``window`` and had
    ``waits`` uses waiting on their copy (NOTE [ Window growth ]): twice ``window`` when any
    waited, at most ``blocks - 1`` and ``MAX_GROWN_WINDOW`` (never below ``window``);
    ``window`` otherwise."""
    if waits <= 0:
        return window
    return max(window, min(2 * max(window, 1), blocks - 1, MAX_GROWN_WINDOW))


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
    for block in window(trace, blocks):
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
    blocks: Sequence[B],
    active: Collection[int],
    high_bytes: float,
    low_bytes: float,
    usage: Callable[[], int],
    evict: Callable[[B], None],
) -> None:
    """The evictions after a block finished a use (it is no longer in ``active``): while usage
    is over ``low_bytes``, the idle block needed furthest ahead, outside the window unless usage
    is over ``high_bytes`` (NOTE [ Eviction policy ]). The blocks evicted here count as freed
    even while their bytes still count in ``usage()`` (a copy back in flight: NOTE [ Bytes being
    freed ]), so the loop evicts what brings usage under ``low_bytes`` once they are, no more;
    usage read lower than that (other copies ended) is taken as it is."""
    start = used = usage()
    evicted = 0
    while (left := min(used, start - evicted)) > low_bytes:
        keep = () if left > high_bytes else [b.index for b in window(trace, blocks)]
        victim = furthest(trace, evictable(blocks, active, keep))
        if victim is None:
            break
        evict(victim)
        evicted += victim.nbytes
        used = usage()
