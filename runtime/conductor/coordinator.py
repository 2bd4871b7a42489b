"""PhaseCoordinator: the step's phase, its legal order, phase timing and the adapter broadcast.

Source: ``shared/seeds/conductor.md`` ("Phase Broadcasting"). Phases and their legal order are
``runtime.common.phases``; an illegal order raises ``PhaseError`` naming the phase expected and
the phase found, before anything changes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from runtime.common.phases import Phase, check_transition

if TYPE_CHECKING:
    from runtime.conductor.policy import RuntimeLimitHints


class PhaseListener(Protocol):
    """What the coordinator broadcasts to (the adapters)."""

    def on_phase(self, phase: Phase, hints: RuntimeLimitHints) -> None: ...


class PhaseCoordinator:
    """Holds the current phase, times each phase (seconds) and broadcasts to adapters.

    ``durations`` maps phase value (``"forward"``...) to seconds spent in it in the current
    step; a phase lasts from its entry to the entry of the next one.
    """

    def __init__(self) -> None:
        self.phase: Phase | None = None
        self.adapters: list[PhaseListener] = []
        self.durations: dict[str, float] = {}
        self._entered = 0.0

    def register(self, adapter: PhaseListener) -> None:
        if adapter not in self.adapters:
            self.adapters.append(adapter)

    def unregister(self, adapter: PhaseListener) -> None:
        if adapter in self.adapters:
            self.adapters.remove(adapter)

    def advance(self, new: Phase) -> Phase | None:
        """Enter ``new``; return the phase left (None before the first step).

        Raises:
            PhaseError: ``new`` may not follow the current phase.
        """
        check_transition(self.phase, new)
        now = time.perf_counter()
        old = self.phase
        if new is Phase.STEP_BEGIN:
            self.durations = {}
        elif old is not None:
            self.durations[old.value] = self.durations.get(old.value, 0.0) + now - self._entered
        self.phase, self._entered = new, now
        return old

    def broadcast(self, hints: RuntimeLimitHints) -> None:
        """Tell every adapter the current phase and hints, in registration order."""
        for adapter in self.adapters:
            adapter.on_phase(self.phase, hints)  # type: ignore[arg-type]
