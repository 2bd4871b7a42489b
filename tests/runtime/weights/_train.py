"""Shared helpers of the weight runtime tests: tiny factory models, a 3-step training loop."""

from __future__ import annotations

from pathlib import Path

import torch

from stagehand.config.memory import StagehandConfig
from tests.runtime import exact
from workbench.worker.assets import output_tensor


def make_model(
    arch: str, path: Path, method: str = "lora", checkpointing: bool = False
) -> torch.nn.Module:
    """``exact.make_model`` (LoRA, or every parameter trainable with ``"full"``) with its
    weights in ordinary storage: the models here are compared with plain models, and a plain
    model's weights must not be views into the mmap'd file (NOTE [ Exact numbers ])."""
    gc = "non-reentrant" if checkpointing else None
    return exact.make_model(arch, path, method, gc, ordinary=True)


def config(**overrides) -> StagehandConfig:
    """Small pool and slabs for tiny models; window 1; the high watermark far above the tiny
    figures (prefetch never waits) and the low one 0: every block streams, none stays on the
    device after its use but the window's (NOTE [ Eviction policy ])."""
    fields = {
        "pinned_pool_mb": 4,
        "pinned_slab_mb": 1,
        "prefetch_window_blocks": 1,
        "vram_high_watermark_mb": 1000,
        "vram_low_watermark_mb": 0,
    }
    fields.update(overrides)
    return StagehandConfig(**fields)


def train(model: torch.nn.Module, runtime=None, steps: int = 3, begin_step: bool = True):
    """``steps`` AdamW steps; returns (losses, [{param name: grad}] per step)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        inputs = exact.inputs_for(model, step)
        if runtime is not None and begin_step:
            runtime.begin_step(step)
        with runtime.managed_forward() if runtime is not None else torch.enable_grad():
            loss = output_tensor(model(**inputs)).pow(2).mean()
        with runtime.managed_backward() if runtime is not None else torch.enable_grad():
            loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        with runtime.optimizer_context(opt) if runtime is not None else torch.enable_grad():
            opt.step()
            opt.zero_grad(set_to_none=True)
        if runtime is not None and begin_step:
            runtime.end_step()
    return losses, grads


def assert_same_training(reference, streamed) -> None:
    """Loss and every trainable gradient of every step bit-identical (fp32)."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, streamed
    assert loss_a == loss_b
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b, strict=True)):
        assert ga.keys() == gb.keys() and ga
        # Some parameters legitimately get zero gradients (SD3's last block drops the context
        # stream), but most must not: equality of zeros would prove nothing.
        nonzero = sum(bool(torch.count_nonzero(g)) for g in ga.values())
        assert nonzero >= 0.75 * len(ga), (
            f"step {step}: only {nonzero}/{len(ga)} gradients non-zero"
        )
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"step {step}: gradient of {name} differs"


class Wide(torch.nn.Module):
    """``depth`` residual blocks of two linears (width x 2 width, 2 width x width): 64 MB each
    at the default width 2048, 256 MB at 4096."""

    def __init__(self, width=2048, depth=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 2 * width),
                torch.nn.GELU(),
                torch.nn.Linear(2 * width, width),
            )
            for _ in range(depth)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x
