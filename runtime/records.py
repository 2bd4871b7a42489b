"""The telemetry record names, kept importable here for the weight runtime; they are defined in
``contract.records`` (the contract between worker and server)."""

from contract.records import LIMITS_APPLIED, RUN_FINISHED, RUN_STARTED, WEIGHTS_STEP, Record

__all__ = ["LIMITS_APPLIED", "RUN_FINISHED", "RUN_STARTED", "WEIGHTS_STEP", "Record"]
