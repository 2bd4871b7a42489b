"""``OffloadCheckpointLayer``: non-reentrant gradient checkpointing plus before/after callbacks.

Source: the Flux 2048 px layer-offload case study ("OffloadCheckpointLayer", "The
kwargs bug"). Each block of the model is replaced, in its ``ModuleList`` (Flux's
``transformer_blocks`` and ``single_transformer_blocks``, SD3's ``transformer_blocks``), by a
wrapper whose forward runs ``checkpoint(run, ..., use_reentrant=False)`` where ``run`` calls
``before_layer``, the block, then ``after_layer``.

# NOTE [ Checkpoint inputs as activations ]
Non-reentrant ``torch.utils.checkpoint`` keeps a region's *positional* tensor inputs as saved
tensors (``_CheckpointFrame.save_inputs``, before its own hooks are entered, so the strategy's
``SavedTensorRouter`` sees them) and everything passed as a keyword argument, or nested in a
tuple, dict or dataclass, by plain reference. Diffusers calls its blocks with keyword arguments
only (``hidden_states=``, ``encoder_hidden_states=``, ``temb=``, ``image_rotary_emb=(cos, sin)``),
so a naive wrapper would leave every activation on the device: the seed's kwargs bug. The
wrapper therefore flattens every tensor it is given (positional, keyword, inside tuples, lists,
dicts and dataclasses) into positional checkpoint inputs and rebuilds the call inside the
region; the activation runtime then moves them to the host after the layer and back before its
recomputation. In ``run`` every flattened tensor is moved to the compute device, so a tensor
that arrives on the host (restored late, or passed by a caller from the host) is placed before
the block computes.

A tensor passed again to a later layer of the same forward (``temb``, ``image_rotary_emb``: one
object for every block) is *shared*: the layers still to run need it on the device anyway, so a
host copy per layer would move bytes without freeing any. Shared tensors go to the region by
reference (the rebuild closure), like the peers' kwargs did.

# NOTE [ Transparent wrapper ]
The wrapper shares its block's ``_parameters``, ``_buffers`` and ``_modules`` dicts instead of
registering the block as a child: parameter names, ``state_dict`` keys (LoRA files, trainer
checkpoints, peft) and attribute access (``wrapper.attn``) are the block's own, whether or not
the wrapper is installed. Any other attribute the wrapper lacks is read from the block: models
ask their blocks about themselves (SDXL's UNet passes ``encoder_hidden_states`` only to a block
whose ``has_cross_attention`` is true; without it a cross-attention block attended to itself
and failed on the text width). ``uninstall`` puts the original block back into its list.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagehand.common.nested import flatten, in_backward

Callback = Callable[[int, bool], None]
"""``callback(layer_index, recompute)``: ``recompute`` is True inside a checkpoint's
recomputation during backward."""


class OffloadCheckpointLayer(nn.Module):
    """One block behind checkpointing and the manager's callbacks.

    Args:
        layer: the block (its forward hooks, e.g. the weight runtime's, stay in force).
        index: the block's index in the runtime's block list.
        device: the compute device: every tensor input is moved there before the block runs.
        before_layer, after_layer: ``Callback``; ``after_layer`` does not fire when a
            recomputation stops early (``torch.utils.checkpoint`` early stop), see the manager.
        checkpointing: wrap the block in non-reentrant checkpointing when grad is enabled.
        shared: ``is_shared(tensor) -> bool``: pass this tensor by reference (see the NOTE).
        non_blocking: H2D copies of host inputs with ``non_blocking`` (CUDA, pinned sources).
    """

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        *,
        device: torch.device,
        before_layer: Callback,
        after_layer: Callback,
        checkpointing: bool = True,
        shared: Callable[[torch.Tensor], bool] | None = None,
        non_blocking: bool = False,
    ) -> None:
        super().__init__()
        # See NOTE [ Transparent wrapper ]: the block is not a registered child.
        object.__setattr__(self, "layer", layer)
        self.__dict__["_parameters"] = layer._parameters
        self.__dict__["_buffers"] = layer._buffers
        self.__dict__["_modules"] = layer._modules
        self.index = index
        self.device = torch.device(device)
        self.before_layer = before_layer
        self.after_layer = after_layer
        self.checkpointing = checkpointing
        self.shared = shared
        self.non_blocking = non_blocking
        self.training = layer.training
        self.pageable_copies = 0
        """Host inputs moved to a CUDA device from pageable memory (synchronous copies): the
        layer-offload part's ``pageable_copies`` counts them with the runtimes' own."""

    def __getattr__(self, name: str) -> Any:
        """The block's attribute where the wrapper has none (NOTE [ Transparent wrapper ]).

        Raises:
            AttributeError: neither the wrapper nor the block has ``name``.
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def train(self, mode: bool = True) -> OffloadCheckpointLayer:
        self.layer.train(mode)
        self.training = mode
        return self

    def extra_repr(self) -> str:
        return f"index={self.index}, layer={type(self.layer).__name__}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rebuild, slots, by_ref, moved = split_inputs(args, kwargs, self.shared)
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._run, rebuild, slots, by_ref, *moved, use_reentrant=False)
        return self._run(rebuild, slots, by_ref, *moved)

    def _run(
        self,
        rebuild: Callable[[list[torch.Tensor]], Any],
        slots: list[tuple[bool, int]],
        by_ref: list[torch.Tensor],
        *moved: torch.Tensor,
    ) -> Any:
        recompute = in_backward()
        self.before_layer(self.index, recompute)
        tensors = [by_ref[i] if held else moved[i] for held, i in slots]
        # The kwargs fix: every tensor, however it was passed, is on the device before compute.
        if self.device.type == "cuda":
            self.pageable_copies += sum(
                1 for t in tensors if t.device.type == "cpu" and not t.is_pinned()
            )
        tensors = [t.to(self.device, non_blocking=self.non_blocking) for t in tensors]
        args, kwargs = rebuild(tensors)
        out = self.layer(*args, **kwargs)
        self.after_layer(self.index, recompute)
        return out


