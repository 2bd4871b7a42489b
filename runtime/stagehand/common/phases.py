"""Phases of a training step, as the Conductor broadcasts them ("Conductor: Resource Arbitration Across Memory Runtimes").

One step goes STEP_BEGIN -> FORWARD -> BACKWARD -> OPTIMIZER -> STEP_END; inference steps skip
BACKWARD and OPTIMIZER. Illegal orders raise ``PhaseError`` naming the phases expected and found.
"""

from __future__ import annotations

import enum
import time


class Phase(enum.Enum):
    STEP_BEGIN = "step_begin"
    """Entered by ``begin_step``; limits changed between steps apply here."""
    FORWARD = "forward"
    """Entered when the model's forward starts."""
    BACKWARD = "backward"
    """Entered when ``loss.backward()`` starts."""
    OPTIMIZER = "optimizer"
    """Entered around ``optimizer.step()``."""
    STEP_END = "step_end"
    """Entered by ``end_step``; step records are written here."""


LEGAL_NEXT: dict[Phase | None, frozenset[Phase]] = {
    None: frozenset({Phase.STEP_BEGIN}),
    Phase.STEP_BEGIN: frozenset({Phase.FORWARD, Phase.STEP_END}),
    Phase.FORWARD: frozenset({Phase.BACKWARD, Phase.STEP_END}),
    Phase.BACKWARD: frozenset({Phase.OPTIMIZER, Phase.STEP_END}),
    Phase.OPTIMIZER: frozenset({Phase.STEP_END}),
    Phase.STEP_END: frozenset({Phase.STEP_BEGIN}),
}


class PhaseError(RuntimeError):
    """A phase was entered out of order."""


def check_transition(current: Phase | None, new: Phase) -> None:
    """Raise ``PhaseError`` unless ``current -> new`` is legal."""
    if new not in LEGAL_NEXT[current]:
        expected = " or ".join(sorted(p.name for p in LEGAL_NEXT[current]))
        found = current.name if current else "no phase"
        hint = ""
        if new in (Phase.FORWARD, Phase.OPTIMIZER) and current in (Phase.BACKWARD, Phase.OPTIMIZER):
            hint = (
                " (one forward, backward and optimizer phase per step: for gradient accumulation"
                " run each micro-batch in a step of its own and enter the optimizer phase in the"
                " last one only, gradients add up across steps; step every optimizer inside one"
                " optimizer phase)"
            )
        raise PhaseError(
            f"illegal phase order: after {found} expected {expected}, got {new.name}{hint}"
        )


class PhaseMachine:
    """The step's phase, its legal order and the milliseconds spent in each phase: the one
    phase machine of the strategy (``MemoryStrategy``) and the Conductor (``PhaseCoordinator``),
    which also runs on its own.

    ``advance(new)`` enters ``new`` (``PhaseError`` naming the phases expected and found, before
    anything changes); a phase's time runs from its entry to the next entry, or to ``leave()``
    (the strategy's phases end with their context, before the next begins). ``durations_ms``
    maps a phase's value (``"forward"``...) to its milliseconds in the current step; STEP_BEGIN
    starts a new step (``step_started``, a ``time.perf_counter()`` value).
    """

    def __init__(self) -> None:
        self.phase: Phase | None = None
        self.durations_ms: dict[str, float] = {}
        self.step_started = 0.0
        self._entered: float | None = None

    def advance(self, new: Phase) -> Phase | None:
        """Enter ``new``; return the phase left (None before the first step).

        Raises:
            PhaseError: ``new`` may not follow the current phase.
        """
        check_transition(self.phase, new)
        now = time.perf_counter()
        old = self.phase
        self._stop(now)
        if new is Phase.STEP_BEGIN:
            self.durations_ms = {}
            self.step_started = now
        self.phase, self._entered = new, now
        return old

    def leave(self) -> None:
        """Stop the current phase's time (the phase stays current until the next ``advance``)."""
        self._stop(time.perf_counter())

    def _stop(self, now: float) -> None:
        if self._entered is not None and self.phase is not None:
            key = self.phase.value
            self.durations_ms[key] = self.durations_ms.get(key, 0.0) + (now - self._entered) * 1e3
        self._entered = None
