"""The exactness harness: train a model plainly and under a strategy, compare every number.

One training run is ``STEPS`` AdamW steps with weight decay (``WEIGHT_DECAY``: a parameter that
wrongly gets a zero gradient instead of None is decayed and drifts). ``train`` records each step's
loss and every parameter's gradient (None included) and the final parameters; ``assert_exact``
compares two runs with ``torch.equal`` and no tolerance.

The reference is the plain model with its parameters in ordinary, aligned tensors
(``own_storage``), as a model moved to a GPU has them: ``from_pretrained`` leaves CPU weights as
views into the mmap'd safetensors file at unaligned offsets, and on some CPUs a GEMM's last bit
depends on its inputs' alignment (NOTE [ Exact numbers ] in ``runtime/stagehand/__init__.py``).

Two small diffusers models built here reproduce two gradient defects:

- ``DualStreamToy``: each block returns ``(x + img(x) * y.mean(), txt(y))`` and the model returns
  only ``x``: the last block's ``txt`` gets no gradient in the plain model (``.grad`` None).
- ``SharedContextToy``: ``context = proj(c)`` is passed to every block and used twice in each
  (``k(context)``, ``v(context)``): ``proj``'s gradient is summed in autograd's arrival order.

``TiedToy`` (tied weights: a layer shared by two blocks, and by a block and a resident module)
reproduces a set-up defect: a frozen tied weight was laid out in two blocks (the second layout
read the first one's empty placeholder) or streamed while a resident module used it.
``OwnCheckpointToy`` (a model checkpointing its blocks itself) one of layer offload: its
per-layer checkpoint, recomputed inside the model's, saved other tensors the second time.
``NestedToy`` (blocks in a list of lists) one of block discovery: the inner lists, never
called, were the blocks, so nothing streamed and file-backed weights stayed empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin
from peft import LoraConfig
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagehand.common import own_storage
from stagehand.strategy import MemoryStrategy
from workbench.worker.assets import example_inputs, model_class, output_tensor

STEPS = 3
WEIGHT_DECAY = 0.01
LORA_TARGETS = ["to_q", "to_k", "to_v"]


class _Toy(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Gradient checkpointing and LoRA exactly as diffusers models have them."""

    _supports_gradient_checkpointing = True

    def _block(self, block: nn.Module, *args: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, *args)
        return block(*args)


class DualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim)  # the image stream (LoRA target)
        self.to_k = nn.Linear(dim, dim)  # the text stream (LoRA target)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + self.to_q(x) * y.mean(), torch.tanh(self.to_k(y))


class DualStreamToy(_Toy):
    """x: (B, T, dim), y: (B, L, dim) -> x (B, T, dim); the last text-stream output is dropped."""

    @register_to_config
    def __init__(self, dim: int = 32, num_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(DualBlock(dim) for _ in range(num_layers))
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x, y = self._block(block, x, y)
        return x


class CrossBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.to_q(x) @ self.to_k(context).transpose(-1, -2), dim=-1)
        return x + attn @ self.to_v(context)


