"""The Conductor: arbitration of VRAM, pinned host memory and PCIe slots between the memory
runtimes ("Conductor: Resource Arbitration Across Memory Runtimes"). The adapters of the weight and activation runtimes are
the strategy's (``runtime.strategy.adapters``): the Conductor imports no runtime."""

from runtime.conductor.adapter import ConductorAdapter
from runtime.conductor.budget import BudgetManager, Reservation
from runtime.conductor.coordinator import PhaseCoordinator
from runtime.conductor.policy import HeuristicPolicyBridge, RuntimeLimitHints
from runtime.conductor.runtime import ConductorRuntime
from runtime.conductor.transfer import TransferGrant, TransferManager
from runtime.conductor.types import BudgetMode, DenialReason, GrantOutcome, Priority

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
