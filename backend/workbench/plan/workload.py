"""The measured work: a LoRA training step on a factory transformer, driven through a strategy.

One step is forward + MSE loss against a fixed random target + backward + AdamW on the LoRA
parameters (rank 4 on ``to_q/to_k/to_v/to_out.0``), inside the strategy's phase contexts
(``stagehand.strategy.base``). Inputs come from ``workbench.worker.assets.example_inputs``.

``workbench bench`` measures this step and the planner calibrates its CPU profile on it
(``workbench.plan.calibrate``); it lives in the planner, which the bench sits above.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stagehand.strategy.base import MemoryStrategy
from workbench.worker.assets import example_inputs, model_class, output_tensor
from workbench.worker.assets.cache import build_once, cache_root
from workbench.worker.assets.models import MODEL_CLASSES, MODEL_SPECS, SEED

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_RANK = 4
LEARNING_RATE = 1e-4


def block_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The model's top-level ModuleLists of transformer blocks (flux has two)."""
    return [m for m in model.children() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def model_sizes(model: torch.nn.Module) -> dict[str, int]:
    """``n_blocks``, ``param_bytes``, ``block_bytes`` (largest block), ``nonblock_bytes``."""
    blocks = [b for lst in block_lists(model) for b in lst]
    total = param_bytes(model)
    in_blocks = sum(param_bytes(b) for b in blocks)
    return {
        "n_blocks": len(blocks),
        "param_bytes": total,
        "block_bytes": max((param_bytes(b) for b in blocks), default=0),
        "nonblock_bytes": total - in_blocks,
    }


def scale_spec(arch: str, size: str, n_blocks: int) -> dict[str, Any]:
    """Config kwargs of ``(arch, size)`` with ``n_blocks`` transformer blocks.

    Flux splits them evenly between double-stream (``num_layers``) and single-stream blocks,
    except below 4 where all are single-stream: block discovery needs >= 2 blocks per list.
    """
    spec = dict(MODEL_SPECS[(arch, size)])
    if arch == "flux":
        double = n_blocks // 2 if n_blocks >= 4 else 0
        spec["num_layers"] = double
        spec["num_single_layers"] = n_blocks - double
    else:
        spec["num_layers"] = n_blocks
    return spec


def build_scale_model(arch: str, size: str, n_blocks: int, cache_dir: str | None) -> Path:
    """Build (once) a sharded model folder of the family ``(arch, size)`` with ``n_blocks``."""
    config = scale_spec(arch, size, n_blocks)
    final = cache_root(cache_dir) / "models" / f"{arch}-{size}-scale{n_blocks}"
    spec = {"arch": arch, "config": config, "seed": SEED, "class": MODEL_CLASSES[arch]}

    def _build(tmp: Path) -> None:
        torch.manual_seed(SEED)
        model = model_class(arch)(**config)
        shard = max(1, param_bytes(model) // 4)  # several shards, like a real checkpoint
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=shard)

    return build_once(final, spec, _build)


def load_model(folder: str | os.PathLike[str], arch: str) -> torch.nn.Module:
    """Load the folder on the host (fp32), freeze it and add a LoRA adapter.

    Raises:
        ImportError: peft is missing (diffusers' ``add_adapter`` needs it).
    """
    from peft import LoraConfig

    model = model_class(arch).from_pretrained(folder, low_cpu_mem_usage=True)
    model.requires_grad_(False)
    torch.manual_seed(SEED)  # the same LoRA init in every row
    model.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS,
        )
    )
    model.train()
    return model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing on, verified (the seed's bug 5: it was silently off).

    Raises:
        RuntimeError: the model reports it off after enabling it.
    """
    model.enable_gradient_checkpointing()
    if not model.is_gradient_checkpointing:
        raise RuntimeError(f"{type(model).__name__}: gradient checkpointing did not turn on")


def latent_hw_for(size: str) -> tuple[int, int]:
    # Tiny models get the smallest image; larger ones enough tokens that activations matter.
    return (8, 8) if size == "tiny" else (16, 16)


@dataclass
class StepFigures:
    """What the loop measured; times in ms, bytes in bytes."""

    step_ms: list[float]
    phase_ms: list[dict[str, float]]
    vram_peak_bytes: list[int]
    vram_reserved_peak_bytes: list[int]
    loss: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(
    strategy: MemoryStrategy,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    *,
    warmup: int,
    steps: int,
) -> StepFigures:
    """Run ``warmup + steps`` LoRA steps; return the figures of the last ``steps`` ones.

    VRAM peaks are the strategy's ``memory`` peak (tracked bytes on CPU, allocator on CUDA)
    and, on CUDA, ``max_memory_reserved``; each step starts a new peak window.
    """
    device = strategy.device
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise RuntimeError("the model has no trainable parameters: the LoRA adapter is missing")
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE)
    target: torch.Tensor | None = None
    figures = StepFigures([], [], [], [], float("nan"))
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        with strategy.step(i):
            with strategy.forward():
                out = output_tensor(model(**inputs))
                if target is None:
                    g = torch.Generator().manual_seed(SEED)
                    target = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
                loss = torch.nn.functional.mse_loss(out.float(), target.float())
            with strategy.backward():
                loss.backward()
            with strategy.optimizer(optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        _sync(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        if i < warmup:
            continue
        figures.step_ms.append(elapsed)
        figures.phase_ms.append(dict(strategy.phase_ms))
        figures.vram_peak_bytes.append(int(strategy.memory.peak_bytes()))
        if device.type == "cuda":
            figures.vram_reserved_peak_bytes.append(torch.cuda.max_memory_reserved(device))
        else:
            figures.vram_reserved_peak_bytes.append(int(strategy.memory.peak_bytes()))
        figures.loss = float(loss.detach())
    return figures


class SavedBytesCounter:
    """Counting ``saved_tensors_hooks``: bytes of the distinct non-parameter storages autograd
    saves (activations), so a hook-free run's activation memory can be stated on CPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.saved_bytes = 0
        self.saved_tensors = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved_tensors += 1
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self.saved_bytes += storage.nbytes()
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def counted_device_bytes(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, int]:
    """The resident-everything device footprint, counted (one untimed forward + backward).

    ``params + LoRA grads + AdamW state (2x LoRA) + saved activations``; transient backward
    buffers are not included, so this is a lower bound of a real device's peak.
    """
    counter = SavedBytesCounter(model)
    with counter.hooks():
        out = output_tensor(model(**inputs))
    out.float().pow(2).mean().backward()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    params = param_bytes(model)
    return {
        "param_bytes": params,
        "trainable_bytes": trainable,
        "saved_activation_bytes": counter.saved_bytes,
        "saved_tensors": counter.saved_tensors,
        "total_bytes": params + 3 * trainable + counter.saved_bytes,
    }


def make_inputs(model: torch.nn.Module, size: str, device: torch.device) -> dict[str, Any]:
    return example_inputs(
        model, batch_size=1, seed=SEED, latent_hw=latent_hw_for(size), device=device
    )
