"""The layer-offload policy: which blocks stay resident, and the order blocks are used in.

# NOTE [ Resident set ]
``memory.layer_offload_fraction`` is the fraction of the N blocks that are *offloaded*; the
first ``N - floor(fraction x N)`` blocks are resident: loaded once at set-up and kept on the
device until close. Flux 1 Dev at 0.9 keeps 6 of its 57 blocks and offloads 51, as the seed's
run did (the Flux 2048 px layer-offload case study); 0.0 keeps every block, 1.0
none. This is the knob users of OneTrainer's LayerOffloadConductor and musubi-tuner's block swap
know, and it is a count rule rather than a byte budget on purpose:

- a preset behaves the same on every card and at every resolution: the same blocks move every
  step, so step time and host traffic are predictable and the resident set never oscillates
  with activation size or allocator fragmentation;
- a byte budget with eviction is what block streaming already is (``memory.strategy:
  "stagehand"``, its watermarks): a second strategy with the same rule would add nothing;
- on CPU (tracked memory) there is no device limit a budget could be derived from.
The *first* blocks are the resident ones (the seed's ``idx >= keep`` test): either end gives
the same loads per step, and this one matches the peers' behaviour users compare against.

# NOTE [ Layer order ]
No trace step is needed where the model calls its blocks in registration order (every
transformer: ``find_blocks`` lists Flux's ``transformer_blocks`` then
``single_transformer_blocks``, the order the model calls them), and backward uses them in
reverse. ``LayerOrderScheduler`` is the weight runtime's ``BlockScheduler`` with that order
(forward, then reversed) assumed from the start, so the prefetch window (the Conductor adapter's
knob) follows it from step 0.

A model may call its blocks in another order: a UNet's ``mid_block`` is registered after
``down_blocks`` and ``up_blocks`` (``find_blocks`` lists the stage after the lists) and called
between them (SDXL's tiny UNet, blocks ``down_blocks.0, down_blocks.1, up_blocks.0,
up_blocks.1, mid_block``: call order 0 1 4 2 3, backward 3 2 4 1). Walking the assumed order
there copies the wrong blocks ahead: the block the window loaded is evicted unused after the
use the model made instead, and loaded again at its own use (8 loads a step of the 2
offloaded blocks, where the window at 0 makes 4). So the order is learned, not assumed:

- each use is checked against the order: the next position after the cursor (a step may run
  more than one pass, so the order's end wraps to its start). A use anywhere else takes the
  step *off order*;
- off order, the window issues no copy for the rest of the step: its walk yields only the
  blocks already loaded ahead and not used since, so they stay on the device until their use
  (each is still one load and one eviction, as with the window at 0); the other blocks load
  when used;
- at the end of a step that went off order, the uses it recorded (each block's forward entry
  and backward start: NOTE [ Block trace ] in ``runtime/stagehand/weights/scheduler.py``) become the order
  of the next step (``end_step`` returns True: the step record's ``trace_updated``). A later
  step that runs differently (a data-dependent path) is the same: off order from its first
  unexpected use, its own order the next one's.

A step that runs a prefix of the order (a forward only) is not off order and keeps it. On the
UNet the first step therefore loads ahead only until ``mid_block`` (a demand load), and every
step after it follows the learned call order with every load issued ahead; on a model that
calls its blocks in registration order no step is ever off order and the first step already
prefetches. The one cost over the window at 0: a block loaded ahead that an off-order step
never uses at all stays on the device past the step's end, until a use of the next step
releases it (a load the window at 0 would not make).

# NOTE [ Layer-order window ]
``enable_async_offloading`` changes when the offloaded blocks are copied, never which blocks are
on the device: every offloaded block is loaded and evicted once in forward and once in
backward (2 x the offloaded count per training step), as with the window at 0. The weight
runtime's window (NOTE [ Prefetch window ] in ``runtime/stagehand/weights/policy.py``) walks the blocks
ahead of the cursor, once around the order, and passes over blocks on the device that were not
loaded ahead: under the watermarks those are blocks kept for a later use. Under layer offload
an offloaded block on the device after its use is one the window at 0 evicts (the low
watermark is 0), and the walk kept it: the last forward block stayed for its backward, the
wrap-around reached the next step's first offloaded block and kept or loaded it across the step
end (a block that was used this step loaded ahead of the next and never evicted), so a block
asked to be offloaded stayed on the device (PixArt-size tiny models, 1 block of 3 offloaded: 1
load a step where the window at 0 makes 2, and no eviction). ``LayerOrderScheduler.ahead``
therefore walks this step's order only, from the cursor to its end, and stops at an offloaded
block still on the device from its use: its next use needs it loaded again, after the
eviction this use ends with, so no copy can be issued for it or past it yet. Between two steps
(no step open) nothing is ahead: the next step's first offloaded block is loaded when the step
begins, and counted in it. The device holds at most the block in use plus ``window`` blocks
loaded ahead (``LayerOffloadManager.on_device_max``). The order walked is the call order,
learned where it is not the registration order (NOTE [ Layer order ]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from stagehand.weights.policy import BlockLike
from stagehand.weights.scheduler import BlockScheduler


def resident_count(fraction: float, n_blocks: int) -> int:
    """Blocks kept resident for ``layer_offload_fraction = fraction`` (see NOTE [ Resident set ]).

    Raises:
        ValueError: ``fraction`` is not a number in [0, 1] (names the field) or ``n_blocks`` < 0.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"layer_offload_fraction must be a number in [0, 1], got {fraction!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"layer_offload_fraction must be in [0, 1], got {fraction!r}")
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    # The epsilon keeps 0.3 x 10 (2.9999999999999996 in binary) at 3 offloaded blocks.
    offloaded = min(n_blocks, math.floor(fraction * n_blocks + 1e-9))
    return n_blocks - offloaded


