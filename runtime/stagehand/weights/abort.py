"""A step left by an error, undone on the weight runtime (``abort_step``).

# NOTE [ Aborted step ]
An out-of-memory error inside a step (forward, backward, optimizer step, a sample's inference
step) leaves the runtime mid-step: blocks in use, prefetches in flight, copies back issued, a
trace of half a step. The strategy's step context has already closed the step (``end_step``:
uses ended, copies back waited on). ``abort_step`` brings the runtime to the state of one just
built, between steps: every loaded block that is not resident (layer offload's) is evicted
(``stagehand/block`` ``evict`` records, ``reason: "aborted"``), every copy is drained (their
Conductor grants released with their entries), the trace is dropped and a derived window that
grew goes back to the derived one. The step run again is then a trace step, as a run's first
step is, under the limits the recovery lowered (NOTE [ Live watermarks ] in ``policy.py`` does
the same for a live change): tracked weight bytes are ``resident_bytes`` again, the figure a
run started with those limits has before its first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagehand.weights import policy
from stagehand.weights.scheduler import BlockScheduler

if TYPE_CHECKING:
    from stagehand.weights.runtime import WeightRuntime


def abort_step(rt: WeightRuntime) -> None:
    """See NOTE [ Aborted step ]. Safe between steps and on a step still open (it is closed
    first, its ``stagehand/step`` record written)."""
    if rt.steps.open:
        rt.end_step()
    rt.boundaries.finish()  # uses an error left open (end_step ended them already: a no-op)
    rt._active.clear()
    for block in policy.evictable(rt.blocks, ()):
        rt._evict(block, reason="aborted")
    rt.transfer.drain()
    if type(rt.scheduler) is BlockScheduler:  # a fixed schedule (layer offload's) keeps it
        rt.scheduler.retrace()
    rt.settle_due = False  # done here: nothing is loaded, the trace is gone
    if rt.window_grows:
        rt.scheduler.prefetch_window = rt.config.prefetch_window_blocks
