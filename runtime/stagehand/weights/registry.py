"""Block registry: find a model's repeated blocks and lay out each block's parameters.

A *block* is one entry of a repeated ``ModuleList`` (``transformer_blocks.3``,
``encoder.layer.0``, ``model.language_model.layers.17``, a UNet's ``down_blocks.1``), or a
stage beside such a list built of the same parts (a UNet's ``mid_block``). Each block has a *layout*: its
parameters' names, shapes, dtypes and byte offsets inside one contiguous buffer, so a block is
loaded with one allocation and one H2D copy. Everything outside the blocks stays resident.

Source: the LTX-2 bf16 on 24 GB case study (block swap, state machine, bug 1: nested
text-encoder layouts such as ``model.language_model.layers``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagehand.weights.errors import BlockDiscoveryError, BlockStateError

ALIGN = 512
"""Byte alignment of each parameter inside a block buffer: as CUDA's caching allocator aligns an
ordinary tensor (and a multiple of the CPU allocator's 64), so a weight view gets the GEMM
kernels an ordinary tensor gets (NOTE [ Exact numbers ] in ``runtime/stagehand/__init__.py``)."""

MIN_SHARE = 0.1
"""A repeated ModuleList holding less than this share of the largest one's bytes stays resident:
streaming it would cost more hooks than the memory it frees."""


class BlockState(enum.Enum):
    """The seed's block lifecycle: UNLOADED -> HOST_STAGED -> PREFETCHING -> GPU_READY ->
    EVICTING -> HOST_STAGED -> GPU_FREEING -> UNLOADED."""

    UNLOADED = "unloaded"
    """No device copy; file-backed weights live only on disk, module-backed on the host."""
    HOST_STAGED = "host_staged"
    """Bytes are in a host staging buffer (slab), or copied back to the host on eviction."""
    PREFETCHING = "prefetching"
    """H2D copy issued on the transfer stream; its event has not been waited on yet."""
    GPU_READY = "gpu_ready"
    """Parameters are views into the block's device buffer; compute may use them."""
    EVICTING = "evicting"
    """Trainable (module-backed) parameters and gradients are being copied back to the host."""
    GPU_FREEING = "gpu_freeing"
    """The device buffer is being released."""


LEGAL: dict[BlockState, frozenset[BlockState]] = {
    BlockState.UNLOADED: frozenset({BlockState.HOST_STAGED}),
    BlockState.HOST_STAGED: frozenset({BlockState.PREFETCHING, BlockState.GPU_FREEING}),
    BlockState.PREFETCHING: frozenset(
        {BlockState.GPU_READY, BlockState.EVICTING, BlockState.GPU_FREEING}
    ),
    BlockState.GPU_READY: frozenset({BlockState.EVICTING, BlockState.GPU_FREEING}),
    BlockState.EVICTING: frozenset({BlockState.HOST_STAGED}),
    BlockState.GPU_FREEING: frozenset({BlockState.UNLOADED}),
}

_ON_DEVICE = (BlockState.PREFETCHING, BlockState.GPU_READY)
"""``Block.on_device``: a module constant, not two enum attribute reads per call (~2.5x faster;
the eviction policy asks it of every block at each use's end)."""


@dataclass(eq=False)
class ParamSlot:
    """One parameter of a block: where it lives in the block buffer and where its bytes come from.

    ``key`` is the checkpoint tensor of a file-backed parameter (None when module-backed);
    ``host`` is the host master copy of a module-backed parameter (the only copy of its data).
    """

    name: str
    qualname: str
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int
    trainable: bool
    key: str | None = None
    host: torch.Tensor | None = None

    stride: tuple[int, ...] = ()
    """Contiguous strides of ``shape`` (parameters are stored contiguously in the buffer)."""
    itemsize: int = 0

    def __post_init__(self) -> None:
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= max(size, 1)
        self.stride = tuple(reversed(strides))

    @property
    def file_backed(self) -> bool:
        return self.key is not None


@dataclass(eq=False)
class Block:
    """One streamed block: ``nbytes`` is the size of its contiguous buffer (aligned layout)."""

    name: str
    index: int
    module: nn.Module
    layout: list[ParamSlot] = field(default_factory=list)
    nbytes: int = 0
    state: BlockState = BlockState.UNLOADED
    flat: torch.Tensor | None = None
    """The device buffer (uint8, ``nbytes``) while PREFETCHING or GPU_READY."""
    load_event: object | None = None
    """The event of the copy that filled ``flat`` (the compute stream waits on it)."""
    read_plan: list | None = None
    """``SafetensorsCheckpoint.plan`` of its file-backed parameters (built at the first load;
    empty without a checkpoint)."""
    read_parts: list | None = None
    """``read_plan`` cut into one part per reader thread (``sources.split_plan``)."""
    staged: list[ParamSlot] = field(default_factory=list)
    """Slots copied into the staging buffer one by one at each load (built with ``read_plan``):
    host masters, and checkpoint tensors stored in another precision."""
    trainable: list[ParamSlot] = field(default_factory=list)
    """Its trainable slots (set by ``register_blocks``): copied back at eviction, their
    gradients follow them to the device."""
    prefetched: bool = False
    """Loaded speculatively and not used yet (a use then counts as a prefetch hit)."""
    dirty: bool = False
    """Its device weights may be newer than its host masters (an optimizer step ran while it
    was loaded, or it was left loaded at a step's end, when the user's code may write weights):
    its next eviction copies them back. Else an eviction copies back only gradients (the
    weights on the device are the masters' own copy)."""
    d2h_event: object | None = None
    """The copy back of trainable parameters to their host masters (read only after it)."""
    resident: bool = False
    """Kept on the device from ``make_resident`` until close: never evicted after a use or by
    the watermarks (layer offload's resident set, ``runtime/stagehand/layer_offload``)."""
    image: Any | None = None
    """SquareQ's 8-bit image of the block (``stagehand.squareq.BlockImage``): what is staged,
    cached and copied, dequantized into ``flat`` on the device. None: ``flat``'s bytes are."""

    @property
    def staged_layout(self) -> list[Any]:
        """The entries staged and copied: the image's, else the layout."""
        return self.image.slots if self.image is not None else self.layout

    @property
    def staged_bytes(self) -> int:
        """Bytes staged on the host and copied H2D per load (the image's, else ``nbytes``)."""
        return self.image.nbytes if self.image is not None else self.nbytes

    def to(self, new: BlockState) -> None:
        """Move to ``new``; raises ``BlockStateError`` naming both states when illegal."""
        if new not in LEGAL[self.state]:
            allowed = " or ".join(sorted(s.name for s in LEGAL[self.state]))
            raise BlockStateError(
                f"block {self.name!r}: illegal transition {self.state.name} -> {new.name} "
                f"(from {self.state.name} expected {allowed})"
            )
        self.state = new

    @property
    def on_device(self) -> bool:
        return self.state in _ON_DEVICE


def find_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """The model's blocks as ``(qualified name, module)`` in registration order.

    With ``pattern`` (a regex, ``re.fullmatch`` on module names) the outermost matching modules
    are the blocks. Without it, every ``ModuleList`` of >= 2 modules that each hold parameters
    and is not inside another such list is a candidate; candidates holding at least
    ``MIN_SHARE`` of the largest candidate's bytes are streamed (Flux: ``transformer_blocks`` and
    ``single_transformer_blocks``; BERT: ``encoder.layer``; Gemma 3:
    ``model.language_model.layers``; a UNet: ``down_blocks`` and ``up_blocks``, whose entries
    are of different classes). A module beside a streamed list that is built like the list's
    entries (it holds lists of the same kinds of part: a UNet's ``mid_block`` of resnets and
    attentions beside its down and up blocks) is one more block (NOTE [ Stage siblings ]). An
    entry that is itself a ``ModuleList`` or ``ModuleDict`` (never called) gives its entries.

    Raises:
        BlockDiscoveryError: nothing matched (names the pattern or the model class).
    """
    if pattern is not None:
        regex = re.compile(pattern)
        found: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if (
                name
                and regex.fullmatch(name)
                and not any(name.startswith(f + ".") for f, _ in found)
            ):
                found.append((name, module))
        if not found:
            raise BlockDiscoveryError(
                f"block_pattern {pattern!r} matched no module of {type(model).__name__}"
            )
        return _callable(found)
    candidates: list[tuple[str, nn.ModuleList, int]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if not all(_holds_parameters(child) for child in module):
            continue  # e.g. attn.to_out: [Linear, Dropout]
        if any(name.startswith(c + ".") for c, _, _ in candidates):
            continue  # nested inside a list already chosen
        candidates.append((name, module, _nbytes(module)))
    if not candidates:
        raise BlockDiscoveryError(
            f"no repeated blocks found in {type(model).__name__}: no ModuleList of >= 2 modules "
            "that hold parameters; pass block_pattern"
        )
    largest = max(c[2] for c in candidates)
    chosen = [
        (name, module) for name, module, nbytes in candidates if nbytes >= MIN_SHARE * largest
    ]
    stages = _stage_siblings(model, chosen)
    blocks = [
        (f"{name}.{i}" if name else str(i), child)
        for name, module in chosen
        if not any(name.startswith(s + ".") for s, _ in stages)
        for i, child in enumerate(module)
    ]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return _callable(sorted(blocks + stages, key=lambda b: order[b[0]]))


def _callable(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``blocks`` with each container (``ModuleList``, ``ModuleDict``: a list of lists, stages
    of named layers) replaced by its parameter-holding entries, recursively: a container is
    never called, so a block boundary on it would never fire (its weights never loaded)."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in blocks:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            entries = [
                (f"{name}.{key}" if name else key, child)
                for key, child in module.named_children()
                if _holds_parameters(child)
            ]
            out.extend(_callable(entries))
        else:
            out.append((name, module))
    return out


# NOTE [ Stage siblings ]
# A UNet streams its stages: ``down_blocks`` and ``up_blocks`` are lists, but ``mid_block``, the
# stage between them, is a plain attribute. What marks it as a stage rather than an embedding
# or a norm is what it is made of: lists of resnets and attentions, the kinds of part the down
# and up blocks hold in their own lists. A transformer's embedders hold no such lists, so its
# blocks are unchanged. Sizes are never assumed: the sibling is found from the model alone.


def _stage_siblings(
    model: nn.Module, chosen: list[tuple[str, nn.ModuleList]]
) -> list[tuple[str, nn.Module]]:
    """Modules beside a chosen list that hold lists of the same kinds of part as its entries."""
    modules = dict(model.named_modules())
    out: list[tuple[str, nn.Module]] = []
    for name, module in chosen:
        kinds = set().union(*(_part_kinds(child) for child in module))
        parent = name.rpartition(".")[0]
        for child_name, child in modules[parent].named_children():
            qual = f"{parent}.{child_name}" if parent else child_name
            if (
                isinstance(child, nn.ModuleList)
                or any(qual == c for c, _ in chosen)
                or any(qual == s for s, _ in out)
            ):
                continue
            if _part_kinds(child) & kinds and _holds_parameters(child):
                out.append((qual, child))
    return out


def _part_kinds(module: nn.Module) -> set[type]:
    """Classes of the parameter-holding entries of the lists that are ``module``'s children."""
    return {
        type(entry)
        for child in module.children()
        if isinstance(child, nn.ModuleList)
        for entry in child
        if _holds_parameters(entry)
    }


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def build_layout(
    block: Block, qualnames: dict[nn.Parameter, str], resident: frozenset[int] = frozenset()
) -> None:
    """Fill ``block.layout`` and ``block.nbytes`` from the module's parameters (aligned
    offsets), leaving out those whose ``id`` is in ``resident`` (they stay on the device)."""
    offset = 0
    for name, param in block.module.named_parameters():
        if id(param) in resident:
            continue
        nbytes = param.numel() * param.element_size()
        block.layout.append(
            ParamSlot(
                name=name,
                qualname=qualnames[param],
                param=param,
                shape=param.shape,
                dtype=param.dtype,
                offset=offset,
                nbytes=nbytes,
                trainable=param.requires_grad,
            )
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    block.nbytes = offset
