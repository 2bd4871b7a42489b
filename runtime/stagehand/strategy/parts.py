"""Memory parts: each runtime behind the composed strategy, in one shape.

A ``MemoryPart`` is one runtime (weight streaming, activation spill, the Conductor; layer offload
is a weights part with another schedule) as ``StagehandStrategy`` drives it: a step begins and
ends, each phase gets a context, the part owns its live limits (reads, checks and sets them),
and it reports counters and pinned bytes. The strategy loops over its parts; a runtime that is
off is simply not in the list.

Parts, in the order the strategy calls them (``end_step`` goes the other way)::

    ConductorPart    phases first, so its STEP_BEGIN hints (caps) are in force when the
                     weight runtime prefetches the step's first blocks
    WeightsPart      WeightRuntime: prefetch at STEP_BEGIN; managed forward/backward;
                     trainable weights and optimizer state on the device in OPTIMIZER
    ActivationsPart  ActivationRuntime: step window; spill in FORWARD; restores planned at
                     the start of BACKWARD
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stagehand.common.phases import Phase
from stagehand.conductor import ConductorRuntime
from stagehand.config.limits import (
    ACTIVATION_FIELDS,
    ACTIVATION_PAIR,
    WEIGHT_FIELDS,
    WEIGHT_PAIR,
    check_watermarks,
)
from stagehand.strategy.adapters import ActStagehandConductorAdapter, StagehandConductorAdapter
from stagehand.weights.abort import abort_step
from stagehand.weights.scheduler import BlockScheduler

if TYPE_CHECKING:
    from stagehand.activations import ActivationRuntime
    from stagehand.conductor.adapter import ConductorAdapter
    from stagehand.weights import WeightRuntime

_NOTHING = contextlib.nullcontext()


class MemoryPart:
    """One runtime of the composed strategy (see the module docstring). The base part does
    nothing: subclasses override what their runtime needs.

    ``limits`` names the ``LiveLimits`` fields the part owns; ``packer`` is its
    ``SavedTensorRouter`` packer (None: it packs nothing); ``pinned_owner`` names its pinned
    reservation with the Conductor (None: it holds no pinned pool).
    """

    name = "part"
    limits: tuple[str, ...] = ()
    packer: Callable[[torch.Tensor], Any] | None = None
    pinned_owner: str | None = None

    def begin_step(self, step: int) -> None:
        """STEP_BEGIN of step ``step``."""

    def phase(
        self, phase: Phase, optimizer: torch.optim.Optimizer | None
    ) -> contextlib.AbstractContextManager[Any]:
        """The context the part needs around FORWARD, BACKWARD or OPTIMIZER (entered after the
        strategy installed the saved-tensor router)."""
        return _NOTHING

    def end_step(self) -> None:
        """STEP_END; the step's records are written here."""

    def abort_step(self) -> None:
        """After ``end_step`` of a step left by an error: back to the between-steps state of a
        part just built (NOTE [ Aborted step ] in ``runtime/stagehand/weights/abort.py``); called in the
        order of ``end_step``."""

    def get_limits(self) -> dict[str, Any]:
        """The user's value of each field of ``limits`` (the Conductor's caps not applied)."""
        return {}

    def check_limits(self, given: dict[str, Any], merged: dict[str, Any]) -> None:
        """Check a change: ``given`` the fields of ``limits`` a request sets, ``merged`` every
        field of ``limits`` with the change applied.

        Raises:
            ValueError: naming the field (a low watermark above a high one...).
        """

    def set_limits(self, merged: dict[str, Any]) -> None:
        """Put ``merged`` (every field of ``limits``, checked) in force."""

    def watermarks_changed(self) -> None:
        """A live change moved a watermark, this part's or another's (both runtimes read the
        one device usage), before this STEP_BEGIN's ``begin_step``: what the part derived from
        the budget is derived again, as at a start with the limits in force (NOTE [ Live
        watermarks ] in ``runtime/stagehand/weights/policy.py``)."""

    def counters(self) -> dict[str, int]:
        """This step's work, keys of ``stagehand.strategy.base.COUNTERS`` (summed over parts)."""
        return {}

    def pool_bytes(self) -> int:
        """Host bytes of the part's pool (pinned on CUDA): what it reserves in the Conductor's
        ``pinned_budget_mb``."""
        return 0

    def pinned_bytes(self) -> int:
        """Host bytes the part holds in pools and images (page-locked on CUDA), for the
        trainer's ``pinned_mb``: its pool unless it keeps more."""
        return self.pool_bytes()

    def needs_optimizer(self) -> bool:
        """Whether ``strategy.optimizer()`` must be given the optimizer."""
        return False

    def adapter(self) -> ConductorAdapter | None:
        """The Conductor's adapter for this part's runtime (None: not tuned)."""
        return None

    def close(self) -> None:
        """Free the part's memory; the model's weights are ordinary tensors again."""


