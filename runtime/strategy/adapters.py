"""Adapters: translate ``RuntimeLimitHints`` into caps a runtime applies to its own knobs.

Source: ``shared/seeds/conductor.md`` ("What Gets Tuned"). The Conductor never writes a
runtime's settings: an adapter publishes caps, and the runtime uses the smaller of its user's
setting and the cap where it reads it. A live change of a setting therefore needs no adapter and
survives any cap; ``detach`` clears the caps. On ``attach`` the adapter sets
``runtime.conductor`` so the runtime asks the Conductor for transfer slots. Caps are written on
the training thread, the thread that reads them.

====================  ===================================  ===================================
hint                  weight runtime (StagehandRuntime)     activation runtime (ActivationRuntime)
====================  ===================================  ===================================
max_inflight_h2d      ``transfer.inflight_cap`` (>= 1)      H2D cap (>= 1: backward needs its
                                                            restores)
max_inflight_d2h      --                                    D2H cap
prefetch_window_cap   ``scheduler.window_cap``              --
suppress_speculative  ``scheduler.window_cap`` <= 1         D2H cap 0 in OPTIMIZER
====================  ===================================  ===================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.common.phases import Phase
from runtime.conductor.adapter import ConductorAdapter
from runtime.conductor.policy import RuntimeLimitHints

if TYPE_CHECKING:
    from runtime.activations import ActivationRuntime
    from runtime.weights import StagehandRuntime


class StagehandConductorAdapter(ConductorAdapter):
    """Weight runtime: prefetch window and H2D block copies in flight."""

    name = "stagehand"
    runtime: StagehandRuntime

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        window = hints.prefetch_window_cap
        if hints.suppress_speculative:
            window = min(window, 1)
        self.runtime.scheduler.window_cap = window
        # One copy must always be allowed: the block about to run has to arrive.
        self.runtime.transfer.inflight_cap = max(1, hints.max_inflight_h2d)

    def clear(self) -> None:
        self.runtime.scheduler.window_cap = None
        self.runtime.transfer.inflight_cap = None

    def base_prefetch_window(self) -> int:
        """The user's prefetch window: the policy's base cap at STEP_BEGIN."""
        return int(self.runtime.scheduler.prefetch_window)


class ActStagehandConductorAdapter(ConductorAdapter):
    """Activation runtime: spills (D2H) and restores (H2D) in flight."""

    name = "activation_stagehand"
    runtime: ActivationRuntime

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        d2h = hints.max_inflight_d2h
        if hints.suppress_speculative and phase is Phase.OPTIMIZER:
            d2h = 0
        # Backward blocks on restores, so never fewer than one.
        self.runtime.transfer.set_caps(d2h, max(1, hints.max_inflight_h2d))

    def clear(self) -> None:
        self.runtime.transfer.set_caps(None, None)
