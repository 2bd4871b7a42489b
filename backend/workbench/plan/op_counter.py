"""The inventory's operation counter, which measures each distinct operation once (issue 58).

``workbench.plan.inventory`` measures a model by one forward and one backward on ``meta``
tensors under ``FlopCounterMode`` and ``OpCounter`` (operations and bytes moved per segment:
before the blocks, block i, after them, the backward). Nothing runs on ``meta``, but every call
still passes through ``FlopCounterMode`` and a meta function that works out its output's shape
and strides, most of them Python (``torch._refs``, ``torch._prims``, ``torch._decomp``): 48 s
of CPU for LTX-2's plan, whose 48 blocks repeat the same calls on inputs of the same shapes.

What the counters add for a call is a function of its *signature*: the operator overload and
every argument, a tensor by its shape, strides, storage offset, dtype, device, layout,
``requires_grad`` and conjugate/negative bits, anything else by its type and value (``1``,
``1.0`` and ``True`` kept apart). ``FlopCounterMode`` adds a formula of the shapes (summed over
the operations it decomposes a call into) to each module in its tracker's ``parents``;
``OpCounter`` adds one operation and the bytes of the tensors in and out. So ``OpCounter``, the
outermost dispatch mode, sends the first call of each signature through ``FlopCounterMode`` and
the meta function, keeping the FLOPs the counter added (per operator) and, for a functional
operation whose outputs are fresh ``meta`` tensors, their shapes, strides and dtypes. A later
call of that signature adds those FLOPs to the current ``parents`` itself, as
``FlopCounterMode._count_flops`` would, and returns new ``meta`` tensors of those shapes and
strides (``meta`` tensors hold no values: nothing else tells two outputs apart); a view, an
in-place or ``out=`` operation (a schema naming an alias: its outputs are inputs or views of
them) or one with other outputs runs as ``FlopCounterMode`` runs it, under no mode. The saved
activations, the autograd graph and its backward see the same calls and tensors of the same
shapes, so every figure of the inventory is the uncached pass's (``cache=False`` is that pass,
the planner's before issue 58; ``tests/plan/test_inventory_shapes.py`` compares the two field by
field). ``measured`` and ``reused`` count the calls of each kind per segment: LTX-2's first
block measures 259 of its 780 calls, the second 2, the other 46 none (12 s of CPU in all).
What was measured is kept for the process (``KNOWN``): a model planned again measures nothing
(the planner's tests and the plan API's: 102.6 -> 91.4 CPU-s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

PRODUCTS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten.convolution.default",
    "aten.convolution_backward.default",
}
"""Matrix products and attention: their bytes are not counted as moved (compute-bound)."""
FREE = {"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.detach.default"}
"""Metadata-only operations (with every view and expand): no kernel runs, nothing is counted."""

_SCALARS = {int, float, bool, complex, str, type(None), torch.dtype, torch.device}
_SCALARS |= {torch.memory_format, torch.layout}
_SEQUENCES = {tuple, list, torch.Size}
_TENSORS = {torch.Tensor, torch.nn.Parameter}
_NO_KEY = object()


def _key(value: Any) -> Any:
    """``value``'s part of a signature, or ``_NO_KEY`` (the call is then always measured)."""
    kind = type(value)
    if kind in _TENSORS:
        if value.layout != torch.strided:
            return _NO_KEY
        return (
            value.shape,
            value.stride(),
            value.storage_offset(),
            value.dtype,
            value.device,
            value.requires_grad,
            value.is_conj(),
            value.is_neg(),
        )
    if kind in _SEQUENCES:
        parts = tuple(map(_key, value))
        return _NO_KEY if _NO_KEY in parts else (kind, parts)
    if kind in _SCALARS:
        return (kind, value)
    return _NO_KEY


def _functional(func: Any) -> bool:
    """No argument or output of ``func``'s schema aliases or writes another."""
    schema = func._schema
    aliases = any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
    return not aliases and not schema.is_mutable


