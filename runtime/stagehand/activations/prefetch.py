"""Predictive restore: the order backward will ask for spilled tensors, and a window ahead of it.

A purely reactive scheduler reloads a tensor only when backward asks for it, so backward waits
on every copy (Activation Stagehand's v0 limit: "no predictive prefetch using backward
execution order"). This one reloads ahead: Megatron-Core's fine-grained activation offloading
reloads the next group when one group's backward finishes (its API reference: ``bulk_reload``,
``pre_reload_last_layer``), applied here per tensor:

- the first step has no trace, so the plan is *reverse pack order* (backward consumes saved
  tensors roughly last-saved first);
- every step records the order in which spilled tensors were first unpacked, by their pack
  index (``seq``); the next step, when it saved the same number of tensors (same graph), plans
  in that traced order, and appends spilled tensors the trace does not know in reverse pack
  order;
- when backward starts (``begin``) the first ``restore_ahead`` tensors of the plan are restored,
  and each unpack restores the next ``restore_ahead`` after the one consumed, on the H2D stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagehand.activations.registry import ActivationRecord


class RestorePlanner:
    """Predicted backward order of the step's spilled records, with the trace it learns from."""

    def __init__(self) -> None:
        self._trace: list[int] = []
        self._trace_packs = -1
        self._now: list[int] = []
        self.plan: list[ActivationRecord] = []
        self.active = False
        """True from the start of backward (first unpack or ``begin``) to the end of the step."""
        self.traced = False
        """Whether the current plan follows a trace (False: reverse pack order)."""

    def build(self, spilled: list[ActivationRecord], packs: int) -> list[ActivationRecord]:
        """Plan the order of ``spilled`` (in pack order) for a step that saw ``packs`` tensors."""
        self.active = True
        by_seq = {r.seq: r for r in spilled}
        plan: list[ActivationRecord] = []
        self.traced = bool(self._trace) and self._trace_packs == packs
        if self.traced:
            for seq in self._trace:
                record = by_seq.pop(seq, None)
                if record is not None:
                    plan.append(record)
        plan.extend(r for r in reversed(spilled) if r.seq in by_seq)
        for pos, record in enumerate(plan):
            record.plan_pos = pos
        self.plan = plan
        return plan

    def observe(self, record: ActivationRecord) -> None:
        """Note the first unpack of ``record`` (the trace of this step)."""
        self._now.append(record.seq)

    def ahead(self, pos: int, count: int) -> list[ActivationRecord]:
        """The ``count`` records planned after position ``pos`` (-1: from the start)."""
        return self.plan[pos + 1 : pos + 1 + count]

    def forget(self) -> None:
        """Drop the kept trace (an aborted step's backward order is partial: NOTE [ Aborted
        step ] in ``runtime/stagehand/weights/abort.py``); the next step restores without a plan."""
        self._trace, self._trace_packs = [], -1
        self._now, self.plan, self.active = [], [], False

    def end_step(self, packs: int) -> None:
        """Keep this step's trace for the next one, if backward consumed anything."""
        if self._now:
            self._trace, self._trace_packs = self._now, packs
        self._now = []
        self.plan = []
        self.active = False
