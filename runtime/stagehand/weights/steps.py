"""The weight runtime's step boundaries on the phase vocabulary (``StepBoundaries``).

# NOTE [ Step boundaries ]
The runtime's steps are the phases of ``runtime/stagehand/common/phases.py``, in one ``PhaseMachine``:
``begin_step`` enters STEP_BEGIN and ``end_step`` STEP_END; a block's forward enters FORWARD and
the begin of a block's backward BACKWARD (OPTIMIZER is the strategy's alone: nothing here moves
then). A composed strategy calls ``begin_step`` and ``end_step``. Without them one rule applies:
a block's forward begins the next step when no step is open, or when the open step was not
begun by ``begin_step`` and its forward is over: its backward began, or, forward only
(inference mode or gradients off), its first block runs again. A step begun by ``begin_step``
lasts until ``end_step``: a second forward inside it (gradient accumulation) is part of it and
leaves the phase at BACKWARD. A backward run when no step is open enters no phase.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stagehand.common.phases import Phase, PhaseMachine

# Read at every block use: a module name costs a few ns, an enum attribute ~50 ns (Python 3.11).
_STEP_BEGIN, _FORWARD, _BACKWARD = Phase.STEP_BEGIN, Phase.FORWARD, Phase.BACKWARD
OPEN = (Phase.STEP_BEGIN, Phase.FORWARD, Phase.BACKWARD)
"""The phases of an open step."""


class StepBoundaries:
    """The step and its phase (see the NOTE). ``begin(step)`` and ``end()`` are the runtime's:
    a step it detects (no ``begin_step``) is opened and closed through them, and they call
    ``enter_step`` / ``leave_step`` here as ``begin_step`` and ``end_step`` do.

    ``inference``: the runtime's mode is inference (every forward is forward only).
    """

    def __init__(
        self, *, inference: bool, begin: Callable[[int], None], end: Callable[[], None]
    ) -> None:
        self.phases = PhaseMachine()
        self.step: int | None = None
        """The open (or last) step's number."""
        self.explicit = False
        """The open step was begun by ``begin_step``."""
        self.first_block: int | None = None
        """The open step's first block in forward."""
        self.inference = inference
        self._begin, self._end = begin, end

    @property
    def open(self) -> bool:
        return self.phases.phase in OPEN

    def enter_step(self, step: int, explicit: bool) -> None:
        """STEP_BEGIN of ``step`` (``PhaseError`` while a step is open)."""
        self.phases.advance(Phase.STEP_BEGIN)
        self.step, self.explicit, self.first_block = step, explicit, None

    def leave_step(self) -> None:
        """STEP_END (``PhaseError`` when no step is open)."""
        self.phases.advance(Phase.STEP_END)

    def forward(self, index: int) -> None:
        """Block ``index``'s forward use begins: enter FORWARD, first closing the open step and
        beginning the next where the rule says."""
        phase = self.phases.phase
        if phase is _FORWARD or phase is _BACKWARD:
            if self.explicit:
                return
            again = index == self.first_block and (self.inference or not torch.is_grad_enabled())
            if phase is _FORWARD and not again:
                return
            self._end()
        if self.phases.phase is not _STEP_BEGIN:  # no step open
            self._begin(0 if self.step is None else self.step + 1)
        self.phases.advance(Phase.FORWARD)
        self.first_block = index

    def backward(self) -> None:
        """A block's backward begins: enter BACKWARD; from STEP_BEGIN through FORWARD (the
        backward of a forward run before ``begin_step`` is this step's)."""
        phase = self.phases.phase
        if phase is _STEP_BEGIN:
            self.phases.advance(Phase.FORWARD)
        if phase is _STEP_BEGIN or phase is _FORWARD:
            self.phases.advance(Phase.BACKWARD)