def split_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shared: Callable[[torch.Tensor], bool] | None,
) -> tuple[Callable[[list[torch.Tensor]], Any], list[tuple[bool, int]], list, list]:
    """A layer call's tensors as checkpoint inputs: ``(rebuild, slots, by_ref, moved)``.

    ``moved``: the tensors passed as positional checkpoint inputs, saved tensors the activation
    runtime may move to the host; ``by_ref``: the shared ones (``shared(t)`` True), held as they
    are (see NOTE [ Checkpoint inputs as activations ]); ``slots``: for each tensor of
    ``flatten((args, kwargs))`` in order, ``(held by reference, index in its group)``. The
    planner calls this too, for the bytes a layer's checkpoint saves (``plan``).
    """
    tensors: list[torch.Tensor] = []
    rebuild = flatten((args, kwargs), tensors)
    by_ref: list[torch.Tensor] = []
    moved: list[torch.Tensor] = []
    slots: list[tuple[bool, int]] = []
    for t in tensors:
        held = shared is not None and shared(t)
        group = by_ref if held else moved
        slots.append((held, len(group)))
        group.append(t)
    return rebuild, slots, by_ref, moved


class SharedTensors:
    """``shared(tensor, owner)``: True when ``tensor`` (the same object) was already passed to a
    layer of this forward, other than ``owner`` (the calling layer's index; None: any layer)
    (see NOTE [ Checkpoint inputs as activations ]); ``clear()`` at each forward. Weak
    references: a tensor freed and another allocated at its id is not taken for it.

    A layer called again with the same tensors gets the same answer: a checkpoint of the
    model's own around a wrapped layer (one this runtime cannot switch off) recomputes the
    wrapper with the same objects, and its checkpoint must save what the first call saved.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, int | None]] = {}

    def __call__(self, tensor: torch.Tensor, owner: int | None = None) -> bool:
        key = id(tensor)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is tensor:
            return owner is None or seen[1] != owner
        self._seen[key] = (weakref.ref(tensor), owner)
        return False

    def clear(self) -> None:
        self._seen.clear()


def install(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    make: Callable[[int, nn.Module], nn.Module],
) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace each block ``(qualified name, module)`` in its parent by ``make(index, module)``;
    return ``(parent, key, original)`` for ``uninstall``.

    Raises:
        ValueError: a block is the model itself (it has no parent to be replaced in).
    """
    installed = []
    for index, (name, module) in enumerate(blocks):
        if not name:
            raise ValueError("the model itself cannot be wrapped as a layer: it has no parent")
        parent_name, _, key = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if parent._modules.get(key) is not module:
            raise ValueError(
                f"block {name!r} is not module {key!r} of {parent_name or 'the model'}"
            )
        parent._modules[key] = make(index, module)
        installed.append((parent, key, module))
    return installed


def uninstall(installed: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put every original block back into its parent."""
    for parent, key, module in installed:
        parent._modules[key] = module
