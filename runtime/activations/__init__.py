"""Activation Stagehand: spill autograd's saved tensors to host memory past a VRAM watermark and
restore them for backward, ahead of need ("Activation Stagehand")."""

from runtime.activations.budget import ActivationBudgetManager
from runtime.activations.hooks import KeptTensor, SpilledTensor
from runtime.activations.pool import CPUSpillBackend
from runtime.activations.prefetch import RestorePlanner
from runtime.activations.registry import (
    ActivationRecord,
    ActivationRegistry,
    ActivationState,
    ActivationStateError,
)
from runtime.activations.runtime import ActivationRuntime
from runtime.activations.spill import ChecksumError, SpillTable
from runtime.activations.telemetry import STEP_FIELDS, ActivationStepMetrics
from runtime.activations.transfer import ActivationTransferEngine

__all__ = [
    "STEP_FIELDS",
    "ActivationBudgetManager",
    "ActivationRecord",
    "ActivationRegistry",
    "ActivationRuntime",
    "ActivationState",
    "ActivationStateError",
    "ActivationStepMetrics",
    "ActivationTransferEngine",
    "CPUSpillBackend",
    "ChecksumError",
    "KeptTensor",
    "RestorePlanner",
    "SpillTable",
    "SpilledTensor",
]
