"""What a plan needs to know about a model, read without its weights.

The model is built on the ``meta`` device from its ``config.json`` (a diffusers model folder) or
a factory spec; the dtypes come from the safetensors headers (``SafetensorsCheckpoint`` parses
headers only). Blocks are the weight runtime's own (``find_blocks``, ``build_layout``, and the
H2D-only rule that keeps a LoRA resident, ``_resident_trainable``), so block bytes are the
aligned buffer sizes the runtime allocates. One forward on ``meta`` tensors, under a
``saved_tensors_hooks`` counter and ``FlopCounterMode``, gives each block's saved activations
(the tensors autograd keeps, as the activation runtime sees them: parameters and views of
parameters left out, one entry per distinct storage offset) and its forward FLOPs; the
operation counter (``workbench.plan.op_counter``) measures each distinct call once, which
repeated blocks make cheap.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from stagehand.layer_offload.checkpoint_layer import SharedTensors, split_inputs
from stagehand.squareq.runtime import image_nbytes
from stagehand.weights.convert import _resident_trainable, shared_parameters
from stagehand.weights.defaults import block_bytes
from stagehand.weights.registry import Block, build_layout, find_blocks
from stagehand.weights.sources import SafetensorsCheckpoint
from workbench.plan.op_counter import OpCounter
from workbench.worker.assets import output_tensor
from workbench.worker.diffusers_classes import diffusers_class


class PlanInputError(ValueError):
    """A plan input (preset field, model folder, device profile) is missing or wrong; the
    message names the field."""


@dataclass
class BlockInfo:
    """One streamed block. Bytes are bytes; FLOPs are forward FLOPs of one step."""

    name: str
    index: int
    nbytes: int
    """The block's device buffer (aligned layout, resident LoRA left out)."""
    params: int
    forward_flops: int
    saved: list[int] = field(default_factory=list)
    """Bytes of each activation tensor autograd saves in the block's forward (no checkpointing)."""
    frozen: bool = True
    """No trainable parameter in its layout: the weight runtime's host cache may keep an image
    of it (``runtime/stagehand/weights/host_cache.py``)."""
    image_bytes: int = 0
    """Its 8-bit image with SquareQ (``memory.stagehand.squareq``): what is then staged, cached
    and copied per load instead of ``nbytes`` (``stagehand.squareq.runtime.image_nbytes``)."""
    input_bytes: int = 0
    """Bytes of the block's tensor inputs: what a checkpointed block keeps from its forward."""
    saved_inputs: list[int] = field(default_factory=list)
    """Bytes of each tensor input no earlier block was given: what its checkpoint adds to the
    kept activations (the runtimes count a storage once: ``temb`` with the first block only)."""
    forward_ops: int = 0
    """ATen operations of its forward (each costs the device a launch, or the host a dispatch)."""
    forward_moved: int = 0
    """Bytes read and written by its forward's operations other than matrix products and
    attention (bandwidth-bound: norms, activations, residual adds, RoPE)."""
    param_bytes: int = 0
    """Bytes of all its parameters, adapter included (layer offload sizes its slab by it)."""
    layout_bytes: int = 0
    """``param_bytes`` with each parameter aligned as the weight runtime lays it out
    (``stagehand.weights.defaults.block_bytes``): what the window, the slab and ``"auto"`` size by."""
    checkpoint_inputs: list[int] = field(default_factory=list)
    """Bytes of each tensor layer offload's checkpoint wrapper saves for the block: its inputs
    less those an earlier block was given (``stagehand.layer_offload.checkpoint_layer``'s
    ``split_inputs`` and ``SharedTensors``, called here)."""

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved)


