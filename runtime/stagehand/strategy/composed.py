"""StagehandStrategy: weight streaming, activation spill and the Conductor behind one object.

Source: "Activation Stagehand" ("Integration": the activation runtime's step
nests inside the weight runtime's) and "Conductor: Resource Arbitration Across Memory Runtimes" ("Integration Point").
Each part is on or off independently:

- weight runtime (``WeightRuntime``): ``memory.stagehand.weight_streaming`` (off: every
  weight stays resident on the device, for activation spill and/or the Conductor alone);
- activation runtime (``ActivationRuntime``): ``memory.stagehand.activation_stagehand.enabled``,
  training mode only (inference saves nothing for backward);
- Conductor: ``memory.stagehand.conductor_config.enabled``.

Each runtime that is on is a ``MemoryPart`` (``runtime/stagehand/strategy/parts.py``), in the order
conductor, weights, activations; one step, as ``MemoryStrategy`` drives it::

    STEP_BEGIN  part.begin_step for each part, in order
    FORWARD     ONE SavedTensorRouter over the parts' packers installed, then each part's
    BACKWARD    phase context (the router in BACKWARD too: a gradient-checkpoint
    OPTIMIZER   recomputation saves tensors inside backward)
    STEP_END    part.end_step for each part, in reverse order (every part ends its step;
                the first error is raised after)

A live limit belongs to the part that has it: the part reads, checks and sets it.

The Conductor steps first so its STEP_BEGIN hints (reset to the user's knobs) are in force when
the weight runtime prefetches the step's first blocks. Every record goes through the one
``Telemetry`` (``stagehand``, ``activation_stagehand``, ``conductor``, ``strategy`` sources).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from stagehand.activations import ActivationRuntime
from stagehand.common.device import own_storage
from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase
from stagehand.common.saved_tensors import SavedTensorRouter
from stagehand.common.telemetry import Telemetry
from stagehand.conductor import ConductorRuntime
from stagehand.config.limits import PAIRS
from stagehand.config.memory import MB, LiveLimits, StagehandSection
from stagehand.config.records import LIMITS_APPLIED
from stagehand.squareq.adapter import SquareQConductorAdapter
from stagehand.strategy.auto import AutoSection, has_auto
from stagehand.strategy.base import MemoryStrategy
from stagehand.strategy.parts import ActivationsPart, ConductorPart, MemoryPart, WeightsPart
from stagehand.weights import WeightRuntime


class StagehandStrategy(MemoryStrategy):
    """The composed memory strategy (``memory.strategy: "stagehand"``); see the module docstring.

    Args:
        model: the model; its blocks are streamed when the weight runtime is on.
        section: the preset's ``memory.stagehand`` block.
        device: the compute device.
        telemetry: the run's one stream (None writes nowhere).
        checkpoint_dir: the model's safetensors folder: frozen block weights stream from it.
        mode: ``"training"`` or ``"inference"`` (stage-1 text encoders: no activation runtime).
        activation_peak: the step's planned activation peak in bytes, what ``"auto"`` fields
            resolve with at build (``workbench.plan.activation_peak.planned_activation_peak``); 0 when none was
            planned. The trace step's measured peak replaces it.

    ``weights``, ``activations`` and ``conductor`` are the runtimes that are on (None when off),
    for callers that inspect them; the strategy itself only goes through ``parts``.

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
        activation_peak: int = 0,
    ) -> None:
        if mode not in ("training", "inference"):
            raise ValueError(f'mode must be "training" or "inference", got {mode!r}')
        telemetry = telemetry if telemetry is not None else Telemetry()
        super().__init__(model, device=device, telemetry=telemetry, memory=DeviceMemory(device))
        self.weights = self.activations = self.conductor = None
        training = mode == "training"
        self.auto = AutoSection(section, model, device, training) if has_auto(section) else None
        """``"auto"`` fields: resolved at build with the planned activation peak, the weight
        watermarks again after the trace step with the measured one (``runtime/stagehand/strategy/auto.py``)."""
        section = self.auto.resolve(activation_peak) if self.auto else section
        self.section, self.mode = section, mode
        self.parts: list[MemoryPart] = []
        self._packing: list[MemoryPart] = []
        self._stack: contextlib.ExitStack | None = None
        try:
            self._build_parts(model, section, checkpoint_dir, mode)
            self._wire(section)
        except BaseException:
            self.close()
            raise
        if self.auto is not None and mode == "training":
            # The figures "auto" became, as a change of the run's live limits (an inference
            # strategy's, the samples' or the text encoders', are not the run's limits).
            resolved = {k: v for k, v in self.limits().items() if k in self.auto.fields}
            changed = {k: ["auto", v] for k, v in resolved.items()}
            self.telemetry.emit(*LIMITS_APPLIED, request_id="auto", changed=changed)

    def _build_parts(
        self,
        model: torch.nn.Module,
        section: StagehandSection,
        checkpoint_dir: str | Path | None,
        mode: str,
    ) -> None:
        """Append the runtime parts that are on to ``parts`` (each as soon as it is built, so
        ``close`` frees it if a later one fails); a strategy with another weight schedule
        (layer offload) overrides this and keeps the wiring."""

        shared = {"device": self.device, "memory": self.memory, "telemetry": self.telemetry}
        if section.weight_streaming:
            self.weights = WeightRuntime(
                model, section, mode=mode, checkpoint_dir=checkpoint_dir, **shared
            )
            self.parts.append(WeightsPart(self.weights))
        else:
            own_storage(model, self.device)
        act = section.activation_stagehand
        if act is not None and act.enabled and mode == "training":
            self.activations = ActivationRuntime(act, model=model, **shared)
            self.parts.append(ActivationsPart(self.activations))

    def _wire(self, section: StagehandSection) -> None:
        """The Conductor (first part; an adapter and a pinned reservation per runtime part) and
        the saved-tensor router over the parts' packers.

        Raises:
            ValueError: a pool above the Conductor's ``pinned_budget_mb``.
        """
        runtime_parts = list(self.parts)
        cond = section.conductor_config
        if cond is not None and cond.enabled:
            self.conductor = ConductorRuntime(cond, memory=self.memory, telemetry=self.telemetry)
            self.parts.insert(0, ConductorPart(self.conductor))
            for part in runtime_parts:
                adapter = part.adapter()
                if adapter is not None:
                    self.conductor.register_adapter(adapter)
                if part.pinned_owner is not None:
                    self._reserve_pinned(part.pinned_owner, part.pool_bytes())
            if self.weights is not None and self.weights.squareq.enabled:  # the third adapter
                self.conductor.register_adapter(
                    SquareQConductorAdapter(self.weights.squareq, self.weights)
                )
        self._packing = [p for p in runtime_parts if p.packer is not None]

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
        super()._on_step_begin(step)
        for part in self.parts:
            part.begin_step(step)

    def _phase_begin(self, phase: Phase) -> None:
        optimizer = getattr(self, "_optimizer", None)
        stack = contextlib.ExitStack()
        self._stack = stack
        if phase is not Phase.OPTIMIZER:
            # The parts' packers as they are now (a closed runtime keeps everything).
            stack.enter_context(SavedTensorRouter([p.packer for p in self._packing]).hooks())
        for part in self.parts:
            stack.enter_context(part.phase(phase, optimizer))

    def _phase_end(self, phase: Phase) -> None:
        self._close_stack()
        if self.auto is not None and phase is Phase.FORWARD and self.mode == "training":
            # the saved activations' peak (inference saves none)
            self.auto.measure(self.memory)

    def _close_stack(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _on_step_end(self, step: int, ok: bool) -> None:
        self._close_stack()  # a phase left by an error
        first: BaseException | None = None
        for part in reversed(self.parts):
            try:
                part.end_step()
            except BaseException as exc:  # every part ends its step; the first error wins
                first = first or exc
        if first is not None:
            raise first
        if not ok and self.auto is not None:
            self.auto.measured = None  # a failed step's peak: the recovery's limits stand
        if (
            ok
            and self.auto is not None
            and self.weights is not None
            and (self.auto.measured is not None)
        ):
            # The trace step measured the activation peak: it replaces the planned one,
            # through the live limits (applied at the next STEP_BEGIN, a limits_applied record).
            marks = self.auto.resolve(self.auto.measured)
            self.auto.measured = None
            new = {
                "vram_high_watermark_mb": marks.vram_high_watermark_mb,
                "vram_low_watermark_mb": marks.vram_low_watermark_mb,
            }
            if new != {k: self.limits()[k] for k in new}:
                self.set_limits(new, request_id="auto")

    def _on_abort(self) -> None:
        for part in reversed(self.parts):  # as end_step: copies drained before slots released
            part.abort_step()

    # -- live limits ----------------------------------------------------------------------------
    def limits(self) -> dict[str, Any]:
        """The user's value of every live limit of the parts that are on (the Conductor's caps
        are not shown)."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.get_limits())
        return out

    def _resolve(self, limits: LiveLimits, current: dict[str, Any]) -> dict[str, Any]:
        """``current`` with ``limits`` applied, checked by the parts that own the fields: each
        field changes only itself (the weight runtime's watermarks never move the activation
        runtime's).

        Raises:
            ValueError: a field no part has (its runtime is off), or a part refuses the change.
        """
        given = limits.given()
        for field in given:
            if field not in current:
                raise ValueError(f"{field}: no runtime of this strategy has that limit")
        new = {**current, **given}
        for part in self.parts:
            mine = {f: given[f] for f in part.limits if f in given}
            if mine:
                part.check_limits(mine, {f: new[f] for f in part.limits})
        return new

    def set_limits(
        self, limits: LiveLimits | dict[str, Any], request_id: str | None = None
    ) -> None:
        """Queue new limits for the next STEP_BEGIN, checked now against the current values
        and the limits already queued.

        Raises:
            pydantic.ValidationError: a field is unknown or out of range.
            ValueError: a field for a runtime that is off; a part refuses it (low above high
                once combined...).
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
        for part in self.parts:
            if any(after[f] != before[f] for f in part.limits):
                part.set_limits({f: after[f] for f in part.limits})
        if any(after[f] != before[f] for pair in PAIRS for f in pair if f in after):
            for (
                part
            ) in self.parts:  # NOTE [ Live watermarks ] (runtime/stagehand/weights/policy.py)
                part.watermarks_changed()
        return {k: [before[k], after[k]] for k in after if after[k] != before[k]}

    # -- figures and teardown -------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """``MemoryStrategy.counters``, summed over the parts."""
        out = super().counters()
        for part in self.parts:
            for key, value in part.counters().items():
                out[key] += value
        return out

    def _needs_optimizer(self) -> bool:
        return any(part.needs_optimizer() for part in self.parts)

    def pinned_bytes(self) -> int:
        """Host bytes held by the pools and the host cache's images (pinned on CUDA), for the
        trainer's ``pinned_mb``."""
        return sum(part.pinned_bytes() for part in self.parts)

    def snapshot(self) -> dict[str, Any]:
        """VRAM figures (MB, with their source), plus the live limits in force."""
        return {**self.memory.snapshot(), "limits": self.limits()}

    def close(self) -> None:
        """Close the parts in reverse order (the Conductor last: caps cleared, reservations
        released): the model's weights are ordinary resident tensors again and the pools are
        freed."""
        if self._closed:
            return
        self._closed = True
        self._close_stack()
        for part in reversed(self.parts):
            part.close()
        self.telemetry.flush()