class SharedContextToy(_Toy):
    """x: (B, T, dim), c: (B, L, dim) -> (B, T, dim); ``proj(c)`` feeds every block twice."""

    @register_to_config
    def __init__(self, dim: int = 64, num_layers: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(CrossBlock(dim) for _ in range(num_layers))
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        context = self.proj(c)
        for block in self.blocks:
            x = self._block(block, x, context)
        return x


class TiedToy(SharedContextToy):
    """``SharedContextToy`` with tied weights: block 1's ``to_k`` is block 0's (one module in
    two blocks), block 3's ``to_v`` is ``proj`` (a block and a resident module share it)."""

    @register_to_config
    def __init__(self, dim: int = 32, num_layers: int = 4) -> None:
        super().__init__(dim, num_layers)
        self.blocks[1].to_k = self.blocks[0].to_k
        self.blocks[3].to_v = self.proj


class OwnCheckpointToy(SharedContextToy):
    """``SharedContextToy`` checkpointing each block itself behind a flag of its own
    (``grad_checkpointing``, as timm models have it): layer offload cannot switch it off, so its
    per-layer checkpoint runs inside this one, and is recomputed by it."""

    @register_to_config
    def __init__(self, dim: int = 32, num_layers: int = 3) -> None:
        super().__init__(dim, num_layers)
        self.grad_checkpointing = True

    def _block(self, block: nn.Module, *args: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and self.grad_checkpointing:
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)


class NestedToy(_Toy):
    """``SharedContextToy``'s blocks in stages: a ``ModuleList`` of lists (and a
    ``ModuleDict`` stage), never called themselves: the blocks are their entries."""

    @register_to_config
    def __init__(self, dim: int = 32, num_stages: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.stages = nn.ModuleList(
            nn.ModuleList(CrossBlock(dim) for _ in range(2)) for _ in range(num_stages)
        )
        self.stages.append(nn.ModuleDict({"a": CrossBlock(dim), "b": CrossBlock(dim)}))
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        context = self.proj(c)
        for stage in self.stages:
            for block in stage.values() if isinstance(stage, nn.ModuleDict) else stage:
                x = self._block(block, x, context)
        return x


TOYS = {
    "dual": DualStreamToy,
    "shared": SharedContextToy,
    "tied": TiedToy,
    "own-gc": OwnCheckpointToy,
    "nested": NestedToy,
}


def build_toy(kind: str, folder: Path) -> Path:
    """Save a seeded ``kind`` toy in diffusers' folder layout (``config.json`` +
    ``diffusion_pytorch_model.safetensors``) under ``folder`` and return the folder."""
    torch.manual_seed({"dual": 0, "shared": 1, "tied": 2, "own-gc": 3, "nested": 4}[kind])
    model = TOYS[kind]()
    # ``save_pretrained`` refuses tensors that share memory: every key gets its own copy
    # (``from_pretrained`` loads both keys into the one tied parameter).
    model.save_config(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(state, str(Path(folder) / "diffusion_pytorch_model.safetensors"))
    return folder


def toy_inputs(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dim = model.config.dim
    a, b = (torch.randn(2, n, dim, generator=generator) for n in (8, 5))
    return {"x": a, "y": b} if isinstance(model, DualStreamToy) else {"x": a, "c": b}


def model_class_of(arch: str) -> type:
    """The class of ``arch``: a toy here, or a factory arch (``"flux-bf16"``: a flux folder)."""
    return TOYS.get(arch) or model_class(arch.split("-")[0])


CHECKPOINTING = (None, "non-reentrant", "reentrant")
"""Gradient checkpointing of ``make_model``: off, diffusers' default (``use_reentrant=False``),
or reentrant (transformers' default)."""


def make_model(
    arch: str,
    folder: Path,
    method: str,
    checkpointing: str | None = None,
    ordinary: bool = False,
    dtype: torch.dtype = torch.float32,
    cls: type | None = None,
) -> nn.Module:
    """``arch`` (or ``cls`` when given) from ``folder`` with ``from_pretrained`` in ``dtype``,
    in train mode.

    ``method``: ``"lora"`` (frozen base + peft LoRA on ``LORA_TARGETS``, ``lora_B`` non-zero so
    every LoRA gradient is non-trivial) or ``"full"`` (every parameter trainable).
    ``checkpointing``: one of ``CHECKPOINTING``. ``ordinary``: parameters in ordinary aligned
    tensors (``own_storage``), as the plain model a strategy is compared with must have them.
    """
    model = (cls or model_class_of(arch)).from_pretrained(folder, torch_dtype=dtype)
    if ordinary:
        own_storage(model)
    if method == "lora":
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    elif method == "full":
        model.requires_grad_(True)
    else:
        raise ValueError(f"method must be 'lora' or 'full', got {method!r}")
    if checkpointing == "reentrant":
        model.enable_gradient_checkpointing(partial(checkpoint, use_reentrant=True))
    elif checkpointing == "non-reentrant":
        model.enable_gradient_checkpointing()
    elif checkpointing is not None:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    return model.train()


def inputs_for(model: nn.Module, step: int) -> dict[str, Any]:
    """Step ``step``'s inputs, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    if isinstance(model, tuple(TOYS.values())):
        inputs = toy_inputs(model, step)
    else:
        inputs = example_inputs(model, seed=step)
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


@dataclass
class Run:
    """What one training run computed: per step the loss and every parameter's gradient
    (None where autograd left none), and every parameter after the last step."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor | None]]
    final: dict[str, torch.Tensor]


def train(
    model: nn.Module,
    strategy: MemoryStrategy | None = None,
    steps: int = STEPS,
    after_step: Callable[[MemoryStrategy], None] | None = None,
    forward: Callable[[nn.Module, int], torch.Tensor] | None = None,
) -> Run:
    """``steps`` AdamW steps (lr 1e-2, weight decay ``WEIGHT_DECAY``) on ``loss = out.pow(2)
    .mean()``; driven through ``strategy``'s phases when given, plainly otherwise.
    ``after_step(strategy)`` runs after each step (invariant checks). ``forward(model, step)``
    gives step ``step``'s output (default: the model on ``inputs_for(model, step)``)."""
    strategy = strategy if strategy is not None else MemoryStrategy(model, device="cpu")
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [p for p in params.values() if p.requires_grad], lr=1e-2, weight_decay=WEIGHT_DECAY
    )
    losses, grads = [], []
    for step in range(steps):
        with strategy.step(step):
            with strategy.forward():
                if forward is None:
                    out = output_tensor(model(**inputs_for(model, step)))
                else:
                    out = forward(model, step)
                loss = out.pow(2).mean()
            with strategy.backward():
                loss.backward()
            losses.append(loss.item())
            grads.append(
                {
                    n: None if p.grad is None else p.grad.detach().clone()
                    for n, p in params.items()
                    if p.requires_grad
                }
            )
            with strategy.optimizer(opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(strategy)
    strategy.close()  # the model's weights are ordinary tensors again
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Run(losses, grads, final)


def assert_exact(reference: Run, got: Run) -> None:
    """Every loss, gradient (None where the reference has None) and final parameter equal, bit
    for bit. Fails on a vacuous comparison: most reference gradients must be non-zero."""
    assert len(got.losses) == len(reference.losses)
    for step, (ga, gb) in enumerate(zip(reference.grads, got.grads, strict=True)):
        la, lb = reference.losses[step], got.losses[step]
        assert la == lb, f"step {step}: loss {lb!r} under the strategy, {la!r} in the plain model"
        assert ga.keys() == gb.keys() and ga
        present = [g for g in ga.values() if g is not None]
        nonzero = sum(bool(torch.count_nonzero(g)) for g in present)
        assert nonzero >= 0.6 * len(ga), f"step {step}: only {nonzero}/{len(ga)} non-zero"
        for name, a in ga.items():
            b = gb[name]
            if a is None or b is None:
                assert a is None and b is None, (
                    f"step {step}: gradient of {name} is {'None' if a is None else 'a tensor'} "
                    f"in the plain model, {'None' if b is None else 'a tensor'} under the strategy"
                )
            else:
                assert torch.equal(a, b), f"step {step}: gradient of {name} differs"
    assert reference.final.keys() == got.final.keys()
    for name, a in reference.final.items():
        assert torch.equal(a, got.final[name]), f"final value of {name} differs"
