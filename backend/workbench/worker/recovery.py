"""Out-of-memory recovery: a step that runs out of device memory is undone, re-planned and run
again, never lost (issue 57).

# NOTE [ Out-of-memory recovery ]
``torch.OutOfMemoryError`` raised inside a training step (forward, backward, optimizer step) or
a sample's inference step is caught around the step (``backend/workbench/worker/loop.py``, ``backend/workbench/worker/sampling.py``):

1. figures first, while the dead step still holds its bytes: ``failure_bytes`` (tracked on the
   CPU, allocated on CUDA), the bytes the allocation asked for, the card;
2. undo: the strategy's step context already ended the step (its records tagged ``aborted``);
   ``strategy.abort_step()`` returns every runtime to the between-steps state of a strategy
   just built (NOTE [ Aborted step ] in ``runtime/stagehand/weights/abort.py``); ``Rollback.restore``
   puts back what the step changed: gradients (None, as every step starts), the trainable
   parameters, the optimizer's and the scheduler's state when the optimizer phase had begun
   (an error inside ``optimizer.step()`` may leave some parameters updated), and torch's RNG;
3. re-plan: ``stagehand.strategy.recovery.lowered_limits`` (NOTE [ Lowering rule ]), the rule the
   planner shares, put in force with ``strategy.set_limits(..., request_id="oom")`` (a
   ``strategy/limits_applied`` record at the next step begin);
4. one ``trainer/oom_recovery`` record (``docs/contracts.md``), then the same step runs again
   with the same batch (``step_generator(seed, step)``) and RNG. Memory strategies change no
   number (NOTE [ Exact numbers ] in ``runtime/stagehand/__init__.py``), so from that step on the run is
   bit-identical to one started with the lowered limits.

When the rule has nothing left to lower, or one step failed ``MAX_FAILURES_PER_STEP`` times,
``OutOfMemoryEnd`` ends the run: its message names the step, the bytes needed, the card and
what would fit; the run saves a checkpoint and the LoRA first (``backend/workbench/worker/run.py``).
"""

from __future__ import annotations

import gc
import traceback
from typing import Any

import torch

from stagehand.config.memory import MB
from stagehand.strategy.recovery import (
    MARGIN_FRACTION,
    MAX_FAILURES_PER_STEP,
    lowered_limits,
    requested_bytes,
)
from workbench.contract.records import OOM_RECOVERY, OOM_REQUEST

PHASES = ("forward", "backward", "optimizer", "sampling")
"""Where a step can run out of memory, as the record names it."""


class OutOfMemoryEnd(torch.OutOfMemoryError):
    """The run ends: a step out of device memory that no lowering made fit (an out-of-memory
    error: its ``trainer/error`` record has ``oom: true``)."""


class Rollback:
    """What one training step changes, put back after an out-of-memory error.

    Built at the step's start (torch's RNG state); ``before_optimizer()`` copies the trainable
    parameters and the optimizer's and scheduler's state to the host just before the optimizer
    phase (LoRA tensors are small; a full fine-tune pays a host copy of its parameters and
    Adam's moments per step). ``phase`` is the phase running, for the record.
    """

    def __init__(self, trainable: list[torch.nn.Parameter], optimizer, scheduler) -> None:
        self.trainable, self.optimizer, self.scheduler = trainable, optimizer, scheduler
        self.rng = torch.get_rng_state()
        self.phase = "forward"
        self._params: list[torch.Tensor] | None = None
        self._optimizer: dict[str, Any] | None = None
        self._scheduler: dict[str, Any] | None = None

    def before_optimizer(self) -> None:
        self.phase = "optimizer"
        self._params = [p.detach().to("cpu", copy=True) for p in self.trainable]
        self._optimizer = _host_copy(self.optimizer.state_dict())
        self._scheduler = _host_copy(self.scheduler.state_dict())

    def restore(self) -> None:
        """Gradients None; parameters, optimizer and scheduler as at the optimizer phase's
        start when it had begun; the RNG as at the step's start. Call after
        ``strategy.abort_step()`` (streamed parameters point at their host masters then)."""
        with torch.no_grad():
            for i, p in enumerate(self.trainable):
                p.grad = None
                if self._params is not None:
                    p.data.copy_(self._params[i])
        if self._optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer)
            self.scheduler.load_state_dict(self._scheduler)
        self._params = self._optimizer = self._scheduler = None
        torch.set_rng_state(self.rng)
        self.phase = "forward"


