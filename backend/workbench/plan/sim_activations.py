"""The activation side of the planner's simulation (``backend/workbench/plan/simulate.py``): the device bytes a
step's saved tensors add, kept or spilled, counted as the activation runtime counts them.

# NOTE [ Tracked activations in the plan ]
On a CPU device there is no allocator to read: the activation runtime counts the tensors it
keeps in the strategy's shared ``DeviceMemory`` itself (NOTE [ Tracking kept tensors ] in
``runtime/stagehand/activations/hooks.py``), each storage once, and reports them in batches of at least
``PUBLISH_BYTES`` (``runtime/stagehand/activations/runtime.py``): a storage released adds to the batch
with a minus sign, a restore reports the batch before it is tracked, the step's end reports the
rest. The weight runtime's watermark decisions read ``DeviceMemory``, so they see kept
activations up to a batch late; the spill decision adds the unreported bytes. On a tracked
device the simulation counts the same way (``Activations.pending``), tensor by tensor, and
releases a segment's tensors last saved first, as backward frees them (a checkpointed block's
inputs too: ``encoder_hidden_states`` before ``hidden_states``). On CUDA the allocator sees
every tensor at once: nothing is pending.

Counted at once instead, the tiny FLUX.1-dev preset row (``workbench bench --model flux-dev
--size tiny --device cpu --card-gb 24 --only preset``) saw 7.764 MB at the release after the
forward's last single block but one, over its low watermark (7.740 MB), where the run read
7.697 MB: the plan evicted a double block backward needs first and loaded it again, 42 loads
and 7,827,456 B a step against the run's 41 and 7,522,304.
"""

from __future__ import annotations

from typing import Any

from stagehand.activations.budget import ActivationBudgetManager
from stagehand.activations.runtime import PUBLISH_BYTES


class Activations:
    """Saved tensors of one simulated step on ``sim``'s device (the module docstring).

    ``sim`` is the ``Simulation``: its ``mem`` (the ``DeviceMemory`` face the budget reads),
    ``now`` (ms), ``result`` and ``_add(nbytes, label)`` (device bytes, curve and peak).
    ``act``: the activation runtime's ``ActivationStagehandConfig`` (None when it is off: every
    tensor is kept, counted at once). ``tracked``: a CPU device, whose kept bytes are reported
    in batches."""

    def __init__(self, sim: Any, act: Any, tracked: bool) -> None:
        self.sim, self.act = sim, act
        self.batched = tracked and act is not None
        self.budget = None
        if act is not None:
            self.budget = ActivationBudgetManager(
                sim.mem, act.vram_high_watermark_mb, act.vram_low_watermark_mb
            )
        self.kept: dict[Any, list[int]] = {}  # segment -> kept tensors' bytes, in save order
        self.restored: dict[Any, int] = {}  # segment -> restored bytes on the device
        self.spilled: dict[Any, list[int]] = {}  # segment -> sizes on the host
        self.pending = 0
        """Kept bytes counted and not yet reported (signed; the runtime's ``_unpublished``)."""

    def begin_step(self) -> None:
        if self.budget is not None:
            self.budget.reset()

    def end_step(self) -> None:
        """The runtime's ``end_step``: what is still counted is released and reported."""
        for segment in list(self.kept):
            self.free(segment)
        self._publish()

    # -- the accounting -----------------------------------------------------------------------
    def _count(self, sizes: list[int], sign: int, label: str) -> None:
        """Kept tensors of ``sizes`` counted (``sign`` 1) or released (-1): at once, as one
        change, or one by one into the pending batch (the module docstring)."""
        if not self.batched:
            if sizes:
                self.sim._add(sign * sum(sizes), label)
            return
        for nbytes in sizes:
            self.pending += sign * nbytes
            if abs(self.pending) >= PUBLISH_BYTES:
                self._publish()

    def _publish(self) -> None:
        pending, self.pending = self.pending, 0
        if pending:
            self.sim._add(pending, "publish activations")

    # -- the step's moments ---------------------------------------------------------------------
    def save(self, segment: Any, sizes: list[int]) -> None:
        """Tensors of ``sizes`` bytes saved for backward in ``segment``: each kept or spilled by
        the budget's decision (``ActivationBudgetManager.pressure``, hysteresis included), which
        reads usage with the kept bytes not yet in it."""
        kept: list[int] = []
        spilled: list[int] = []
        for nbytes in sizes:
            unread = self.pending if self.batched else sum(kept)
            if (
                self.budget is not None
                and self.budget.pressure(nbytes, unread)
                and nbytes >= self.act.min_spill_bytes
            ):
                spilled.append(nbytes)
                continue
            kept.append(nbytes)
            if self.batched:
                self._count([nbytes], 1, "")
        if not self.batched:
            self._count(kept, 1, f"save {segment}")
        self.kept[segment] = self.kept.get(segment, []) + kept
        self.spilled[segment] = self.spilled.get(segment, []) + spilled
        self.sim.result.spilled_bytes += sum(spilled)
        self._spill_time(spilled)

    def _spill_time(self, sizes: list[int]) -> None:
        # A CPU device copies on the host, in line: each spill (and later its restore) is a
        # copy through the pool plus a few operations' bookkeeping. On a GPU the copies run on
        # the side streams under the transfer caps and are not modelled (``backend/workbench/plan/simulate.py``).
        p = self.sim.profile
        if p.synchronous_copies and sizes:
            ms = sum(sizes) / (p.h2d_gbps * 1e9) * 1e3 + len(sizes) * 4 * p.op_us * 1e-3
            self.sim.now += ms
            self.sim.result.spill_ms += ms

    def restore(self, segment: Any) -> None:
        """Backward restores ``segment``'s spilled tensors in reverse pack order, each freed once
        used: at most the one in use plus ``restore_ahead`` (predictive) are on the device. A
        restore reports the pending batch first, then is tracked at once (``SpillTable``)."""
        sizes = self.spilled.pop(segment, [])[::-1]
        self._spill_time(sizes)
        k = 1 + (self.act.restore_ahead if self.act.predictive_restore else 0) if sizes else 0
        window = max((sum(sizes[i : i + k]) for i in range(len(sizes))), default=0)
        if window:
            self._publish()
            self.restored[segment] = window
            self.sim._add(window, f"restore {segment}")

    def free(self, segment: Any) -> None:
        """``segment``'s tensors released by backward, last saved first."""
        self._count(self.kept.pop(segment, [])[::-1], -1, f"free {segment}")
        restored = self.restored.pop(segment, 0)
        if restored:
            self.sim._add(-restored, f"free {segment}")
