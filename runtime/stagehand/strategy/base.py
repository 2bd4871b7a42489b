"""The one object a training loop drives: a memory strategy with step and phase contexts.

The call order and a complete example are in the ``runtime`` package docstring
(``runtime/stagehand/__init__.py``); each step of the loop is ``with strategy.step(i):`` around
``strategy.forward()``, ``strategy.backward()`` and ``strategy.optimizer(optimizer)``.

``forward``/``backward``/``optimizer`` outside ``step`` raise ``PhaseError``, so a step boundary
cannot be forgotten. Limits given to ``set_limits`` between steps apply at the next STEP_BEGIN and
are acknowledged by a ``strategy/limits_applied`` telemetry record. Gradients are readable once
the backward phase has ended.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase, PhaseError, PhaseMachine
from stagehand.common.telemetry import Telemetry
from stagehand.config.memory import LiveLimits
from stagehand.config.records import LIMITS_APPLIED

COUNTERS = (
    "blocks_loaded",
    "blocks_evicted",
    "prefetch_hits",
    "prefetch_misses",
    "file_reads",
    "h2d_bytes",
    "resident_blocks",
    "pageable_copies",
    "host_waits",
    "tensors_spilled",
    "tensors_restored",
    "spill_bytes",
    "grants",
    "denials",
)
"""The keys of ``MemoryStrategy.counters()``, the same for every strategy."""


class MemoryStrategy:
    """Base strategy: phase order, phase timing and live limits; no memory management.

    Subclasses override the ``_on_*`` hooks and ``_apply_limits``. ``strategy: "none"`` is this
    class as is: the plain model, the baseline every benchmark compares against.
    """

    name = "none"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | str,
        telemetry: Telemetry | None = None,
        memory: DeviceMemory | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.memory = memory if memory is not None else DeviceMemory(self.device)
        self.phases = PhaseMachine()
        self.step_index: int | None = None
        self.step_ms: float = 0.0
        self._pending: list[tuple[str | None, LiveLimits]] = []
        self._closed = False

    # -- phases -------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase | None:
        """The current phase (``PhaseMachine``)."""
        return self.phases.phase

    @property
    def phase_ms(self) -> dict[str, float]:
        """Milliseconds spent in STEP_BEGIN (limits applied, first blocks prefetched), FORWARD,
        BACKWARD and OPTIMIZER of the current (or last) step, each from its entry to the end of
        its context: they add up to at most ``step_ms``."""
        return {k: v for k, v in self.phases.durations_ms.items() if k != Phase.STEP_END.value}

    def _enter(self, phase: Phase) -> None:
        self.phases.advance(phase)
        self.telemetry.phase = phase.value

    @contextlib.contextmanager
    def _timed(self, phase: Phase) -> Iterator[None]:
        if self.step_index is None:
            raise PhaseError(f"{phase.name} outside a step: wrap it in `with strategy.step(i):`")
        self._enter(phase)
        self._phase_begin(phase)
        try:
            yield
        finally:
            self._phase_end(phase)
            self.phases.leave()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """STEP_BEGIN ... STEP_END around one training (or inference) step."""
        if self._closed:
            raise RuntimeError("the strategy is closed")
        if self.step_index is not None:
            raise PhaseError(f"step {step} begun inside step {self.step_index}: steps do not nest")
        self.step_index = step
        self.telemetry.step = step
        self._enter(Phase.STEP_BEGIN)
        self._apply_pending_limits()
        self._on_step_begin(step)
        self.phases.leave()
        ok, tags = False, {}
        try:
            yield
            ok = True
        except torch.OutOfMemoryError:
            tags = {"aborted": True}  # the step's records: an attempt the run will run again
            raise
        finally:
            self._enter(Phase.STEP_END)
            self.step_ms = (time.perf_counter() - self.phases.step_started) * 1e3
            try:
                with self.telemetry.tagged(**tags):
                    self._on_step_end(step, ok)
            finally:
                self.telemetry.flush()
                self.step_index = None
                self.telemetry.phase = None

    def abort_step(self) -> None:
        """Undo the step an error left (between steps, after ``step``'s context exited with
        it): every runtime back to its between-steps state with nothing loaded ahead, as a
        strategy just built has it (NOTE [ Aborted step ] in ``runtime/stagehand/weights/abort.py``), and
        a new peak window. Limits queued with ``set_limits`` apply at the next STEP_BEGIN.

        Raises:
            PhaseError: called inside a step.
        """
        if self.step_index is not None:
            raise PhaseError(f"abort_step inside step {self.step_index}: call it after the step")
        self._on_abort()
        self.memory.reset_peak()

    def _on_abort(self) -> None:
        pass

    def forward(self) -> contextlib.AbstractContextManager[None]:
        return self._timed(Phase.FORWARD)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """BACKWARD around ``loss.backward()``. Gradients are readable once this phase has
        ended: inside it, the gradient of a parameter whose block was evicted may still be
        arriving in host memory (an asynchronous D2H copy on a GPU)."""
        return self._timed(Phase.BACKWARD)

    def optimizer(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """OPTIMIZER phase; subclasses bring trainable parameters and optimizer state to the
        compute device for ``optimizer.step()`` (the seed's bug 6) and back after."""
        if optimizer is None and self._needs_optimizer():
            raise TypeError(
                "strategy.optimizer(optimizer) needs the optimizer: trainable parameters of "
                "streamed blocks live on the host between steps, and their optimizer state must "
                "be moved to the device with them for optimizer.step()"
            )
        self._optimizer = optimizer
        return self._timed(Phase.OPTIMIZER)

    def _needs_optimizer(self) -> bool:
        """Whether ``optimizer()`` must be given the optimizer (its state moves with the
        parameters). None do here."""
        return False

    def counters(self) -> dict[str, int]:
        """The work the runtimes did in the open step (the last one between steps), so a caller
        can prove they did something: every key of ``COUNTERS``, all 0 for the plain model.

        ``blocks_loaded``/``blocks_evicted``: block H2D loads and evictions; ``prefetch_hits``/
        ``prefetch_misses``: uses that found the block loaded / had to wait for a demand load;
        ``file_reads``: tensors read from safetensors files; ``h2d_bytes``: bytes of block
        weights copied to the device; ``resident_blocks``: blocks on the device now (the
        budget's resident set at a step's end, NOTE [ Eviction policy ]); ``pageable_copies``:
        asynchronous copies that a pageable host buffer made synchronous (CUDA; none belong in a
        step); ``host_waits``: the weight runtime's host waits on copies not finished yet (none
        belong in forward or backward); ``tensors_spilled``/``tensors_restored``/``spill_bytes``:
        saved activations moved to the host and back; ``grants``/``denials``: the Conductor's
        answers to budget and transfer-slot requests.
        """
        return dict.fromkeys(COUNTERS, 0)

    # -- live limits ----------------------------------------------------------------------------
    def set_limits(
        self, limits: LiveLimits | dict[str, Any], request_id: str | None = None
    ) -> None:
        """Queue new limits; they apply at the next STEP_BEGIN.

        Raises:
            pydantic.ValidationError: a field is unknown or out of range (low above high...).
        """
        if not isinstance(limits, LiveLimits):
            limits = LiveLimits.model_validate(limits)
        self._pending.append((request_id, limits))

    def _apply_pending_limits(self) -> None:
        while self._pending:
            request_id, limits = self._pending.pop(0)
            changed = self._apply_limits(limits)
            self.telemetry.emit(*LIMITS_APPLIED, request_id=request_id, changed=changed)

    def _apply_limits(self, limits: LiveLimits) -> dict[str, list[Any]]:
        """Apply ``limits``; return ``{field: [old, new]}`` of what changed. None here."""
        return {}

    def limits(self) -> dict[str, Any]:
        """The current values of every live limit this strategy has."""
        return {}

    # -- hooks for subclasses -------------------------------------------------------------------
    def _on_step_begin(self, step: int) -> None:
        self.memory.reset_peak()

    def _phase_begin(self, phase: Phase) -> None:
        """FORWARD, BACKWARD or OPTIMIZER begins: the ``_on_<phase>_begin`` hook."""
        {
            Phase.FORWARD: self._on_forward_begin,
            Phase.BACKWARD: self._on_backward_begin,
            Phase.OPTIMIZER: self._on_optimizer_begin,
        }[phase]()

    def _phase_end(self, phase: Phase) -> None:
        """FORWARD, BACKWARD or OPTIMIZER ends (errors included): ``_on_<phase>_end``."""
        {
            Phase.FORWARD: self._on_forward_end,
            Phase.BACKWARD: self._on_backward_end,
            Phase.OPTIMIZER: self._on_optimizer_end,
        }[phase]()

    def _on_step_end(self, step: int, ok: bool) -> None:
        pass

    def _on_forward_begin(self) -> None:
        pass

    def _on_forward_end(self) -> None:
        pass

    def _on_backward_begin(self) -> None:
        pass

    def _on_backward_end(self) -> None:
        pass

    def _on_optimizer_begin(self) -> None:
        pass

    def _on_optimizer_end(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        """VRAM figures now (MB, with their source) for the trainer's step record."""
        return self.memory.snapshot()

    def close(self) -> None:
        """Restore the model to ordinary resident weights and free the strategy's memory."""
        self._closed = True