def _fresh(t: Any) -> bool:
    """A ``meta`` tensor of its own storage, exactly its extent (what ``empty_strided`` makes;
    a tensor elsewhere holds values, which a cached call would not make again)."""
    if type(t) is not torch.Tensor or t.device.type != "meta" or t.layout != torch.strided:
        return False
    if t.storage_offset() != 0 or t.is_conj() or t.is_neg():
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().nbytes() == (extent if t.numel() else 0) * t.element_size()


def _outputs(out: Any, args: tuple, kwargs: dict) -> Any:
    """What makes ``out`` again: ``(is_tuple, ((shape, strides, dtype, device), ...))``, or None
    unless ``out`` is fresh tensors of distinct storages, none an input's."""
    tensors = out if isinstance(out, tuple) else (out,)
    if not tensors or not all(_fresh(t) for t in tensors):
        return None
    storages = {t.untyped_storage()._cdata for t in tensors}
    if len(storages) != len(tensors):
        return None
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.untyped_storage()._cdata in storages for t in inputs):
        return None
    return isinstance(out, tuple), tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


Known = dict[Any, tuple[tuple[tuple[Any, int], ...], Any]]
"""What each signature adds (the FLOPs per operator) and makes (its outputs' shapes, strides,
dtypes and devices, or None), by signature."""

KNOWN: Known = {}
"""The signatures this process has measured, which every later ``OpCounter`` reuses: what a
signature adds is a function of the signature alone (module docstring), so a plan of a model
planned before (the server's next run of a preset, the Tune page's proposals, a LoRA rank
changed) measures nothing again. Emptied when it reaches ``KNOWN_CAP`` entries."""
KNOWN_CAP = 100_000
"""A few hundred bytes an entry: a server planning many models keeps some tens of MB at most."""


