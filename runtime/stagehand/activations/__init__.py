"""Activation Stagehand: spill autograd's saved tensors to host memory past a VRAM watermark and
restore them for backward, ahead of need ("Activation Stagehand")."""

from stagehand.activations.budget import ActivationBudgetManager
from stagehand.activations.hooks import KeptTensor, SpilledTensor
from stagehand.activations.pool import CPUSpillBackend
from stagehand.activations.prefetch import RestorePlanner
from stagehand.activations.registry import (
    ActivationRecord,
    ActivationRegistry,
    ActivationState,
    ActivationStateError,
)
from stagehand.activations.runtime import ActivationRuntime
from stagehand.activations.spill import ChecksumError, SpillTable
from stagehand.activations.telemetry import STEP_FIELDS, ActivationStepMetrics
from stagehand.activations.transfer import ActivationTransferEngine

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
