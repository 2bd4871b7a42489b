"""PhaseCoordinator: the Conductor's phase machine and the adapter broadcast.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Phase Broadcasting"). Phases and their legal order are
``stagehand.common.phases``; an illegal order raises ``PhaseError`` naming the phase expected and
the phase found, before anything changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from stagehand.common.phases import Phase, PhaseMachine

if TYPE_CHECKING:
    from stagehand.conductor.policy import RuntimeLimitHints


class PhaseListener(Protocol):
    """What the coordinator broadcasts to (the adapters)."""

    def on_phase(self, phase: Phase, hints: RuntimeLimitHints) -> None: ...


class PhaseCoordinator:
    """The Conductor's ``PhaseMachine`` (a phase lasts from its entry to the entry of the next
    one) and the broadcast of the phase and hints to the adapters."""

    def __init__(self) -> None:
        self.machine = PhaseMachine()
        self.adapters: list[PhaseListener] = []

    @property
    def phase(self) -> Phase | None:
        return self.machine.phase

    @property
    def durations_ms(self) -> dict[str, float]:
        """Milliseconds spent in each phase of the current step (``PhaseMachine``)."""
        return self.machine.durations_ms

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
        return self.machine.advance(new)

    def broadcast(self, hints: RuntimeLimitHints) -> None:
        """Tell every adapter the current phase and hints, in registration order."""
        for adapter in self.adapters:
            adapter.on_phase(self.phase, hints)  # type: ignore[arg-type]
