"""The telemetry records the backend reads from a worker's stream, named once for both sides.

Torch-free (the server imports it, as it imports ``workbench.contract.status``); the records the
runtimes emit are the runtime's (``stagehand.config.records``), this module names the trainer's. Each is a
``(source, kind)`` pair: the worker emits ``telemetry.emit(*RUN_FINISHED, ...)`` and the
backend looks one up with ``store.last_record(run_id, *RUN_FINISHED)``. Their fields are in
``docs/contracts.md``; records only the dashboard reads keep their names at the emitter.
"""

from __future__ import annotations

from stagehand.config.records import Record

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