@dataclass
class Inventory:
    """A model's memory figures (bytes) and per-block costs at one input shape."""

    model_class: str
    dtype: str
    blocks: list[BlockInfo]
    resident_bytes: int
    """Everything the weight runtime keeps on the device: non-block parameters, buffers, and
    block parameters left out of the layouts (a resident LoRA)."""
    nonblock_bytes: int
    """Parameters and buffers outside the blocks."""
    lora_bytes: int
    """Trainable parameters (the adapter)."""
    lora_in_blocks: bool
    """The adapter's block parameters stay resident (H2D-only streaming)."""
    optimizer_bytes: int
    """AdamW state: two moments per trainable parameter, in its dtype."""
    param_bytes: int
    buffer_bytes: int = 0
    saved_pre: list[int] = field(default_factory=list)
    """Saved activations before the first block (embedders)."""
    saved_post: list[int] = field(default_factory=list)
    """Saved activations after the last block (final norm, projection, loss)."""
    outside_flops: int = 0
    outside_ops: int = 0
    outside_moved: int = 0
    backward_ratio: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Backward over forward of the whole model: (FLOPs, operations, bytes moved), measured by
    one backward on ``meta`` (the fused attention's backward FLOPs counted as 2.5x its
    forward's: dq, dk, dv and the recomputed scores)."""

    @property
    def block_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_class": self.model_class,
            "dtype": self.dtype,
            "n_blocks": len(self.blocks),
            "block_bytes": self.block_bytes,
            "largest_block_bytes": max((b.nbytes for b in self.blocks), default=0),
            "resident_bytes": self.resident_bytes,
            "nonblock_bytes": self.nonblock_bytes,
            "lora_bytes": self.lora_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "param_bytes": self.param_bytes,
            "saved_activation_bytes": sum(self.saved_pre)
            + sum(self.saved_post)
            + sum(b.saved_bytes for b in self.blocks),
            "forward_flops": self.outside_flops + sum(b.forward_flops for b in self.blocks),
            "blocks": [
                {
                    "name": b.name,
                    "nbytes": b.nbytes,
                    "forward_flops": b.forward_flops,
                    "saved_bytes": b.saved_bytes,
                    "input_bytes": b.input_bytes,
                }
                for b in self.blocks
            ],
        }


