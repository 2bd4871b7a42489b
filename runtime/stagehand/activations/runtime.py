"""``ActivationRuntime``: spill autograd's saved tensors to host past a VRAM watermark, restore
them for backward (ahead of need with predictive restore).

Source: "Activation Stagehand" (design, config, telemetry, lifecycle). Usage,
standalone::

    runtime = ActivationRuntime(config, device=device, model=model)
    for step in range(n):
        runtime.begin_step(step)
        with runtime.managed_forward():
            loss = loss_fn(model(**inputs))
            runtime.backward_begin()  # optional: restores the first tensors before backward asks
            loss.backward()
        runtime.end_step()           # releases every record, emits the step record
    runtime.close()

Composed (one ``SavedTensorRouter([weights.packer, activations.packer])`` installed by the
strategy), ``managed_forward(install_hooks=False)`` and ``packer`` are what the strategy uses;
the seed nests this runtime's step inside the weight runtime's.
"""

from __future__ import annotations

import contextlib
from itertools import chain
from typing import Any

import torch

from stagehand.activations.budget import ActivationBudgetManager
from stagehand.activations.hooks import KeptTensor, SpilledTensor, managed_forward, span_elements
from stagehand.activations.pool import CPUSpillBackend
from stagehand.activations.spill import CATEGORY, SpillTable
from stagehand.activations.telemetry import SOURCE, ActivationStepMetrics
from stagehand.activations.transfer import ActivationTransferEngine
from stagehand.common.memory import DeviceMemory
from stagehand.common.nested import in_backward
from stagehand.common.telemetry import Telemetry, default_telemetry
from stagehand.config.memory import MB, ActivationStagehandConfig

PUBLISH_BYTES = 64 * 1024
"""Kept bytes are reported to ``DeviceMemory`` in batches of at least this many (a lock and two
dict updates per saved tensor would double the KEEP path's cost); watermark decisions add the
unreported bytes, so only the tracked *peak* can lag the truth, by less than this."""


