"""Stock techniques we compare against, wrapped as ``MemoryStrategy`` so one loop drives all.

- diffusers group offloading (``hooks/group_offloading.py``): ``block_level``,
  ``num_blocks_per_group=1``, with and without ``use_stream`` (CUDA only). It has no backward
  prefetch and no notion of autograd's saved weight views.
- ``torch.autograd.graph.save_on_cpu``: every saved tensor goes to host memory in forward and
  back in backward; its pack/unpack hooks are wrapped to count the bytes moved.

On CPU both offload to the memory they came from, so their rows carry ``CPU_PEER_NOTE``.
"""

from __future__ import annotations

from typing import Any

import torch

from stagehand.common.telemetry import Telemetry
from stagehand.strategy.base import MemoryStrategy
from workbench.plan.workload import block_lists, param_bytes


class GroupOffloadPeer(MemoryStrategy):
    """diffusers ``apply_group_offloading(block_level, num_blocks_per_group=1)``.

    Bytes per step are *estimated*: every block's parameters are onloaded once per forward
    (diffusers does not re-onload for backward; autograd keeps the onloaded weights alive).
    """

    name = "diffusers_group_offload"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | str,
        use_stream: bool,
        telemetry: Telemetry | None = None,
    ) -> None:
        super().__init__(model, device=device, telemetry=telemetry)
        from diffusers.hooks import apply_group_offloading

        if use_stream and self.device.type != "cuda":
            raise RuntimeError("use_stream needs CUDA streams; this device is " + str(self.device))
        apply_group_offloading(
            model,
            onload_device=self.device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=use_stream,
            non_blocking=use_stream,
        )
        self.h2d_bytes_per_step = sum(param_bytes(b) for lst in block_lists(model) for b in lst)
        self.d2h_bytes_per_step = 0  # offload drops the device copy; nothing is written back


class SaveOnCpuPeer(MemoryStrategy):
    """``torch.autograd.graph.save_on_cpu`` around forward (pinned when CUDA is present)."""

    name = "save_on_cpu"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | str,
        telemetry: Telemetry | None = None,
    ) -> None:
        super().__init__(model, device=device, telemetry=telemetry)
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.saved_tensors = 0
        self._ctx: Any = None

    def _counting_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        stock = torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

        def pack(tensor: torch.Tensor) -> Any:
            self.saved_tensors += 1
            self.d2h_bytes += tensor.numel() * tensor.element_size()
            return stock.pack_hook(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            tensor = stock.unpack_hook(packed)
            self.h2d_bytes += tensor.numel() * tensor.element_size()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _on_forward_begin(self) -> None:
        self._ctx = self._counting_hooks()
        self._ctx.__enter__()

    def _on_forward_end(self) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)


def build_peer(
    peer: str, model: torch.nn.Module, device: torch.device, telemetry: Telemetry
) -> MemoryStrategy:
    """The peer strategy named ``peer``; the model is moved to ``device`` unless offloaded.

    Raises:
        ValueError: unknown ``peer``.
        RuntimeError: ``group_offload_stream`` without CUDA.
    """
    if peer in ("group_offload", "group_offload_stream"):
        return GroupOffloadPeer(
            model, device=device, use_stream=peer.endswith("stream"), telemetry=telemetry
        )
    if peer == "save_on_cpu":
        model.to(device)
        return SaveOnCpuPeer(model, device=device, telemetry=telemetry)
    raise ValueError(
        f"peer must be group_offload, group_offload_stream or save_on_cpu, got {peer!r}"
    )