def meta_model(class_name: str, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """A diffusers model of ``class_name`` built from ``config`` on the meta device (no memory).

    Raises:
        PlanInputError: ``class_name`` is not a diffusers class.
    """
    try:
        cls = diffusers_class(class_name)
    except AttributeError:
        raise PlanInputError(
            f"model class {class_name!r} (config _class_name) is not in diffusers"
        ) from None
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(config)
    return model.to(dtype)


def folder_model(folder: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of a diffusers model folder on ``meta``: ``config.json`` plus the safetensors
    headers' dtype (the most common floating dtype) unless ``dtype`` is given.

    Raises:
        PlanInputError: no ``config.json`` in ``folder`` (field ``model.path``).
    """

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise PlanInputError(f"model.path: {str(folder)!r} has no config.json")
    config = json.loads(config_path.read_text())
    if dtype is None:
        source = SafetensorsCheckpoint(folder)
        counts: dict[torch.dtype, int] = {}
        for entry in source.entries.values():
            if entry.dtype.is_floating_point:
                counts[entry.dtype] = counts.get(entry.dtype, 0) + entry.nbytes
        source.close()
        dtype = max(counts, key=counts.get) if counts else torch.float32
    return meta_model(config["_class_name"], config, dtype)


def add_lora(model: nn.Module, rank: int, targets: list[str]) -> None:
    """Freeze ``model`` and add a peft LoRA adapter of ``rank`` on ``targets`` (on meta)."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets)
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SavedCounter:
    """``saved_tensors_hooks`` counting activation bytes per segment (pre, block i, post)."""

    def __init__(self, model: nn.Module, n_blocks: int) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.segment: int | str = "pre"
        self.saved: dict[int | str, list[int]] = {"pre": [], "post": []}
        self.saved.update({i: [] for i in range(n_blocks)})
        self._seen: set[tuple[int, int]] = set()
        self._keep: list[torch.Tensor] = []  # keeps ids stable for the dedupe

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base
        if id(tensor) in self.params or (base is not None and id(base) in self.params):
            return tensor
        if isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter):
            return tensor
        # The runtime keys kept tensors on data_ptr: a storage and an offset into it.
        root = base if base is not None else tensor
        key = (id(root), tensor.storage_offset())
        if key not in self._seen:
            self._seen.add(key)
            self._keep.append(root)
            self.saved[self.segment].append(_nbytes(tensor))
        return tensor


class _FlashAttention(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as the fused (flash) kernel on ``meta`` tensors.

    On ``meta`` the dispatcher picks the math path, which saves the (B, H, Lq, Lk) attention
    matrix: 13.7 GB per Flux block at 2048 px, where the fused kernels that CUDA (flash,
    memory-efficient) and the CPU (flash for CPU) run save only q, k, v, the output and the
    (B, H, Lq) log-sum-exp. Its FLOPs (4 B H Lq Lk D, which ``FlopCounterMode`` does not count
    for this op) are added to the segment running.
    """

    def __init__(self, counter: _SavedCounter) -> None:
        super().__init__()
        self.counter = counter
        self.flops: dict[int | str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
        if kwargs.get("enable_gqa") or q.shape[-3] != k.shape[-3]:
            return func(**kwargs)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            kwargs.get("dropout_p", 0.0),
            kwargs.get("is_causal", False),
            attn_mask=kwargs.get("attn_mask"),
            scale=kwargs.get("scale"),
        )[0]
        segment = self.counter.segment
        flops = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        self.flops[segment] = self.flops.get(segment, 0) + flops
        return out


def block_layouts(
    model: nn.Module, found: list[tuple[str, nn.Module]], resident_trainable_max_fraction: float
) -> tuple[list[Block], frozenset[int]]:
    """The weight runtime's blocks of ``model`` (``found``: ``find_blocks``) with their layouts,
    as ``register_blocks`` lays them out (shared parameters and a small enough LoRA left out,
    NOTE [ H2D-only streaming ]), and the ``id`` of each parameter left out."""
    qualnames = {p: n for n, p in model.named_parameters()}
    resident = shared_parameters(model, found) | _resident_trainable(
        found, resident_trainable_max_fraction
    )
    layouts = []
    for index, (name, module) in enumerate(found):
        block = Block(name=name, index=index, module=module)
        build_layout(block, qualnames, resident)
        layouts.append(block)
    return layouts, resident


def inventory(
    model: nn.Module,
    inputs: dict[str, Any] | Callable[[nn.Module], Any],
    *,
    block_pattern: str | None = None,
    resident_trainable_max_fraction: float = 0.1,
    ops: OpCounter | None = None,
) -> Inventory:
    """Measure ``model`` (on ``meta``, with its adapter added) at ``inputs``: one forward, a
    mean-square loss and one backward, all on ``meta``. ``inputs`` is ``model(**inputs)``'s
    keyword arguments (``meta`` tensors), or a callable making the forward
    (``workbench.plan.calls.family_call``: a pipeline family's own call). ``ops`` counts the
    operations (default: an ``OpCounter`` measuring each distinct operation once).

    Raises:
        BlockDiscoveryError: the weight runtime finds no blocks (``block_pattern``).
    """

    found = find_blocks(model, block_pattern)
    layouts, resident = block_layouts(model, found, resident_trainable_max_fraction)
    streamed = {id(s.param) for b in layouts for s in b.layout}
    in_blocks = {id(p) for _, m in found for p in m.parameters()}
    params = list(model.parameters())
    buffers = sum(_nbytes(b) for b in model.buffers())
    resident_bytes = sum(_nbytes(p) for p in params if id(p) not in streamed) + buffers
    nonblock = sum(_nbytes(p) for p in params if id(p) not in in_blocks) + buffers
    trainable = [p for p in params if p.requires_grad]
    lora = sum(_nbytes(p) for p in trainable)

    counter = _SavedCounter(model, len(found))
    shared = SharedTensors()
    given: dict[int, torch.Tensor] = {}  # id -> a tensor input of an earlier block (held)
    infos = [
        BlockInfo(
            name=b.name,
            index=b.index,
            nbytes=b.nbytes,
            params=0,
            forward_flops=0,
            frozen=not any(slot.trainable for slot in b.layout),
            image_bytes=image_nbytes(b),
        )
        for b in layouts
    ]
    handles = []
    for index, (_, module) in enumerate(found):

        def pre(mod, args, kwargs, index=index):
            counter.segment = index
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            infos[index].input_bytes = sum(_nbytes(t) for t in tensors)
            infos[index].saved_inputs = [_nbytes(t) for t in tensors if id(t) not in given]
            given.update((id(t), t) for t in tensors)
            moved = split_inputs(args, kwargs, shared)[3]
            infos[index].checkpoint_inputs = [_nbytes(t) for t in moved]

        def post(mod, args, kwargs, out, index=index):
            counter.segment = "post"

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    flops = FlopCounterMode(display=False)
    attention = _FlashAttention(counter)
    ops = OpCounter() if ops is None else ops
    ops.segment = lambda: counter.segment
    ops.attach(flops)
    saving = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
    try:
        with flops, attention, ops, saving:
            pred = inputs(model) if callable(inputs) else model(**inputs)
            out = output_tensor(pred).float().pow(2).mean()  # the loss
    finally:
        for h in handles:
            h.remove()
    counts = flops.get_flop_counts()
    total = sum(counts.get("Global", {}).values()) + sum(attention.flops.values())
    forward_ops, forward_moved = sum(ops.ops.values()), sum(ops.moved.values())
    backward_flops = FlopCounterMode(display=False)
    ops.attach(backward_flops)
    counter.segment = "backward"
    with backward_flops, ops:
        out.backward()
    ratio = (
        (backward_flops.get_total_flops() + 2.5 * sum(attention.flops.values())) / max(total, 1),
        ops.ops.get("backward", 0) / max(forward_ops, 1),
        ops.moved.get("backward", 0) / max(forward_moved, 1),
    )
    names = {name: i for i, (name, _) in enumerate(found)}
    for key, per_op in counts.items():
        # FlopCounterMode names modules by their path from the root class name.
        path = key.split(".", 1)[1] if "." in key else None
        if path in names:
            infos[names[path]].forward_flops = int(sum(per_op.values()))
    for info, (_, module) in zip(infos, found, strict=True):
        info.params = sum(p.numel() for p in module.parameters())
        info.param_bytes = sum(_nbytes(p) for p in module.parameters())
        info.layout_bytes = block_bytes([("", module)])[0]
        info.saved = counter.saved[info.index]
        info.forward_flops += attention.flops.get(info.index, 0)
        info.forward_ops = ops.ops.get(info.index, 0)
        info.forward_moved = ops.moved.get(info.index, 0)
    dtype = next((p.dtype for p in params if not p.requires_grad), params[0].dtype)
    return Inventory(
        model_class=type(model).__name__,
        dtype=str(dtype).removeprefix("torch."),
        blocks=infos,
        resident_bytes=resident_bytes,
        nonblock_bytes=nonblock,
        lora_bytes=lora,
        lora_in_blocks=bool(resident),
        optimizer_bytes=2 * lora,
        param_bytes=sum(_nbytes(p) for p in params),
        buffer_bytes=buffers,
        saved_pre=counter.saved["pre"],
        saved_post=counter.saved["post"],
        outside_flops=int(total - sum(i.forward_flops for i in infos)),
        outside_ops=forward_ops - sum(i.forward_ops for i in infos),
        outside_moved=forward_moved - sum(i.forward_moved for i in infos),
        backward_ratio=ratio,
    )
