"""The Conductor: arbitration of VRAM, pinned host memory and PCIe slots between the memory
runtimes (``shared/seeds/conductor.md``)."""

from runtime.conductor.adapters import (
    ActStagehandConductorAdapter,
    ConductorAdapter,
    StagehandConductorAdapter,
)
from runtime.conductor.budget import BudgetManager, Reservation
from runtime.conductor.coordinator import PhaseCoordinator
from runtime.conductor.policy import HeuristicPolicyBridgeV0, RuntimeLimitHints
from runtime.conductor.runtime import ConductorRuntime
from runtime.conductor.transfer import TransferGrant, TransferManager
from runtime.conductor.types import BudgetMode, DenialReason, GrantOutcome, Priority

__all__ = [
    "ActStagehandConductorAdapter",
    "BudgetManager",
    "BudgetMode",
    "ConductorAdapter",
    "ConductorRuntime",
    "DenialReason",
    "GrantOutcome",
    "HeuristicPolicyBridgeV0",
    "PhaseCoordinator",
    "Priority",
    "Reservation",
    "RuntimeLimitHints",
    "StagehandConductorAdapter",
    "TransferGrant",
    "TransferManager",
]