class ConductorPart(MemoryPart):
    """The Conductor: phases, budgets and transfer slots (``runtime/stagehand/conductor``)."""

    name = "conductor"

    def __init__(self, conductor: ConductorRuntime) -> None:
        self.conductor = conductor

    def begin_step(self, step: int) -> None:
        self.conductor.begin_step(step)

    def phase(
        self, phase: Phase, optimizer: torch.optim.Optimizer | None
    ) -> contextlib.AbstractContextManager[Any]:
        if phase is Phase.FORWARD:
            self.conductor.enter_forward()
        elif phase is Phase.BACKWARD:
            self.conductor.enter_backward()
        elif phase is Phase.OPTIMIZER:
            self.conductor.enter_optimizer()
        return _NOTHING

    def end_step(self) -> None:
        self.conductor.end_step()

    def abort_step(self) -> None:
        self.conductor.abort_step()

    def counters(self) -> dict[str, int]:
        return self.conductor.counters()

    def close(self) -> None:
        self.conductor.shutdown()


class WeightsPart(MemoryPart):
    """Weight streaming (``WeightRuntime``) and its live limits: the VRAM watermarks, the
    prefetch window and the H2D copies in flight."""

    name = "weights"
    limits = WEIGHT_FIELDS
    pinned_owner = "stagehand"

    def __init__(self, runtime: WeightRuntime) -> None:
        self.runtime = runtime

    @property
    def packer(self) -> Callable[[torch.Tensor], Any]:
        """The runtime's packer now (it swaps it on close; the router reads it per forward)."""
        return self.runtime.packer

    def begin_step(self, step: int) -> None:
        self.runtime.begin_step(step)  # prefetches the step's first blocks

    def phase(
        self, phase: Phase, optimizer: torch.optim.Optimizer | None
    ) -> contextlib.AbstractContextManager[Any]:
        if phase is Phase.FORWARD:
            return self.runtime.managed_forward(install_hooks=False)
        if phase is Phase.BACKWARD:
            return self.runtime.managed_backward()
        if phase is Phase.OPTIMIZER:
            return self.runtime.optimizer_context(optimizer)
        return _NOTHING

    def end_step(self) -> None:
        self.runtime.end_step()

    def abort_step(self) -> None:
        abort_step(self.runtime)

    def get_limits(self) -> dict[str, Any]:
        rt = self.runtime
        return {
            "vram_high_watermark_mb": rt.high_mb,
            "vram_low_watermark_mb": rt.low_mb,
            "prefetch_window_blocks": rt.scheduler.prefetch_window,
            "max_inflight_transfers": rt.transfer.max_inflight,
        }

    def check_limits(self, given: dict[str, Any], merged: dict[str, Any]) -> None:
        check_watermarks(*(merged[name] for name in WEIGHT_PAIR), WEIGHT_PAIR)

    def set_limits(self, merged: dict[str, Any]) -> None:
        rt = self.runtime
        if (merged["vram_high_watermark_mb"], merged["vram_low_watermark_mb"]) != (
            rt.high_mb,
            rt.low_mb,
        ):
            rt.set_watermarks(merged["vram_high_watermark_mb"], merged["vram_low_watermark_mb"])
        if merged["prefetch_window_blocks"] != rt.scheduler.prefetch_window:
            rt.window_grows = False  # the user's window from now on (NOTE [ Window growth ])
        rt.scheduler.prefetch_window = merged["prefetch_window_blocks"]
        rt.transfer.max_inflight = merged["max_inflight_transfers"]

    def watermarks_changed(self) -> None:
        """The blocks kept and the trace are derived again at ``begin_step`` (an activation
        watermark moves the usage the weight watermarks are compared with). Not under a fixed
        schedule (layer offload's ``LayerOrderScheduler``: its order and resident set come
        from the layers, not from a trace or the watermarks)."""
        if type(self.runtime.scheduler) is BlockScheduler:
            self.runtime.settle_due = True

    def counters(self) -> dict[str, int]:
        return self.runtime.counters()

    def pool_bytes(self) -> int:
        return self.runtime.pool.pool_bytes

    def pinned_bytes(self) -> int:
        """The slab pool plus the host cache's images (page-locked on CUDA: cached file-backed
        blocks and registered module-backed ones). The images are sized by ``host_cache_mb``
        from the host's RAM, not reserved in the Conductor's ``pinned_budget_mb``
        (``runtime/stagehand/weights/host_cache.py``)."""
        cache = self.runtime.cache
        return self.pool_bytes() + cache.cached_bytes + cache.registered_bytes

    def needs_optimizer(self) -> bool:
        return any(slot.trainable for block in self.runtime.blocks for slot in block.layout)

    def adapter(self) -> ConductorAdapter:
        return StagehandConductorAdapter(self.runtime)

    def close(self) -> None:
        self.runtime.close()


