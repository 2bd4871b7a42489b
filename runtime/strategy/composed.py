"""StagehandStrategy: weight streaming, activation spill and the Conductor behind one object.

Source: ``shared/seeds/activation-stagehand.md`` ("Integration": the activation runtime's step
nests inside the weight runtime's) and ``shared/seeds/conductor.md`` ("Integration Point").
Each part is on or off independently:

- weight runtime (``StagehandRuntime``): ``memory.stagehand.weight_streaming`` (off: every
  weight stays resident on the device, for activation spill and/or the Conductor alone);
- activation runtime (``ActivationRuntime``): ``memory.stagehand.activation_stagehand.enabled``,
  training mode only (inference saves nothing for backward);
- Conductor: ``memory.stagehand.conductor_config.enabled``.

One step, as ``MemoryStrategy`` drives it::

    STEP_BEGIN  conductor.begin_step -> weights.begin_step -> activations.step_begin
    FORWARD     conductor.enter_forward; ONE SavedTensorRouter([weights.packer,
                activations.packer]) installed; weights/activations managed_forward
    BACKWARD    conductor.enter_backward; activations.backward_begin; the router again (a
                gradient-checkpoint recomputation saves tensors inside backward);
                weights.managed_backward
    OPTIMIZER   conductor.enter_optimizer; weights.optimizer_context(optimizer)
    STEP_END    activations.step_end -> weights.end_step -> conductor.end_step

``phase_ms`` gets a ``step_begin`` entry besides the three phases: STEP_BEGIN prefetches the
step's first blocks, and with it the phases add up to ``step_ms``.

The Conductor steps first so its STEP_BEGIN hints (reset to the user's knobs) are in force when
the weight runtime prefetches the step's first blocks. Every record goes through the one
``Telemetry`` (``stagehand``, ``activation_stagehand``, ``conductor``, ``strategy`` sources).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from runtime.common.device import own_storage
from runtime.common.memory import DeviceMemory
from runtime.common.saved_tensors import SavedTensorRouter
from runtime.common.telemetry import Telemetry
from runtime.conductor import (
    ActStagehandConductorAdapter,
    ConductorRuntime,
    StagehandConductorAdapter,
)
from runtime.config import MB, LiveLimits, StagehandSection, Watermarks
from runtime.strategy.base import MemoryStrategy

# LiveLimits field -> (runtime attribute, adapter knob)
_KNOBS = {
    "prefetch_window_blocks": ("weights", "prefetch_window"),
    "max_inflight_transfers": ("weights", "max_inflight"),
    "max_inflight_d2h": ("activations", "max_d2h"),
    "max_inflight_h2d": ("activations", "max_h2d"),
}
_WATERMARKS = {
    "weights": ("vram_high_watermark_mb", "vram_low_watermark_mb"),
    "activations": ("activation_vram_high_watermark_mb", "activation_vram_low_watermark_mb"),
}


class StagehandStrategy(MemoryStrategy):
    """The composed memory strategy (``memory.strategy: "stagehand"``); see the module docstring.

    Args:
        model: the model; its blocks are streamed when the weight runtime is on.
        section: the preset's ``memory.stagehand`` block.
        device: the compute device.
        telemetry: the run's one stream (None writes nowhere).
        checkpoint_dir: the model's safetensors folder: frozen block weights stream from it.
        mode: ``"training"`` or ``"inference"`` (stage-1 text encoders: no activation runtime).

    Raises:
        ValueError: bad ``mode``; the pools need more pinned memory than the Conductor's
            ``pinned_budget_mb``; errors of the runtimes' set-up (they name the field).
    """

    name = "stagehand"

    def __init__(
        self,
        model: torch.nn.Module,
        section: StagehandSection,
        *,
        device: torch.device | str,
        telemetry: Telemetry | None = None,
        checkpoint_dir: str | Path | None = None,
        mode: str = "training",
    ) -> None:
        if mode not in ("training", "inference"):
            raise ValueError(f'mode must be "training" or "inference", got {mode!r}')
        telemetry = telemetry if telemetry is not None else Telemetry()
        super().__init__(model, device=device, telemetry=telemetry, memory=DeviceMemory(device))
        self.section, self.mode = section, mode
        self.weights = self.activations = self.conductor = None
        self._adapters: dict[str, Any] = {}
        self._pageable_at_begin = 0
        self._stack: contextlib.ExitStack | None = None
        try:
            self._build(model, section, checkpoint_dir, mode)
        except BaseException:
            self.close()
            raise

    def _build(
        self,
        model: torch.nn.Module,
        section: StagehandSection,
        checkpoint_dir: str | Path | None,
        mode: str,
    ) -> None:
        self._build_runtimes(model, section, checkpoint_dir, mode)
        self._wire(section)

    def _build_runtimes(
        self,
        model: torch.nn.Module,
        section: StagehandSection,
        checkpoint_dir: str | Path | None,
        mode: str,
    ) -> None:
        """Set ``self.weights`` and ``self.activations`` (the runtimes that are on); a strategy
        with another weight schedule (layer offload) overrides this and keeps the wiring."""
        from runtime.activations import ActivationRuntime
        from runtime.weights import StagehandRuntime

        shared = {"device": self.device, "memory": self.memory, "telemetry": self.telemetry}
        if section.weight_streaming:
            self.weights = StagehandRuntime(
                model, section, mode=mode, checkpoint_dir=checkpoint_dir, **shared
            )
        else:
            own_storage(model, self.device)
        act = section.activation_stagehand
        if act is not None and act.enabled and mode == "training":
            self.activations = ActivationRuntime(act, model=model, **shared)

    def _wire(self, section: StagehandSection) -> None:
        """The Conductor (its adapters and pinned reservations) and the saved-tensor router
        over the runtimes ``_build_runtimes`` set.

        Raises:
            ValueError: a pool above the Conductor's ``pinned_budget_mb``.
        """
        cond = section.conductor_config
        if cond is not None and cond.enabled:
            self.conductor = ConductorRuntime(cond, memory=self.memory, telemetry=self.telemetry)
            if self.weights is not None:
                self._attach("weights", StagehandConductorAdapter(self.weights))
                self._reserve_pinned("stagehand", self.weights.pool.pool_bytes)
            if self.activations is not None:
                self._attach("activations", ActStagehandConductorAdapter(self.activations))
                self._reserve_pinned("activation_stagehand", self.activations.pool.total_bytes())
        # Lambdas, not bound packers: a runtime swaps its packer on close.
        packers = []
        if self.weights is not None:
            packers.append(lambda t: self.weights.packer(t))
        if self.activations is not None:
            packers.append(lambda t: self.activations.packer(t))
        self.router = SavedTensorRouter(packers)

    def _attach(self, part: str, adapter: Any) -> None:
        self.conductor.register_adapter(adapter)
        self._adapters[part] = adapter

    def _reserve_pinned(self, owner: str, nbytes: int) -> None:
        res = self.conductor.reserve(
            "pinned", nbytes / MB, mode="floor", priority="required", owner=owner
        )
        if not res.granted:
            raise ValueError(
                f"{owner}'s pool needs {nbytes / MB:.0f} MB of pinned host memory but "
                f"memory.stagehand.conductor_config.pinned_budget_mb "
                f"({self.conductor.config.pinned_budget_mb:.0f}) leaves "
                f"{self.conductor.config.pinned_budget_mb - self.conductor.budget.held_mb('pinned'):.0f} MB"
            )

    # -- phases ---------------------------------------------------------------------------------
    def _on_step_begin(self, step: int) -> None:
        t0 = time.perf_counter()
        super()._on_step_begin(step)
        if self.conductor is not None:
            self.conductor.begin_step(step)
        if self.weights is not None:
            self.weights.begin_step(step)  # prefetches the step's first blocks
        if self.activations is not None:
            self.activations.step_begin(step)
            self._pageable_at_begin = self._activation_pageable()
        # STEP_BEGIN is timed too: with the first blocks' prefetch it is part of the step, and
        # without it the phases would not add up to ``step_ms``.
        self.phase_ms["step_begin"] = (time.perf_counter() - t0) * 1e3

    def _open(self, *contexts: contextlib.AbstractContextManager[Any]) -> None:
        self._stack = contextlib.ExitStack()
        for ctx in contexts:
            self._stack.enter_context(ctx)

    def _close_stack(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _on_forward_begin(self) -> None:
        if self.conductor is not None:
            self.conductor.enter_forward()
        contexts = [self.router.hooks()]
        if self.weights is not None:
            contexts.append(self.weights.managed_forward(install_hooks=False))
        if self.activations is not None:
            contexts.append(self.activations.managed_forward(install_hooks=False))
        self._open(*contexts)

    def _on_forward_end(self) -> None:
        self._close_stack()

    def _on_backward_begin(self) -> None:
        if self.conductor is not None:
            self.conductor.enter_backward()
        if self.activations is not None:
            self.activations.backward_begin()
        contexts = [self.router.hooks()]
        if self.weights is not None:
            contexts.append(self.weights.managed_backward())
        self._open(*contexts)

    def _on_backward_end(self) -> None:
        self._close_stack()

    def _on_optimizer_begin(self) -> None:
        if self.conductor is not None:
            self.conductor.enter_optimizer()
        if self.weights is not None:
            self._open(self.weights.optimizer_context(getattr(self, "_optimizer", None)))

    def _on_optimizer_end(self) -> None:
        self._close_stack()

    def _on_step_end(self, step: int, ok: bool) -> None:
        self._close_stack()  # a phase left by an error
        try:
            if self.activations is not None:
                self.activations.step_end()
            if self.weights is not None:
                self.weights.end_step()
        finally:
            if self.conductor is not None:
                self.conductor.end_step()

    # -- live limits ----------------------------------------------------------------------------
    def limits(self) -> dict[str, Any]:
        """The current value of every live limit of the runtimes that are on (user settings:
        the Conductor's temporary tightening is not shown)."""
        out: dict[str, Any] = {}
        for part, (high, low) in _WATERMARKS.items():
            runtime = getattr(self, part)
            if runtime is not None:
                out[high], out[low] = self._watermarks(part)
        for field, (part, knob) in _KNOBS.items():
            if getattr(self, part) is not None:
                out[field] = self._knob(part, knob)
        return out

    def _watermarks(self, part: str) -> tuple[float, float]:
        if part == "weights":
            return self.weights.high_mb, self.weights.low_mb
        budget = self.activations.budget
        return budget.high_mb, budget.low_mb

    def _knob(self, part: str, knob: str) -> Any:
        adapter = self._adapters.get(part)
        if adapter is not None and adapter.attached:
            return adapter.originals[knob]
        runtime = getattr(self, part)
        return {
            "prefetch_window": lambda: runtime.scheduler.prefetch_window,
            "max_inflight": lambda: runtime.transfer.max_inflight,
            "max_d2h": lambda: runtime.transfer.max_d2h,
            "max_h2d": lambda: runtime.transfer.max_h2d,
        }[knob]()

    def _resolve(self, limits: LiveLimits, current: dict[str, Any]) -> dict[str, Any]:
        """``current`` with ``limits`` applied: each field changes only itself (the weight
        runtime's watermarks never move the activation runtime's).

        Raises:
            ValueError: a field for a runtime that is off, or a low watermark above a high one.
        """
        new = dict(current)
        for field, value in limits.given().items():
            if field not in current:  # only runtimes that are on
                raise ValueError(f"{field}: no runtime of this strategy has that limit")
            new[field] = value
        for high, low in _WATERMARKS.values():
            if high in new:
                Watermarks(new[high], new[low], (high, low))
        return new

    def set_limits(
        self, limits: LiveLimits | dict[str, Any], request_id: str | None = None
    ) -> None:
        """Queue new limits for the next STEP_BEGIN, checked now against the current values
        and the limits already queued.

        Raises:
            pydantic.ValidationError: a field is unknown or out of range.
            ValueError: a field for a runtime that is off; low above high once combined.
        """
        if not isinstance(limits, LiveLimits):
            limits = LiveLimits.model_validate(limits)
        current = self.limits()
        for _, queued in self._pending:
            current = self._resolve(queued, current)
        self._resolve(limits, current)
        super().set_limits(limits, request_id)

    def _apply_limits(self, limits: LiveLimits) -> dict[str, list[Any]]:
        before = self.limits()
        after = self._resolve(limits, before)
        for part, (high, low) in _WATERMARKS.items():
            if high in after and (after[high], after[low]) != (before[high], before[low]):
                getattr(self, part).set_watermarks(after[high], after[low])
        for field, (part, knob) in _KNOBS.items():
            if field in after and after[field] != before[field]:
                self._set_knob(part, knob, after[field])
        return {k: [before[k], after[k]] for k in after if after[k] != before[k]}

    def _set_knob(self, part: str, knob: str, value: Any) -> None:
        adapter = self._adapters.get(part)
        if adapter is not None and adapter.attached:
            adapter.set_original(knob, value)  # detach then restores the user's new value
            return
        runtime = getattr(self, part)
        owner = runtime.scheduler if knob == "prefetch_window" else runtime.transfer
        setattr(owner, knob, value)

    # -- figures and teardown -------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """``MemoryStrategy.counters`` from the runtimes that are on."""
        out = super().counters()
        if self.weights is not None:
            out.update(self.weights.counters())
        if self.activations is not None:
            m = self.activations.metrics
            out["pageable_copies"] += self._activation_pageable() - self._pageable_at_begin
            out.update(
                tensors_spilled=m.activations_spilled,
                tensors_restored=m.activations_restored,
                spill_bytes=m.spill_bytes,
            )
        if self.conductor is not None:
            out.update(self.conductor.counters())
        return out

    def _activation_pageable(self) -> int:
        transfer = self.activations.transfer
        return transfer.d2h.pageable_copies + transfer.h2d.pageable_copies

    def _needs_optimizer(self) -> bool:
        return self.weights is not None and any(
            slot.trainable for block in self.weights.blocks for slot in block.layout
        )

    def pinned_bytes(self) -> int:
        """Host bytes held by the pools (pinned on CUDA), for the trainer's ``pinned_mb``."""
        total = 0
        if self.weights is not None:
            total += self.weights.pool.pool_bytes
        if self.activations is not None:
            total += self.activations.pool.total_bytes()
        return total

    def snapshot(self) -> dict[str, Any]:
        """VRAM figures (MB, with their source), plus the live limits in force."""
        return {**self.memory.snapshot(), "limits": self.limits()}

    def close(self) -> None:
        """Detach the Conductor (knobs restored), close both runtimes: the model's weights are
        ordinary resident tensors again and the pools are freed."""
        if self._closed:
            return
        self._closed = True
        self._close_stack()
        if self.conductor is not None:
            self.conductor.shutdown()
        if self.activations is not None:
            self.activations.close()
        if self.weights is not None:
            self.weights.close()
        self.telemetry.flush()
