"""The telemetry record names, kept importable here for the weight and SquareQ runtimes; they are
defined in ``contract.records`` (the contract between worker and server)."""

from contract.records import (
    LIMITS_APPLIED,
    RUN_FINISHED,
    RUN_STARTED,
    SQUAREQ_STEP,
    WEIGHTS_STEP,
    Record,
)

__all__ = [
    "LIMITS_APPLIED",
    "RUN_FINISHED",
    "RUN_STARTED",
    "SQUAREQ_STEP",
    "WEIGHTS_STEP",
    "Record",
]
