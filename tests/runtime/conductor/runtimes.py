"""Real runtimes for the adapter tests: a weight runtime and an activation runtime over a tiny
model of four linear blocks on the CPU (the adapters are tested against the parts they tune,
never against stand-ins that copy their attribute paths)."""

from __future__ import annotations

import torch

from stagehand.activations import ActivationRuntime
from stagehand.common.memory import DeviceMemory
from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import ActivationStagehandConfig, StagehandConfig
from stagehand.weights import WeightRuntime


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def weight_runtime(
    window: int = 3, inflight: int = 2, memory: DeviceMemory | None = None
) -> WeightRuntime:
    """A weight runtime with ``prefetch_window_blocks=window``, ``max_inflight_transfers=
    inflight``; the caller closes it."""
    config = StagehandConfig(
        pinned_pool_mb=1,
        pinned_slab_mb=1,
        prefetch_window_blocks=window,
        max_inflight_transfers=inflight,
    )
    return WeightRuntime(Blocks(), config, device="cpu", memory=memory, telemetry=Telemetry())


def activation_runtime(
    d2h: int = 2, h2d: int = 1, memory: DeviceMemory | None = None
) -> ActivationRuntime:
    """An activation runtime with ``max_inflight_d2h=d2h``, ``max_inflight_h2d=h2d``."""
    config = ActivationStagehandConfig(
        pinned_pool_classes_mb=(1,), slabs_per_class=2, max_inflight_d2h=d2h, max_inflight_h2d=h2d
    )
    return ActivationRuntime(
        config, device="cpu", memory=memory, telemetry=Telemetry(), model=Blocks()
    )
