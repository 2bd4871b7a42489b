"""Shared helpers of the layer-offload tests: tiny factory models with LoRA, a training loop
driven through a strategy's phases (or plain), and the layer-offload memory section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.runtime import exact
from workbench.worker.assets import example_inputs, output_tensor


def make_model(arch: str, path: Path) -> torch.nn.Module:
    """Frozen base + peft LoRA with non-zero ``lora_B``, weights in ordinary storage
    (``exact.make_model``)."""
    return exact.make_model(arch, path, "lora", ordinary=True)


def layer_offload(fraction: float, offload: bool, **extra: Any) -> dict[str, Any]:
    """The preset's ``memory`` section for layer offload (the seed's settings otherwise)."""
    return {
        "strategy": "layer_offload",
        "layer_offload_fraction": fraction,
        "enable_activation_offloading": offload,
        "gradient_checkpointing": "on",
        **extra,
    }


def train(model, strategy=None, steps: int = 2, latent_hw=(8, 8), on_backward=None):
    """``steps`` AdamW steps; returns (losses, [{param name: grad}] per step). With a strategy
    the step runs inside its phases; ``on_backward(step)`` runs after each backward."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        inputs = example_inputs(model, seed=step, latent_hw=latent_hw)
        if strategy is None:
            loss = output_tensor(model(**inputs)).pow(2).mean()
            loss.backward()
            grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with strategy.step(step):
                with strategy.forward():
                    loss = output_tensor(model(**inputs)).pow(2).mean()
                with strategy.backward():
                    loss.backward()
                if on_backward is not None:
                    on_backward(step)
                grads.append(_grads(model))
                with strategy.optimizer(opt):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_training(reference, other) -> None:
    """Losses and every LoRA gradient of every step bit-identical (fp32, CPU)."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    assert loss_a == loss_b
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b, strict=True)):
        assert ga.keys() == gb.keys() and ga
        nonzero = sum(bool(torch.count_nonzero(g)) for g in ga.values())
        assert nonzero >= 0.75 * len(ga), f"step {step}: only {nonzero}/{len(ga)} non-zero"
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"step {step}: gradient of {name} differs"
