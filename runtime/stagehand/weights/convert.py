"""Set-up: register the blocks, bind each block parameter to its source, place the rest.

File-backed conversion (the seed's ``convert_registry_to_file_backed_sharded``): with a
checkpoint folder, every frozen block parameter is matched to a checkpoint tensor and the
module's own copy is released; a parameter that matches no key, or whose shape or dtype
differs, raises at set-up naming it (never filled with zeros). Trainable parameters (LoRA
``lora_A``/``lora_B``, a fully fine-tuned block) are module-backed: their host master is the
only copy, preserved on eviction. A model built on the ``meta`` device (no weights in RAM) gets
its parameters from the checkpoint: resident ones are read once, block ones stream.
"""

from __future__ import annotations

import torch
from torch import nn

from stagehand.common.device import ordinary
from stagehand.config.memory import MB
from stagehand.weights.errors import (
    BlockTooLargeError,
    ParameterMismatchError,
    UnmatchedParameterError,
)
from stagehand.weights.pool import PinnedPool
from stagehand.weights.registry import Block, BlockState, build_layout
from stagehand.weights.sources import SafetensorsCheckpoint
from stagehand.weights.transfer import placeholder


def _checked_key(
    source: SafetensorsCheckpoint, name: str, shape: torch.Size, dtype: torch.dtype
) -> str:
    key = source.resolve(name)
    entry = source.entries[key]
    # Another floating precision is converted as it is read (a model loaded with torch_dtype=);
    # anything else would be reinterpreted bytes.
    castable = dtype.is_floating_point and entry.dtype.is_floating_point
    if tuple(shape) != entry.shape or (dtype != entry.dtype and not castable):
        raise ParameterMismatchError(
            f"parameter {name!r}: model has shape {tuple(shape)} {dtype}, checkpoint tensor "
            f"{key!r} has shape {entry.shape} {entry.dtype}"
        )
    return key


def _in_checkpoint(source: SafetensorsCheckpoint | None, name: str) -> bool:
    if source is None:
        return False
    try:
        source.resolve(name)
    except UnmatchedParameterError:
        return False
    return True


def _replace_param(
    model: nn.Module, qualname: str, data: torch.Tensor, requires_grad: bool
) -> nn.Parameter:
    # A meta parameter cannot take CPU data through ``.data`` (incompatible tensor type), so
    # the Parameter object itself is replaced; this happens before any optimizer exists.
    owner_name, _, leaf = qualname.rpartition(".")
    owner = model.get_submodule(owner_name)
    new = nn.Parameter(data, requires_grad=requires_grad)
    owner._parameters[leaf] = new
    return new


def register_blocks(
    model: nn.Module,
    found: list[tuple[str, nn.Module]],
    source: SafetensorsCheckpoint | None,
    file_backed: bool,
    pin_trainable: bool,
    inference: bool = False,
    resident_trainable_max_fraction: float = 0.0,
) -> list[Block]:
    """Blocks with layouts and sources; every block parameter released to its UNLOADED form.

    In training, trainable block parameters (LoRA adapters) are left out of the layouts, to stay
    resident on the device, when their bytes are at most ``resident_trainable_max_fraction`` of
    the blocks' bytes (NOTE [ H2D-only streaming ]).

    Raises:
        UnmatchedParameterError: a parameter has no checkpoint tensor (or is on ``meta`` with no
            checkpoint to read it from).
        ParameterMismatchError: shape or dtype differ from the checkpoint tensor.

    A parameter shared by several blocks, or by a block and a module outside the blocks (tied
    weights), stays resident (NOTE [ Shared parameters ]).
    """
    qualnames = {p: n for n, p in model.named_parameters()}
    resident = shared_parameters(model, found) | (
        frozenset() if inference else _resident_trainable(found, resident_trainable_max_fraction)
    )
    blocks = []
    for index, (name, module) in enumerate(found):
        block = Block(name=name, index=index, module=module)
        build_layout(block, qualnames, resident)
        for slot in block.layout:
            # Inference mode never updates weights: ``requires_grad`` left on by a loader
            # (transformers leaves it on) must not keep a text encoder off the file path. An
            # adapter added after loading (LoRA) has no checkpoint tensor: it stays module-backed.
            if inference and slot.trainable:
                slot.trainable = not _in_checkpoint(source, slot.qualname)
            meta = slot.param.device.type == "meta"
            key = None
            if source is not None and ((file_backed and not slot.trainable) or meta):
                key = _checked_key(source, slot.qualname, slot.shape, slot.dtype)
            elif meta:
                raise UnmatchedParameterError(
                    f"parameter {slot.qualname!r} is on the meta device and no checkpoint_dir was given"
                )
            if file_backed and key is not None and not slot.trainable:
                slot.key = key
                data = placeholder(slot.dtype)
            else:
                host = source.load(key, slot.dtype) if meta else slot.param.data
                if host.device.type != "cpu":
                    host = host.cpu()
                if slot.trainable and pin_trainable:
                    host = host.pin_memory()  # D2H copies back on eviction run asynchronously
                slot.host = data = host
            if meta:
                slot.param = _replace_param(model, slot.qualname, data, slot.trainable)
            else:
                slot.param.data = data
        block.trainable = [slot for slot in block.layout if slot.trainable]
        block.state = BlockState.UNLOADED
        blocks.append(block)
    return blocks