def _host_copy(state: Any) -> Any:
    """A deep copy of a ``state_dict`` with every tensor cloned to the host."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(v) for v in state)
    return state


class OomRecovery:
    """The run's recoveries (NOTE [ Out-of-memory recovery ]); ``recoveries`` counts them for
    ``trainer/run_finished``."""

    def __init__(self, telemetry) -> None:
        self.telemetry = telemetry
        self.recoveries = 0

    def recover(
        self,
        exc: torch.OutOfMemoryError,
        strategy,
        step: int,
        phase: str,
        attempt: int,
        undo=lambda: None,
    ) -> dict[str, Any]:
        """Undo the step ``exc`` ended, lower the limits and write the ``trainer/oom_recovery``
        record; the caller runs the step again. ``attempt``: 1 for the step's first failure;
        ``undo()`` puts back what the step changed (``Rollback.restore``), after the strategy's
        abort. Returns the limits after, ``{field: value}``.

        Raises:
            OutOfMemoryEnd: ``attempt`` reached ``MAX_FAILURES_PER_STEP``, or nothing is left
                to lower (the floors, or a strategy without limits); chained from ``exc``.
        """
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        memory = getattr(strategy, "memory", None)
        failure = _in_use(exc, memory)
        requested = requested_bytes(exc)
        card = memory.card_bytes() if memory is not None else None
        message = str(exc)
        traceback.clear_frames(exc.__traceback__)  # the dead step's tensors go with its frames
        gc.collect()
        before = strategy.limits() if strategy is not None else {}
        after = lowered_limits(before, failure, card, requested)
        if strategy is not None:
            strategy.abort_step()
        undo()
        if after is None or attempt >= MAX_FAILURES_PER_STEP:
            why = (
                f"{attempt} attempts"
                if after is not None
                else "every limit at its floor"
                if before
                else "no memory limits to lower"
            )
            raise OutOfMemoryEnd(end_message(step, phase, why, failure + requested, card)) from exc
        changed = {k: v for k, v in after.items() if before.get(k) != v}
        strategy.set_limits(changed, request_id=OOM_REQUEST)
        self.recoveries += 1
        self.telemetry.step, self.telemetry.phase = step, None
        self.telemetry.emit(
            *OOM_RECOVERY,
            step=step,
            phase=phase,
            attempt=attempt,
            failure_bytes=failure,
            card_bytes=card,
            limits_before=before,
            limits_after=after,
            message=message,
        )
        self.telemetry.flush()
        return after


def _in_use(exc: BaseException, memory) -> int:
    """Device bytes in use at the failure: an emulated card's figure, else the memory's."""
    value = getattr(exc, "in_use_bytes", None)
    if isinstance(value, int):
        return value
    return memory.allocated_bytes() if memory is not None else 0


def _size(nbytes: float) -> str:
    """Bytes as a person reads a card: GiB from 1 GiB up, else MB (2 decimals)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / MB:.2f} MB"


def end_message(step: int, phase: str, why: str, needed: int, card: int | None) -> str:
    """The honest end's sentence: the step, the bytes needed, the card and what would fit."""
    card_text = f"the card holds {_size(card)}" if card else "the card's size is unknown"
    return (
        f"out of device memory at step {step} ({phase}) after {why}: the step needs "
        f"{_size(needed)} ({needed} bytes) at the least limits tried, {card_text}. What would "
        f"fit: a smaller resolution or batch_size, the 8-bit base (memory.stagehand.squareq), "
        f"or a card of at least {_size(needed / (1 - MARGIN_FRACTION))}"
    )