class LayerOrderScheduler(BlockScheduler):
    """``BlockScheduler`` whose order is layer order (forward, then reverse for a training
    step's backward) until a step's uses leave it, then the call order that step recorded (NOTE
    [ Layer order ]). Its window walks the open step's order only and stops at an offloaded block
    still on the device from its use (NOTE [ Layer-order window ]); in a step off order it
    issues no copy.

    Args:
        n_blocks: the blocks (``WeightRuntime.blocks``), in registration order.
        prefetch_window: blocks loaded ahead of their use at most (0: each when used).
        training: the order is forward then backward (else forward only).
        blocks: the blocks whose states the window reads (``on_device``, ``prefetched``,
            ``resident``): the weight runtime's, or a simulation's (``policy.BlockLike``);
            empty: every block is taken as not loaded and none as loaded ahead.
        step_open: ``step_open() -> bool``: a step is open (``StepBoundaries.open``); None:
            always.

    Raises:
        ValueError: ``blocks`` is given and does not hold ``n_blocks`` blocks.
    """

    def __init__(
        self,
        n_blocks: int,
        prefetch_window: int,
        training: bool,
        blocks: Sequence[BlockLike] = (),
        step_open: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(prefetch_window)
        if blocks and len(blocks) != n_blocks:
            raise ValueError(f"blocks: expected {n_blocks} blocks, got {len(blocks)}")
        forward = list(range(n_blocks))
        self.layer_order = forward + forward[::-1] if training else forward
        """The order assumed before any step ran (and after ``retrace``)."""
        self.order = list(self.layer_order)
        self.blocks = blocks
        self.step_open = step_open
        self.off_order = False
        """A use of the open step was not the next in the order (NOTE [ Layer order ])."""

    def record_use(self, index: int, recompute: bool = False) -> None:
        """A use of block ``index`` (``BlockScheduler.record_use``); one that is not the next
        position of the order (wrapping at its end) takes the step off order."""
        used, order = len(self.current), self.order
        expected = (self.pos + 1) % len(order) if order else -1
        super().record_use(index, recompute)
        if len(self.current) > used and (not order or order[expected] != index):
            self.off_order = True

    def ahead(self) -> Iterator[int]:
        """The distinct blocks after the cursor to the end of this step's order, soonest first,
        up to the first offloaded block on the device that was not loaded ahead (its next use
        is a reload); nothing while no step is open (NOTE [ Layer-order window ]). Off order:
        only the blocks loaded ahead and not used since, in block order (NOTE [ Layer order ])."""
        if self.step_open is not None and not self.step_open():
            return
        blocks = self.blocks
        if self.off_order:
            yield from (b.index for b in blocks if b.prefetched and b.on_device)
            return
        seen: set[int] = set()
        for index in self.order[self.pos + 1 :]:
            if index in seen:
                continue
            if blocks:
                block = blocks[index]
                if block.on_device and not block.prefetched and not block.resident:
                    return
            seen.add(index)
            yield index

    def end_step(self) -> bool:
        """Reset the cursor for the next step; a step that went off order makes its recorded
        uses the order (NOTE [ Layer order ]). Returns True when the order changed."""
        changed = self.off_order and bool(self.current) and self.current != self.order
        if changed:
            self.order = list(self.current)
            self.retraces += 1
        self.current = []
        self.pos = -1
        self.off_order = False
        return changed

    def retrace(self) -> None:
        """Forget the learned order: the next step assumes layer order again."""
        self.order, self.pos, self.current = list(self.layer_order), -1, []
        self.off_order = False
