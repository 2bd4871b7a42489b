"""The telemetry records the backend reads from a worker's stream, named once for both sides.

Torch-free (the backend imports it, as it imports ``contract.status``). Each is a
``(source, kind)`` pair: the worker emits ``telemetry.emit(*RUN_FINISHED, ...)`` and the
backend looks one up with ``store.last_record(run_id, *RUN_FINISHED)``. Their fields are in
``docs/contracts.md``; records only the dashboard reads keep their names at the emitter.
"""

from __future__ import annotations

from typing import NamedTuple


class Record(NamedTuple):
    """A telemetry record's ``source`` and ``kind``."""

    source: str
    kind: str


RUN_STARTED = Record("trainer", "run_started")
"""The resolved config and the run's identity (calibration plans its config)."""
RESUMED = Record("trainer", "resumed")
"""A resumed worker has loaded ``checkpoint`` and trains the steps after its ``step`` again:
the step records of higher steps written before it are of the discarded run, and each step is
drawn once, from its newest records (charts and Compare's series)."""
RUN_FINISHED = Record("trainer", "run_finished")
"""How the run ended (``status``); the supervisor's exit rules read it."""
OOM_RECOVERY = Record("trainer", "oom_recovery")
"""One per out-of-memory recovery: the step that failed (``phase``, ``attempt``, device bytes at
the failure and the card's), the limits before and after; the rerun's ``limits_applied`` record
has ``request_id`` ``OOM_REQUEST``. The summary counts them, later plans learn from them."""
OOM_REQUEST = "oom"
"""The ``request_id`` of the ``strategy/limits_applied`` record of a recovery's lowered limits."""
LIMITS_APPLIED = Record("strategy", "limits_applied")
"""Live limits the worker applied (``changed``: field -> [old, new]): the limits in force."""
WEIGHTS_STEP = Record("stagehand", "step")
"""The weight runtime's per-step figures (loads, bytes, watermarks, step time)."""
SQUAREQ_STEP = Record("squareq", "step")
"""SquareQ's per-step figures (bytes dequantized, dequant ms, format; the first one also the
quantization error table and time)."""