# NOTE [ H2D-only streaming ]
# A LoRA adapter is ~1-3% of a model. Streamed with its block, it would be copied back to the
# host at every eviction (forward and backward), and its gradients and AdamW state gathered to
# the device for every optimizer step, through host memory: gigabytes per step for a large model
# (the peers' "H2D-only ring" streams frozen weights only). Kept resident on the device, frozen
# weights only ever move host -> device, nothing is copied back, and the optimizer finds
# parameters, gradients and state where they are. A full fine-tune (every block parameter
# trainable) is far above the fraction: its blocks stream with a copy back, as before.


# NOTE [ Shared parameters ]
# A parameter object can sit in several modules (tied weights: an embedding shared with the
# head, a projection shared by two blocks). Streamed with one block, it would be a view of that
# block's buffer while another block, or a resident module, computes with it: evicted, it is an
# empty placeholder (file-backed) or the host master (the wrong device on a GPU); laid out in two
# blocks, the second layout would read the placeholder the first one left. Such a parameter is
# left out of every layout and stays resident, as the plain model has it (numbers unchanged).


def shared_parameters(model: nn.Module, found: list[tuple[str, nn.Module]]) -> frozenset[int]:
    """``id`` of every parameter reachable from more than one block, or from a block and a
    module outside the blocks (see the NOTE)."""
    blocks = [name + "." if name else "" for name, _ in found]
    owners: dict[int, set[int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = next((i for i, prefix in enumerate(blocks) if name.startswith(prefix)), -1)
        owners.setdefault(id(param), set()).add(owner)
    in_blocks = {id(p) for _, module in found for p in module.parameters()}
    return frozenset(k for k, seen in owners.items() if len(seen) > 1 and k in in_blocks)


def _resident_trainable(found: list[tuple[str, nn.Module]], max_fraction: float) -> frozenset[int]:
    params = {id(p): p for _, module in found for p in module.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in trainable)
    if not trainable or nbytes > max_fraction * total:
        return frozenset()
    return frozenset(id(p) for p in trainable)


def check_sizes(blocks: list[Block], pool: PinnedPool, device: torch.device) -> None:
    """Refuse, at set-up, a block that cannot be staged or placed at all.

    A block larger than a slab takes the direct path; larger than the whole pinned pool (the
    host staging budget) or than the device's memory it cannot load, and would otherwise fail
    on its first load (a defect of the public implementation).

    Raises:
        BlockTooLargeError: names the block and the sizes involved (MB).
    """
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for block in blocks:
        if block.staged_bytes > pool.pool_bytes:
            raise BlockTooLargeError(
                f"block {block.name!r} needs {block.staged_bytes / MB:.2f} MB, more than the whole pinned "
                f"pool ({pool.pool_bytes / MB:.2f} MB, pinned_pool_mb); raise pinned_pool_mb"
            )
        if total is not None and block.nbytes > total:
            raise BlockTooLargeError(
                f"block {block.name!r} needs {block.nbytes / MB:.2f} MB, more than the device's "
                f"{total / MB:.2f} MB"
            )


def place_resident(
    model: nn.Module,
    blocks: list[Block],
    source: SafetensorsCheckpoint | None,
    device: torch.device,
) -> int:
    """Move everything outside the blocks (and every buffer) to ``device`` in ordinary
    allocations (``own_storage``: no view into an mmap'd file); returns its bytes.

    Raises:
        UnmatchedParameterError / ParameterMismatchError: a ``meta`` tensor cannot be read.
    """
    streamed = {id(slot.param) for block in blocks for slot in block.layout}
    nbytes = 0
    for name, param in list(model.named_parameters()):
        if id(param) in streamed:
            continue
        if param.device.type == "meta":
            if source is None:
                raise UnmatchedParameterError(
                    f"parameter {name!r} is on the meta device and no checkpoint_dir was given"
                )
            key = _checked_key(source, name, param.shape, param.dtype)
            data = source.load(key, param.dtype).to(device)
            param = _replace_param(model, name, data, param.requires_grad)
        else:
            param.data = ordinary(param.data.to(device))
        nbytes += param.numel() * param.element_size()
    for module_name, module in model.named_modules():
        for leaf, buf in list(module._buffers.items()):
            if buf is None:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            if buf.device.type == "meta":
                if source is None:
                    raise UnmatchedParameterError(
                        f"buffer {name!r} is on the meta device and no checkpoint_dir was given"
                    )
                buf = source.load(_checked_key(source, name, buf.shape, buf.dtype), buf.dtype)
            module._buffers[leaf] = buf = ordinary(buf.to(device))
            nbytes += buf.numel() * buf.element_size()
    return nbytes


def restore_blocks(
    blocks: list[Block], source: SafetensorsCheckpoint | None, device: torch.device
) -> None:
    """Every (evicted) block parameter becomes an ordinary tensor on ``device`` again: read from
    its checkpoint tensor (file-backed) or copied from its host master (module-backed)."""
    # Asynchronous H2D on CUDA: ordered before any later use on the compute stream, no host wait
    # per parameter (a pinned master is guarded by the host allocator's events, a pageable one is
    # staged by the driver before the call returns).
    non_blocking = device.type == "cuda"
    for block in blocks:
        if block.image is not None:  # SquareQ: the dequantized weights a load binds
            block.image.restore(source, device)
            continue
        for slot in block.layout:
            data = slot.host if slot.key is None else source.load(slot.key, slot.dtype)
            slot.param.data = data.to(device, copy=slot.key is None, non_blocking=non_blocking)
            if slot.param.grad is not None:
                slot.param.grad = slot.param.grad.to(device, non_blocking=non_blocking)
