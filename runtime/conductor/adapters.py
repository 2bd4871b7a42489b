"""Adapters: translate ``RuntimeLimitHints`` into a runtime's knobs, and undo it on detach.

Source: ``shared/seeds/conductor.md`` ("What Gets Tuned"). Knobs are plain attributes written on
the training thread, the same thread that reads them. On ``attach`` an adapter saves each
knob's value (the *original*: the user's setting) and sets ``runtime.conductor`` so the runtime
asks the Conductor for transfer slots; on ``detach`` it writes every original back and sets
``runtime.conductor = None``. Hints only ever lower a knob below its original.

====================  ==================================  ====================================
hint                  weight runtime (StagehandRuntime)    activation runtime (ActivationRuntime)
====================  ==================================  ====================================
max_inflight_h2d      ``transfer.max_inflight``            ``transfer.max_h2d`` (at least 1:
                                                           backward needs its restores)
max_inflight_d2h      --                                   ``transfer.max_d2h``
prefetch_window_cap   ``scheduler.prefetch_window``        --
suppress_speculative  ``scheduler.prefetch_window`` = 1    ``transfer.max_d2h`` = 0 in OPTIMIZER
====================  ==================================  ====================================
"""

from __future__ import annotations

from typing import Any

from runtime.common.phases import Phase
from runtime.conductor.policy import RuntimeLimitHints


def _owner(obj: Any, path: str) -> tuple[Any, str]:
    *parents, attr = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    return obj, attr


class ConductorAdapter:
    """Base adapter over the knobs ``KNOBS`` (name -> dotted attribute path on the runtime).

    Raises (on ``attach``):
        AttributeError: the runtime lacks a knob, naming the knob and the runtime's type.
        RuntimeError: attached twice.
    """

    name = "runtime"
    KNOBS: dict[str, str] = {}

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.originals: dict[str, Any] = {}
        self.conductor: Any = None
        self._phase: Phase | None = None
        self._hints: RuntimeLimitHints | None = None

    @property
    def attached(self) -> bool:
        return self.conductor is not None

    def get(self, knob: str) -> Any:
        obj, attr = _owner(self.runtime, self.KNOBS[knob])
        return getattr(obj, attr)

    def _set(self, knob: str, value: Any) -> None:
        obj, attr = _owner(self.runtime, self.KNOBS[knob])
        setattr(obj, attr, value)

    def attach(self, conductor: Any) -> None:
        """Save every knob's value and give the runtime the Conductor."""
        if self.attached:
            raise RuntimeError(f"{type(self).__name__} is already attached")
        originals = {}
        for knob, path in self.KNOBS.items():
            try:
                originals[knob] = self.get(knob)
            except AttributeError as e:
                raise AttributeError(
                    f"{type(self).__name__}: {type(self.runtime).__name__} has no knob "
                    f"runtime.{path} ({e})"
                ) from e
        self.originals = originals
        self.conductor = conductor
        self.runtime.conductor = conductor

    def detach(self) -> None:
        """Write every original back and take the Conductor away from the runtime."""
        if not self.attached:
            return
        for knob, value in self.originals.items():
            self._set(knob, value)
        self.runtime.conductor = None
        self.conductor = None
        self._phase = self._hints = None

    def set_original(self, knob: str, value: Any) -> None:
        """Change the user's setting of ``knob`` while attached (live limits), re-applying the
        current hints on top, so a later ``detach`` restores the new value.

        Raises:
            KeyError: ``knob`` is not one of this adapter's knobs.
        """
        if knob not in self.KNOBS:
            raise KeyError(f"{type(self).__name__} has no knob {knob!r}; knobs: {list(self.KNOBS)}")
        if not self.attached:
            self._set(knob, value)
            return
        self.originals[knob] = value
        if self._hints is not None:
            self.apply(self._phase, self._hints)
        else:
            self._set(knob, value)

    def on_phase(self, phase: Phase, hints: RuntimeLimitHints) -> None:
        """Called by the coordinator at each phase boundary (and on a Rule 3 tightening)."""
        self._phase, self._hints = phase, hints
        self.apply(phase, hints)

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        raise NotImplementedError

    def knobs(self) -> dict[str, Any]:
        """Every knob's current value."""
        return {knob: self.get(knob) for knob in self.KNOBS}

    def snapshot(self) -> dict[str, Any]:
        """The runtime's ``snapshot()`` (when it has one) with the current knob values."""
        snap = getattr(self.runtime, "snapshot", None)
        out = dict(snap()) if callable(snap) else {}
        out.update(self.knobs())
        return out


class StagehandConductorAdapter(ConductorAdapter):
    """Weight runtime: prefetch window and H2D block copies in flight."""

    name = "stagehand"
    KNOBS = {
        "prefetch_window": "scheduler.prefetch_window",
        "max_inflight": "transfer.max_inflight",
    }

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        window = min(self.originals["prefetch_window"], hints.prefetch_window_cap)
        if hints.suppress_speculative:
            window = min(window, 1)
        self._set("prefetch_window", window)
        # One copy must always be allowed: the block about to run has to arrive.
        self._set(
            "max_inflight", max(1, min(self.originals["max_inflight"], hints.max_inflight_h2d))
        )

    def base_prefetch_window(self) -> int:
        """The user's prefetch window: the policy's base cap at STEP_BEGIN."""
        return int(self.originals.get("prefetch_window", self.get("prefetch_window")))


class ActStagehandConductorAdapter(ConductorAdapter):
    """Activation runtime: spills (D2H) and restores (H2D) in flight."""

    name = "activation_stagehand"
    KNOBS = {"max_d2h": "transfer.max_d2h", "max_h2d": "transfer.max_h2d"}

    def apply(self, phase: Phase | None, hints: RuntimeLimitHints) -> None:
        d2h = min(self.originals["max_d2h"], hints.max_inflight_d2h)
        if hints.suppress_speculative and phase is Phase.OPTIMIZER:
            d2h = 0
        self._set("max_d2h", d2h)
        # Backward blocks on restores, so never fewer than one.
        self._set("max_h2d", max(1, min(self.originals["max_h2d"], hints.max_inflight_h2d)))
