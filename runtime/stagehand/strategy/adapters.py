"""Adapters: translate ``RuntimeLimitHints`` into caps a runtime applies to its own knobs.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("What Gets Tuned"). The Conductor never writes a
runtime's settings: an adapter publishes caps, and the runtime uses the smaller of its user's
setting and the cap where it reads it. A live change of a setting therefore needs no adapter and
survives any cap; ``detach`` clears the caps. On ``attach`` the adapter sets
``stagehand.conductor`` so the runtime asks the Conductor for transfer slots. Caps are written on
the training thread, the thread that reads them.

====================  ===================================  ===================================
hint                  weight runtime (WeightRuntime)     activation runtime (ActivationRuntime)
====================  ===================================  ===================================
max_inflight_h2d      ``transfer.inflight_cap`` (>= 1)      H2D cap (>= 1: backward needs its
                                                            restores)
max_inflight_d2h      --                                    D2H cap
prefetch_window_cap   ``scheduler.window_cap``              --
suppress_speculative  ``scheduler.window_cap`` <= 1         D2H cap 0 in OPTIMIZER
====================  ===================================  ===================================

# NOTE [ Reclaiming finished copies ]
A runtime holds a transfer slot per copy and gives it back when it *notices* the copy finished
(the weight runtime in ``TransferEngine.retire``, the activation runtime in its ``poll``). The
weight runtime notices only when it loads again, and it asks the Conductor for a slot *before*
it loads: slots of copies that ended long ago still looked held, so every prefetch was denied
(H2D_SLOTS_EXHAUSTED) until a demand load (a prefetch miss) happened to retire them, and the
run of "full" checks fired Rule 3, shrinking the window further. At FLUX.1-dev size on an H100
that was 95 denials and 37 prefetch misses per step at 3 GB used under a 22,000 MB soft cap;
a CPU run with copies slower than compute shows it too (tests/runtime/conductor/
test_room.py). So before a slot request is judged against a pool that looks full, the
Conductor asks every adapter to ``reclaim`` the direction: each runtime retires the copies the
device finished (never blocking), and only slots of copies still in flight count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagehand.common.phases import Phase
from stagehand.conductor.adapter import ConductorAdapter
from stagehand.conductor.policy import RuntimeLimitHints

if TYPE_CHECKING:
    from stagehand.activations import ActivationRuntime
    from stagehand.weights import WeightRuntime


class StagehandConductorAdapter(ConductorAdapter):
    """Weight runtime: prefetch window and H2D block copies in flight."""

    name = "stagehand"
    runtime: WeightRuntime

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

    def reclaim(self, direction: str) -> None:
        if direction == "h2d":
            self.runtime.transfer.retire()  # releases each finished copy's grant

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

    def reclaim(self, direction: str) -> None:
        if direction == "d2h":  # spills hold D2H slots; restores ask for none
            self.runtime.table.poll()  # finished spills give their slots back
