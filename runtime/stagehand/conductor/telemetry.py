"""Conductor telemetry: the seed's per-step record and the debug event trace.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Telemetry"). Records go through the run's one
``Telemetry`` stream as ``conductor/step`` (every ``telemetry_interval_steps`` steps) and, when
``debug_event_trace`` is on, ``conductor/event`` with ``event`` one of ``phase``, ``hints``,
``reserve``, ``release``, ``slot_acquire``, ``slot_denied``, ``slot_release``.
"""

from __future__ import annotations

from typing import Any

from stagehand.common.telemetry import Telemetry, default_telemetry
from stagehand.config.memory import ConductorConfig

SOURCE = "conductor"

STEP_FIELDS = (
    "step_id",
    "vram_allocated_mb",
    "vram_headroom_mb",
    "pinned_granted_mb",
    "h2d_inflight",
    "d2h_inflight",
    "grant_count",
    "deny_count",
    "partial_count",
    "phase_durations",
    "runtime_snapshots",
)
"""The seed's record fields, in its order."""


class ConductorTelemetry:
    """Writes conductor records to ``telemetry``; None: JSONL to ``config.telemetry_file`` (the
    seed's ``conductor_telemetry.jsonl``), closed by ``close``."""

    def __init__(self, config: ConductorConfig, telemetry: Telemetry | None = None) -> None:
        self._owned = telemetry is None
        self.telemetry = (
            telemetry if telemetry is not None else default_telemetry(config.telemetry_file)
        )
        self.interval = config.telemetry_interval_steps
        self.trace = config.debug_event_trace

    def event(self, event: str, fields: dict[str, Any]) -> None:
        """One debug event; nothing when ``debug_event_trace`` is off."""
        if self.trace:
            self.telemetry.emit(SOURCE, "event", event=event, **fields)

    def close(self) -> None:
        """Closes the stream if it is this hub's own (not the run's)."""
        if self._owned:
            self.telemetry.close()

    def due(self, step_id: int) -> bool:
        """Whether step ``step_id`` gets a step record (every ``telemetry_interval_steps``)."""
        return step_id % self.interval == 0

    def step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one ``conductor/step`` record (the seed's fields first) and return it.

        Raises:
            KeyError: a seed field is missing from ``record``.
        """
        ordered = {name: record[name] for name in STEP_FIELDS}
        ordered.update({k: v for k, v in record.items() if k not in ordered})
        return self.telemetry.emit(SOURCE, "step", **ordered)
