"""What a live limits change did: the memory figures of the step before it and of the steady
state after it, as one ``trainer/limits_effect`` record per request (``docs/contracts.md``).

A change applies at the next step begin (``strategy/limits_applied``). A watermark change makes
that step a trace step (NOTE [ Live watermarks ] in ``runtime/stagehand/weights/policy.py``) and the
schedule settles a step or two later, so the effect is read once two steps after the change step
give the same figures (resident blocks at the step's end, H2D bytes of block weights, bytes
spilled): those steps are the steady state a run started with the limits reaches. A watch that
has not settled after ``MAX_WATCH_STEPS``, or that a later request replaces, is written as it
stands with ``settled: false``; a run that ends first writes none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stagehand.config.memory import MB

MAX_WATCH_STEPS = 8
"""Steps after the change step a watch waits for two equal steps (a GPU's timing may keep the
figures moving: the record then says they did not settle)."""

KIND = ("trainer", "limits_effect")
"""The record's ``(source, kind)``: only the dashboard reads it, so it is named here."""


@dataclass(frozen=True)
class StepFigures:
    """One training step's memory figures (the strategy's counters after the step)."""

    resident_blocks: int
    h2d_bytes: int
    spill_bytes: int
    vram_peak_mb: float

    @classmethod
    def of(cls, strategy: Any) -> StepFigures:
        """The figures of the step ``strategy`` (a ``MemoryStrategy``) closed last."""
        counters = strategy.counters()
        return cls(
            counters["resident_blocks"],
            counters["h2d_bytes"],
            counters["spill_bytes"],
            float(strategy.snapshot()["vram_peak_mb"]),
        )

    def steady_key(self) -> tuple[int, int, int]:
        """What must repeat for the schedule to be steady (the peak follows from it)."""
        return self.resident_blocks, self.h2d_bytes, self.spill_bytes


@dataclass
class _Watch:
    request_ids: list[str | None]
    before: StepFigures | None
    applied_step: int | None = None
    steps: list[StepFigures] = field(default_factory=list)
    """Figures of the steps after the change step, in order."""


class LimitsEffects:
    """Watches each forwarded limits request until its effect settles; ``emit(*KIND,
    **fields)`` writes the record (``Telemetry.emit``)."""

    def __init__(self, emit: Any) -> None:
        self.emit = emit
        self.last: StepFigures | None = None
        """The figures of the last training step."""
        self.watch: _Watch | None = None

    def forwarded(self, request_id: str | None) -> None:
        """``request_id`` went to the strategy: it applies at the next step begin. Requests
        forwarded between the same two steps share one watch; a watch still open is written
        unsettled."""
        watch = self.watch
        if watch is not None and watch.applied_step is None:
            watch.request_ids.append(request_id)
            return
        if watch is not None:
            self._write(watch, settled=False)
        self.watch = _Watch([request_id], self.last)

    def step_done(self, step: int, figures: StepFigures) -> None:
        """Training step ``step`` ended with ``figures``."""
        self.last = figures
        watch = self.watch
        if watch is None:
            return
        if watch.applied_step is None:
            watch.applied_step = step  # the change step: a trace step, not steady
            return
        watch.steps.append(figures)
        steady = len(watch.steps) >= 2 and (
            watch.steps[-1].steady_key() == watch.steps[-2].steady_key()
        )
        if steady or len(watch.steps) >= MAX_WATCH_STEPS:
            self._write(watch, settled=steady)
            self.watch = None

    def _write(self, watch: _Watch, settled: bool) -> None:
        after = watch.steps[-1] if watch.steps else None
        before = watch.before

        def pair(read):
            return [read(before) if before else None, read(after) if after else None]

        fields = {
            "applied_step": watch.applied_step,
            "settled": settled,
            "steps_watched": len(watch.steps),
            "resident_blocks": pair(lambda f: f.resident_blocks),
            "h2d_mb": pair(lambda f: f.h2d_bytes / MB),
            "spill_mb": pair(lambda f: f.spill_bytes / MB),
            "vram_peak_mb": pair(lambda f: f.vram_peak_mb),
        }
        for request_id in watch.request_ids:
            self.emit(*KIND, request_id=request_id, **fields)