class OpCounter(TorchDispatchMode):
    """Operations and bytes moved per segment (``segment()``, the inventory's: a block's index,
    ``"pre"``, ``"post"``, ``"backward"``; see ``BlockInfo.forward_moved``), the outermost
    dispatch mode, over the ``FlopCounterMode`` that ``attach`` names; with ``cache``, each
    distinct signature is measured once (module docstring): once per process (``KNOWN``), or
    once per ``known`` given (a fresh dict: once per counter)."""

    def __init__(self, *, cache: bool = True, known: Known | None = None) -> None:
        super().__init__()
        self.segment: Callable[[], Any] = lambda: None
        self.cache = cache
        self.ops: dict[Any, int] = {}
        self.moved: dict[Any, int] = {}
        self.measured: dict[Any, int] = {}
        self.reused: dict[Any, int] = {}
        self._known: Known = KNOWN if known is None else known
        self._flops: FlopCounterMode | None = None
        self._counted: list[tuple[Any, int]] | None = None
        self._composite: dict[Any, bool] = {}

    def attach(self, flops: FlopCounterMode) -> None:
        """Count under ``flops``, not yet entered (to be entered just before this mode).
        With ``cache``, what it adds per operation is kept: its ``_count_flops`` is wrapped
        for that, and its module tracker is a ``_ForwardTracker``; a FLOP counter without
        those parts (another torch) is left as it is, and every call measured."""
        self._flops = None
        parts = ("_count_flops", "flop_counts", "flop_registry", "mod_tracker")
        if not self.cache or not all(hasattr(flops, n) for n in parts):
            return
        self._flops = flops
        if type(flops.mod_tracker) is ModuleTracker and _ForwardTracker.fits():
            flops.mod_tracker = _ForwardTracker()
        count = flops._count_flops

        def counting(packet, out, args, kwargs):
            before = flops.flop_counts.get("Global", {}).get(packet, 0)
            result = count(packet, out, args, kwargs)
            if self._counted is not None and packet in flops.flop_registry:
                self._counted.append((packet, flops.flop_counts["Global"][packet] - before))
            return result

        flops._count_flops = counting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = self.segment()
        key = None
        if self._flops is not None and isinstance(func, torch._ops.OpOverload):
            key = (func, _key(args), _key(tuple(sorted(kwargs.items()))))
            if _NO_KEY in key:
                key = None
        known = self._known.get(key) if key is not None else None
        if known is None:
            self.measured[where] = self.measured.get(where, 0) + 1
            out = self._measure(key, func, args, kwargs)
        else:
            self.reused[where] = self.reused.get(where, 0) + 1
            out = self._reuse(known, func, args, kwargs)
        self._count(where, func, args, kwargs, out)
        return out

    def _measure(self, key, func, args, kwargs):
        if key is None:
            return func(*args, **kwargs)
        self._counted = []
        try:
            out = func(*args, **kwargs)
            counted = tuple(self._counted)
        finally:
            self._counted = None
        if len(self._known) >= KNOWN_CAP:
            self._known.clear()
        self._known[key] = (counted, _outputs(out, args, kwargs) if _functional(func) else None)
        return out

    def _reuse(self, known, func, args, kwargs):
        counted, outputs = known
        if counted:
            flops = self._flops
            for parent in set(flops.mod_tracker.parents):
                for packet, n in counted:
                    flops.flop_counts[parent][packet] += n
        with torch._C._DisableTorchDispatch():  # the modes under this one left out
            if outputs is not None:
                is_tuple, metas = outputs
                made = tuple(
                    torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    for shape, stride, dtype, device in metas
                )
                return made if is_tuple else made[0]
            # As FlopCounterMode runs it: decomposed when it is not in the FLOP registry (which
            # holds overload packets, not overloads: every operation) and has a
            # CompositeImplicitAutograd kernel (what ``decompose`` runs).
            if func not in self._flops.flop_registry and self._decomposes(func):
                out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return func(*args, **kwargs)

    def _decomposes(self, func: Any) -> bool:
        composite = torch._C.DispatchKey.CompositeImplicitAutograd
        if func is torch.ops.prim.device.default:
            return False
        if composite in func.py_kernels:
            return True
        known = self._composite.get(func)
        if known is None:
            known = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), composite)
            self._composite[func] = known
        return known

    def _count(self, where, func, args, kwargs, out) -> None:
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(str(func))
        if kind == "free":
            return  # metadata only: no kernel runs
        self.ops[where] = self.ops.get(where, 0) + 1
        if kind != "product":
            outs = out if isinstance(out, tuple) else (out,)
            moved = sum(
                t.numel() * t.element_size()
                for t in (*args, *kwargs.values(), *outs)
                if isinstance(t, torch.Tensor)
            )
            self.moved[where] = self.moved.get(where, 0) + moved


class _ForwardTracker(ModuleTracker):
    """``ModuleTracker``'s forward bookkeeping (module names, ``parents``) without the gradient
    hooks it adds to each module's tensors for a backward: the inventory exits its forward
    ``FlopCounterMode``, which removes them unfired, before its backward (under another
    counter) runs. Registering them cost LTX-2's plan some 4 s of CPU (17 s with them)."""

    @staticmethod
    def fits() -> bool:
        """The tracker's own hooks are what this one overrides (torch 2.11 to 2.13)."""
        names = ("_fw_pre_hook", "_fw_post_hook", "_get_mod_name", "_get_append_fn")
        return all(hasattr(ModuleTracker, n) for n in (*names, "_get_pop_fn"))

    def _fw_pre_hook(self, mod, input) -> None:
        self._get_append_fn(self._get_mod_name(mod), False)()

    def _fw_post_hook(self, mod, input, output) -> None:
        self._get_pop_fn(self._get_mod_name(mod), False)()


_KINDS: dict[Any, str] = {}


def _kind(name: str) -> str:
    if name in FREE or "view" in name or name.startswith("aten.expand"):
        return "free"
    return "product" if name in PRODUCTS else "moved"