class ActivationsPart(MemoryPart):
    """Activation spill (``ActivationRuntime``) and its live limits: the spill watermarks and
    the spill (D2H) and restore (H2D) copies in flight."""

    name = "activations"
    limits = tuple(ACTIVATION_FIELDS)
    pinned_owner = "activation_stagehand"

    def __init__(self, runtime: ActivationRuntime) -> None:
        self.runtime = runtime
        self._pageable_at_begin = 0

    @property
    def packer(self) -> Callable[[torch.Tensor], Any]:
        """The runtime's packer now (it swaps it on close; the router reads it per forward)."""
        return self.runtime.packer

    def begin_step(self, step: int) -> None:
        self.runtime.begin_step(step)
        self._pageable_at_begin = self._pageable()

    def phase(
        self, phase: Phase, optimizer: torch.optim.Optimizer | None
    ) -> contextlib.AbstractContextManager[Any]:
        if phase is Phase.FORWARD:
            return self.runtime.managed_forward(install_hooks=False)
        if phase is Phase.BACKWARD:
            self.runtime.backward_begin()
        return _NOTHING

    def end_step(self) -> None:
        self.runtime.end_step()

    def abort_step(self) -> None:
        self.runtime.abort_step()

    def get_limits(self) -> dict[str, Any]:
        rt = self.runtime
        return {
            "activation_vram_high_watermark_mb": rt.budget.high_mb,
            "activation_vram_low_watermark_mb": rt.budget.low_mb,
            "max_inflight_d2h": rt.transfer.max_d2h,
            "max_inflight_h2d": rt.transfer.max_h2d,
        }

    def check_limits(self, given: dict[str, Any], merged: dict[str, Any]) -> None:
        check_watermarks(*(merged[name] for name in ACTIVATION_PAIR), ACTIVATION_PAIR)

    def set_limits(self, merged: dict[str, Any]) -> None:
        rt = self.runtime
        high = merged["activation_vram_high_watermark_mb"]
        low = merged["activation_vram_low_watermark_mb"]
        if (high, low) != (rt.budget.high_mb, rt.budget.low_mb):
            rt.set_watermarks(high, low)
        rt.transfer.max_d2h = merged["max_inflight_d2h"]
        rt.transfer.max_h2d = merged["max_inflight_h2d"]

    def counters(self) -> dict[str, int]:
        m = self.runtime.metrics
        return {
            "pageable_copies": self._pageable() - self._pageable_at_begin,
            "tensors_spilled": m.activations_spilled,
            "tensors_restored": m.activations_restored,
            "spill_bytes": m.spill_bytes,
        }

    def _pageable(self) -> int:
        transfer = self.runtime.transfer
        return transfer.d2h.pageable_copies + transfer.h2d.pageable_copies

    def pool_bytes(self) -> int:
        return self.runtime.pool.total_bytes()

    def adapter(self) -> ConductorAdapter:
        return ActStagehandConductorAdapter(self.runtime)

    def close(self) -> None:
        self.runtime.close()
