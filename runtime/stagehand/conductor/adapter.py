"""The base of the Conductor's adapters: what the Conductor registers and broadcasts phases and
hints to. The adapters of the weight and activation runtimes (``stagehand.strategy.adapters``)
sit with the strategy that composes those runtimes: the Conductor sits beside the runtimes and
imports none of them.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("What Gets Tuned").
"""

from __future__ import annotations

from typing import Any

from stagehand.common.phases import Phase
from stagehand.conductor.policy import RuntimeLimitHints


class ConductorAdapter:
    """Base adapter: attach/detach, the phase broadcast, and the runtime's snapshot.

    Raises (on ``attach``): ``RuntimeError`` when attached twice.
    """

    name = "runtime"

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.conductor: Any = None

    @property
    def attached(self) -> bool:
        return self.conductor is not None

    def attach(self, conductor: Any) -> None:
        """Give the runtime the Conductor (it asks it for transfer slots)."""
        if self.attached:
            raise RuntimeError(f"{type(self).__name__} is already attached")
        self.conductor = conductor
        self.runtime.conductor = conductor

    def detach(self) -> None:
        """Clear the caps and take the Conductor away from the runtime."""
        if not self.attached:
            return
        self.clear()
        self.runtime.conductor = None
        self.conductor = None

    def on_phase(self, phase: Phase, hints: RuntimeLimitHints) -> None:
        """Called by the coordinator at each phase boundary (and on a Rule 3 tightening)."""
        self.apply(phase, hints)

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        """Publish the caps ``hints`` mean in ``phase``."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every cap."""
        raise NotImplementedError

    def reclaim(self, direction: str) -> None:
        """Hand back the slots of ``direction`` copies the device already finished (never
        blocks; NOTE [ Reclaiming finished copies ], ``stagehand.strategy.adapters``). The base
        adapter holds none."""

    def snapshot(self) -> dict[str, Any]:
        """The runtime's ``snapshot()``: its knobs in force."""
        return dict(self.runtime.snapshot())

    def base_prefetch_window(self) -> int | None:
        """The user's prefetch window, the policy's base cap at STEP_BEGIN; None: the runtime has
        none (only the weight runtime streams blocks ahead)."""
        return None
