"""Phases of a training step, as the Conductor broadcasts them (``shared/seeds/conductor.md``).

One step goes STEP_BEGIN -> FORWARD -> BACKWARD -> OPTIMIZER -> STEP_END; inference steps skip
BACKWARD and OPTIMIZER. Illegal orders raise ``PhaseError`` naming the phases expected and found.
"""

from __future__ import annotations

import enum


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
        raise PhaseError(f"illegal phase order: after {found} expected {expected}, got {new.name}")