class ActivationRuntime:
    """Saved-tensor spill runtime (Activation Stagehand): the pack decision (watermark, size,
    weights) and the kept tensors' accounting here; the spilled side in ``self.table``
    (``SpillTable``: records, copies, restores, release).

    Args:
        config: ``ActivationStagehandConfig`` (or its JSON block as a dict).
        device: the compute device.
        memory: the strategy's shared ``DeviceMemory`` (a new one when None).
        telemetry: the run's ``Telemetry``; step records go there as
            ``activation_stagehand/step`` when ``config.telemetry_enabled``. None: JSONL to
            ``config.telemetry_file`` (the seed's default), closed with the runtime.
        model: its parameters and buffers (and views of them) are never spilled.

    Raises:
        pydantic.ValidationError: an invalid config dict.
        ValueError: bad pool classes or caps (see ``CPUSpillBackend``,
            ``ActivationTransferEngine``).
    """

    def __init__(
        self,
        config: ActivationStagehandConfig | dict,
        *,
        device: torch.device | str,
        memory: DeviceMemory | None = None,
        telemetry: Telemetry | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(config, ActivationStagehandConfig):
            config = ActivationStagehandConfig.model_validate(config)
        self.config = config
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.memory = memory if memory is not None else DeviceMemory(self.device)
        self._owns_telemetry = telemetry is None
        self.telemetry = (
            telemetry
            if telemetry is not None
            else default_telemetry(config.telemetry_file if config.telemetry_enabled else None)
        )
        self.model = model
        self.transfer = ActivationTransferEngine(
            self.device, config.max_inflight_d2h, config.max_inflight_h2d
        )
        self.budget = ActivationBudgetManager(
            self.memory, config.vram_high_watermark_mb, config.vram_low_watermark_mb
        )
        try:
            self.pool = CPUSpillBackend(
                config.pinned_pool_classes_mb,
                config.slab_counts(),
                pin=self.is_cuda,
                growth_budget_mb=config.pinned_growth_budget_mb,
            )
        except RuntimeError as exc:  # page-locking failed: at set-up, never mid-step
            total = sum(
                mb * n
                for mb, n in zip(config.pinned_pool_classes_mb, config.slab_counts(), strict=True)
            )
            raise ValueError(
                f"could not page-lock the activation pool ({total:g} MB: "
                f"pinned_pool_classes_mb x slabs_per_class): {exc}. Lower slabs_per_class"
            ) from exc
        self.metrics = ActivationStepMetrics()
        self.min_spill_bytes = max(config.recompute_threshold_bytes, config.min_spill_bytes, 1)
        self._track_kept = not self.memory.is_cuda
        self.table = SpillTable(
            config,
            memory=self.memory,
            transfer=self.transfer,
            pool=self.pool,
            track_restored=self._track_kept,
            packs=lambda: self.metrics.activations_saved,
            publish=self._publish,
        )
        self.registry, self.planner = self.table.registry, self.table.planner
        self._live: dict[int, list[int]] = {}
        """Kept storages counted in tracked memory: data_ptr -> [saved refs, bytes, data_ptr]
        (the entry each ``KeptTensor`` of that storage holds)."""
        self._unpublished = 0
        """Kept bytes counted here and not yet reported to ``DeviceMemory`` (signed)."""
        self._weights: dict[int, torch.Tensor] = {}
        """id -> the model's parameters and buffers: never spilled, never counted."""
        self._step: int | None = None
        self._closed = False
        self.packer = self._pack if config.enabled else _keep
        """``packer(tensor) -> Packed | None`` for ``SavedTensorRouter``."""

    @property
    def conductor(self) -> Any:
        """The Conductor, set by its adapter: each spill then asks it for a D2H slot first."""
        return self.table.conductor

    @conductor.setter
    def conductor(self, conductor: Any) -> None:
        self.table.conductor = conductor

    # -- lifecycle -------------------------------------------------------------------------------
    def set_watermarks(self, high_mb: float, low_mb: float) -> None:
        """New watermarks (MB), effective for the next saved tensor.

        Raises:
            ValueError: a negative watermark or low above high, naming the field.
        """
        self.budget.set_watermarks(high_mb, low_mb)

    def begin_step(self, step: int) -> None:
        """Start step ``step``: fresh counters, a new peak window, the model's weight storages
        (the seed's ``step_begin``; named as the weight runtime and the Conductor name it).

        Raises:
            RuntimeError: a step is already open, or the runtime is closed.
        """
        if self._closed:
            raise RuntimeError("ActivationRuntime is closed")
        if self._step is not None:
            raise RuntimeError(f"begin_step({step}) while step {self._step} is open")
        self._step = step
        self.metrics = ActivationStepMetrics(step=step)
        self.table.begin_step(self.metrics)
        if self.model is not None:
            # By identity, not storage address: a weight runtime swaps the storages of streamed
            # weights, and a freed address may come back as an activation. Refreshed each step
            # (adapters may have been added); the dict holds the tensors so no id is reused.
            tensors = chain(self.model.parameters(), self.model.buffers())
            self._weights = {id(t): t for t in tensors}
        self.memory.reset_peak()
        self.budget.reset()

    def managed_forward(self, install_hooks: bool = True) -> contextlib.AbstractContextManager:
        """The hook context (see ``hooks.managed_forward``)."""
        return managed_forward(self, install_hooks)

    def backward_begin(self) -> None:
        """Backward is about to start: finish in-flight spills, plan the backward order and
        restore its first ``restore_ahead`` tensors (the seed's strategy calls this from its
        BACKWARD phase; without it the first unpack starts the plan, and stalls once)."""
        self.table.begin_backward()

    def end_step(self) -> None:
        """End the step: finish every copy, release every record of the step, untrack what was
        kept, grow the pool if it missed too often, emit the ``activation_stagehand/step``
        record. Safe without ``begin_step`` (releases what the hooks created)."""
        self.table.end_step()
        for entry in self._live.values():
            self._unpublished -= entry[1]
            entry[0] = 0  # uncounted now: a KeptTensor freed later takes it below 0, a no-op
        self._live.clear()
        self._publish()
        self.metrics.vram_peak_mb = self.memory.peak_bytes() / MB
        self._grow_pool()
        if self.config.telemetry_enabled and self._step is not None:
            self.telemetry.emit(SOURCE, "step", **self.metrics.record())
        self._step = None

    def abort_step(self) -> None:
        """Undo a step left by an error (NOTE [ Aborted step ] in ``runtime/stagehand/weights/abort.py``):
        ``end_step`` if it is open (every copy finished, every record of the dead graph released,
        kept bytes untracked), the restore trace dropped, the spill hysteresis off. Tracked
        activation bytes are 0 after it."""
        if self._step is not None:
            self.end_step()
        self.planner.forget()
        self.budget.spilling = False

    def step_metrics(self) -> dict:
        """The step record's fields (``telemetry.STEP_FIELDS``) of the open or last step."""
        if self._step is not None:
            self.metrics.vram_peak_mb = self.memory.peak_bytes() / MB
        return self.metrics.record()

    def snapshot(self) -> dict:
        """The knobs in force (the user's, under the Conductor's caps), for the Conductor's
        runtime snapshots."""
        return {"max_d2h": self.transfer.d2h_limit, "max_h2d": self.transfer.h2d_limit}

    def close(self) -> None:
        """Release everything and free the pool; the packer keeps everything afterwards."""
        if self._closed:
            return
        self.end_step()
        self.pool.close()
        self._weights = {}
        if self._owns_telemetry:
            self.telemetry.close()
        self._closed = True
        self.packer = _keep

    # -- pack ------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> object | None:
        metrics = self.metrics
        seq = metrics.activations_saved  # this tensor's index among the step's saved tensors
        metrics.activations_saved = seq + 1
        nbytes = tensor.nbytes
        if self.budget.pressure(nbytes, self._unpublished) and nbytes >= self.min_spill_bytes:
            handle = self._try_spill(tensor, seq)
            if handle is not None:
                return handle
        metrics.activations_kept += 1
        if not self._track_kept:
            return None  # KEEP: the router saves the tensor itself
        # Tracked memory (CPU): see NOTE [ Tracking kept tensors ] in hooks.py. Inlined: this
        # runs for every kept tensor.
        weights = self._weights
        base = tensor._base
        if id(tensor) in weights or (base is not None and id(base) in weights):
            return None  # weights are not activations: never counted here
        key = tensor.data_ptr()
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [1, nbytes, key]
            self._unpublished += nbytes
            if self._unpublished >= PUBLISH_BYTES:
                self._publish()
        else:
            entry[0] += 1
        return KeptTensor((tensor, entry, self))

    def _release_kept(self, entry: list[int]) -> None:
        """The last ``KeptTensor`` of a storage was freed (its count reached 0): uncount it."""
        if self._live.get(entry[2]) is entry:
            del self._live[entry[2]]
        self._unpublished -= entry[1]
        if self._unpublished <= -PUBLISH_BYTES:
            self._publish()

    def _publish(self) -> None:
        """Report the kept bytes counted since the last report to ``DeviceMemory``."""
        pending, self._unpublished = self._unpublished, 0
        if pending > 0:
            try:
                self.memory.track(pending, CATEGORY)
            except torch.OutOfMemoryError:  # an emulated card: still unreported, end_step
                self._unpublished += pending  # takes them back with the kept entries
                raise
        elif pending < 0:
            self.memory.untrack(-pending, CATEGORY)

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        base = tensor._base  # the root of any chain of views
        if isinstance(tensor, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return True
        if id(tensor) in self._weights or (base is not None and id(base) in self._weights):
            return True
        # Without the model, a leaf that requires grad is taken for a parameter.
        return self.model is None and tensor.requires_grad and tensor.is_leaf

    def _try_spill(self, tensor: torch.Tensor, seq: int) -> SpilledTensor | None:
        if (
            tensor.device.type != self.device.type
            or tensor.layout is not torch.strided
            or in_backward()  # saved during backward: needed again right away
            or self._is_weight(tensor)
        ):
            return None
        span = span_elements(tuple(tensor.shape), tensor.stride())
        nbytes = span * tensor.element_size()
        if nbytes <= 0:
            return None
        return self.table.spill(tensor, seq, span, nbytes)

    # -- pool growth -------------------------------------------------------------------------------
    def _grow_pool(self) -> None:
        """Beyond the seed (v0 limit "fixed pool at init"): after a step with more than
        ``pool_growth_miss_threshold`` misses, add slabs to the classes that missed, within
        ``pinned_growth_budget_mb``. Tensors larger than every class cannot be helped."""
        threshold = self.config.pool_growth_miss_threshold
        if threshold <= 0 or self.metrics.pool_misses <= threshold:
            return
        misses_by_class = self.table.misses.items()
        for index, misses in sorted((i, n) for i, n in misses_by_class if i is not None):
            class_mb = self.pool.class_sizes_mb[index]
            try:
                added = self.pool.grow(class_mb, misses)
            except RuntimeError as exc:  # page-locking failed (a pinned-memory cap): no growth
                self.config.pool_growth_miss_threshold = 0
                self.telemetry.emit(
                    SOURCE, "event", event="pool_growth_failed", class_mb=class_mb, error=str(exc)
                )
                return
            if added:
                self.telemetry.emit(
                    SOURCE,
                    "event",
                    event="pool_grown",
                    class_mb=class_mb,
                    slabs_added=added,
                    pool_total_mb=self.pool.total_bytes() / MB,
                )


def _keep(tensor: torch.Tensor) -> None:
    return None
