"""Mechanisms shared by the memory runtimes: telemetry, device memory figures, copy streams and
the saved-tensor hook router."""

from stagehand.common.device import (
    TransferEvent,
    TransferStream,
    host_buffer,
    own_storage,
    uses_cuda,
)
from stagehand.common.memory import DeviceMemory
from stagehand.common.saved_tensors import SavedTensorRouter
from stagehand.common.telemetry import JsonlSink, ListSink, NullSink, Telemetry

__all__ = [
    "DeviceMemory",
    "JsonlSink",
    "ListSink",
    "NullSink",
    "SavedTensorRouter",
    "Telemetry",
    "TransferEvent",
    "TransferStream",
    "host_buffer",
    "own_storage",
    "uses_cuda",
]
