"""The Conductor: arbitration of VRAM, pinned host memory and PCIe slots between the memory
runtimes ("Conductor: Resource Arbitration Across Memory Runtimes"). The adapters of the weight and activation runtimes are
the strategy's (``stagehand.strategy.adapters``): the Conductor imports no runtime."""

from stagehand.conductor.adapter import ConductorAdapter
from stagehand.conductor.budget import BudgetManager, Reservation
from stagehand.conductor.coordinator import PhaseCoordinator
from stagehand.conductor.policy import HeuristicPolicyBridge, RuntimeLimitHints
from stagehand.conductor.runtime import ConductorRuntime
from stagehand.conductor.transfer import TransferGrant, TransferManager
from stagehand.conductor.types import BudgetMode, DenialReason, GrantOutcome, Priority

__all__ = [
    "BudgetManager",
    "BudgetMode",
    "ConductorAdapter",
    "ConductorRuntime",
    "DenialReason",
    "GrantOutcome",
    "HeuristicPolicyBridge",
    "PhaseCoordinator",
    "Priority",
    "Reservation",
    "RuntimeLimitHints",
    "TransferGrant",
    "TransferManager",
]
