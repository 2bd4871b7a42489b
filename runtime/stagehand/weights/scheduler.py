"""The traced block order: trace, cursor and prefetch window.

# NOTE [ Block trace ]
The first step is a trace pass: every *use* of a block is recorded in order, where a use is a
forward entry, the start of the block's backward, or a gradient-checkpoint recomputation (which
runs the block's forward again inside backward, so checkpointed steps trace the reverse order the
same way). A recomputation right after the same block's backward start is not a new use (it is
part of that backward), so it does not move the cursor. At the end of each step the recorded sequence becomes the order; a later step
that runs differently (an inference pass, a different model path) simply re-traces.

After the trace, a cursor follows the order: each use moves it to the next position holding that
block, searching cyclically, so the positions after the last block of a step are the first
blocks of the next step. Prefetch therefore never stops after step 0 even when ``begin_step`` is
never called (a defect of the public implementation), and runs in backward as well as forward.
What is evicted and prefetched along the order is ``policy.py``'s (NOTE [ Eviction policy ]).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator


class BlockScheduler:
    """Traced block order, cursor and window.

    ``prefetch_window`` is the user's setting (live limits write it); ``window_cap`` is the
    Conductor's (its adapter publishes it, None when no Conductor is attached). The window in
    force is the smaller of the two (``window``), so neither ever overwrites the other."""

    def __init__(self, prefetch_window: int) -> None:
        self.prefetch_window = prefetch_window
        self.window_cap: int | None = None
        self.order: list[int] | None = None
        """The traced use order of one step (block indices), None until the trace step ended."""
        self.pos = -1
        self.current: list[int] = []
        """Uses recorded in the running step."""
        self.retraces = 0

    @property
    def window(self) -> int:
        """Blocks loaded ahead in force: ``prefetch_window``, at most ``window_cap``."""
        cap = self.window_cap
        return self.prefetch_window if cap is None else min(self.prefetch_window, cap)

    @property
    def traced(self) -> bool:
        return self.order is not None

    def record_use(self, index: int, recompute: bool = False) -> None:
        """A use of block ``index``; advances the cursor along the order. A ``recompute`` use of
        the block used last is part of that use."""
        if recompute and self.current and self.current[-1] == index:
            return
        self.current.append(index)
        order = self.order
        if not order:
            return
        n = len(order)
        for k in range(1, n + 1):
            j = (self.pos + k) % n
            if order[j] == index:
                self.pos = j
                return

    def ahead(self) -> Iterator[int]:
        """The distinct blocks after the cursor, soonest first, once around the order (lazy;
        nothing before the trace). ``policy.window`` walks it."""
        order = self.order
        if not order:
            return
        seen: set[int] = set()
        n = len(order)
        for k in range(1, n + 1):
            index = order[(self.pos + k) % n]
            if index not in seen:
                seen.add(index)
                yield index

    def upcoming(self, count: int | None = None) -> list[int]:
        """The next ``count`` (default: the window) distinct blocks after the cursor, in order."""
        count = self.window if count is None else count
        return list(itertools.islice(self.ahead(), max(0, count)))

    def distance(self, index: int) -> int:
        """Uses until block ``index`` is needed again (len(order) when never or untraced)."""
        order = self.order
        if not order:
            return 1 << 30
        n = len(order)
        for k in range(1, n + 1):
            if order[(self.pos + k) % n] == index:
                return k
        return n + 1

    def retrace(self) -> None:
        """Forget the traced order: the next step traces it again, as a run's first step does
        (a live watermark change, NOTE [ Live watermarks ] in ``policy.py``)."""
        self.order, self.pos, self.current = None, -1, []

    def end_step(self) -> bool:
        """Close the running step's record; True when it changed the order (trace or re-trace)."""
        changed = False
        if self.current and self.current != self.order:
            if self.order is not None:
                self.retraces += 1
            self.order = list(self.current)
            changed = True
        self.current = []
        self.pos = -1
        return changed
