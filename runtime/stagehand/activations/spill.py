"""``SpillTable``: the spilled side of the activation runtime, behind a public contract.

The runtime decides *whether* a saved tensor spills (watermark, size, weights, backward); the
table owns everything after that: the record, the D2H copy into a pool buffer, the restore for
backward (on demand, or ahead of need along the ``RestorePlanner``'s order), the H2D copy and
its event, and the release of every buffer. ``SpilledTensor`` (what autograd holds) calls
``unpack`` and ``release``; the runtime calls ``spill``, ``refuse``, ``poll``,
``begin_backward`` and ``end_step``. Restores run on the H2D stream; on CUDA a restored
tensor's consumer waits on its event on the device (no host synchronize), and the host buffer
returns to the pool once the host sees the copy done.

Contract (as ``torch.autograd.graph.saved_tensors_hooks``): ``unpack(spill(t))`` equals ``t`` in
value, size, stride, dtype and device.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from stagehand.activations.hooks import SpilledTensor, rebuild, span_bytes_view
from stagehand.activations.pool import CPUSpillBackend
from stagehand.activations.prefetch import RestorePlanner
from stagehand.activations.registry import (
    ActivationRecord,
    ActivationRegistry,
    ActivationStateError,
)
from stagehand.activations.registry import ActivationState as S
from stagehand.activations.telemetry import ActivationStepMetrics
from stagehand.activations.transfer import ActivationTransferEngine
from stagehand.common.memory import DeviceMemory
from stagehand.config.memory import ActivationStagehandConfig

CATEGORY = "activations"
"""``DeviceMemory`` category of kept and restored saved tensors (tracked on CPU)."""


class ChecksumError(RuntimeError):
    """A restored tensor's CRC32 differs from the one taken when it was spilled."""


class SpillTable:
    """Records of spilled saved tensors, their copies and buffers (see the module docstring).

    Args:
        config: the runtime's config (``predictive_restore``, ``restore_ahead``,
            ``debug_checksums``).
        memory: the shared ``DeviceMemory``; restored bytes are tracked there when
            ``track_restored`` (CPU: no allocator to ask).
        transfer: the D2H/H2D copy engine (its in-flight caps bound the copies).
        pool: the size-class host pool the spills go to.
        packs: the number of tensors the runtime has packed in this step (a restore plan is
            for the graph that saved them).
        publish: called before a restore is tracked, so the tracked figure includes the kept
            bytes the runtime counted but has not reported yet.
    """

    def __init__(
        self,
        config: ActivationStagehandConfig,
        *,
        memory: DeviceMemory,
        transfer: ActivationTransferEngine,
        pool: CPUSpillBackend,
        track_restored: bool,
        packs: Callable[[], int],
        publish: Callable[[], None],
    ) -> None:
        self.config = config
        self.memory = memory
        self.transfer = transfer
        self.pool = pool
        self.is_cuda = transfer.device.type == "cuda"
        self.track_restored = track_restored
        self.packs = packs
        self.publish = publish
        self.conductor: Any = None
        """The Conductor (its adapter sets it through the runtime): each spill first asks it
        for a D2H slot."""
        self.registry = ActivationRegistry()
        self.planner = RestorePlanner()
        self.metrics = ActivationStepMetrics()
        """The open step's counters (the runtime's; ``begin_step`` hands them over)."""
        self.misses: Counter[int | None] = Counter()
        """Pool misses of the step by size class (None: larger than every class)."""
        self._spilled: list[ActivationRecord] = []
        self._pending: list[tuple[Any, torch.Tensor]] = []
        """(H2D event, host buffer) of restores released before their copy was seen done."""

    # -- step ------------------------------------------------------------------------------------
    def begin_step(self, metrics: ActivationStepMetrics) -> None:
        """A new step counts into ``metrics``."""
        self.metrics = metrics
        self.misses.clear()

    def begin_backward(self) -> None:
        """Finish in-flight spills, plan the backward order and restore its first
        ``restore_ahead`` tensors (when the plan has not started with a first unpack)."""
        self._finalize(list(self.transfer.d2h_inflight))
        if not self.planner.active:
            self._start_plan()

    def end_step(self) -> None:
        """Finish every copy and release every record of the step; keep the trace."""
        self._finalize(list(self.transfer.d2h_inflight))
        for record in self.transfer.completed_restores(block=True):
            self._restored(record)
        self._retire_pending(block=True)
        for record in self.registry:
            self.release(record)
        self._spilled = []
        self.planner.end_step(self.packs())

    # -- pack side -------------------------------------------------------------------------------
    def spill(self, tensor: torch.Tensor, seq: int, span: int, nbytes: int) -> SpilledTensor | None:
        """Start the D2H copy of ``tensor`` (``span`` elements, ``nbytes`` bytes from its first
        element) into a pool buffer; None when the copy cannot start (the D2H cap is 0, or the
        Conductor denies a slot), the tensor then being kept (a KEPT record)."""
        self.poll()
        transfer = self.transfer
        if not transfer.can_spill():
            if transfer.d2h_limit == 0:
                return self.refuse(tensor, seq)
            # The seed's inline finalize: without it only one tensor per step would spill.
            self._finalize(list(transfer.d2h_inflight))
            self.metrics.inline_finalizes += 1
        grant = None
        conductor = self.conductor
        if conductor is not None:
            grant = conductor.request_transfer("d2h", "required")
            if not grant.granted:
                return self.refuse(tensor, seq)
        buffer, pooled = self.pool.acquire(nbytes)
        record = self.registry.create(seq, S.SPILLING, tensor)
        record.span, record.nbytes, record.buffer, record.pooled = span, nbytes, buffer, pooled
        record.grant = grant
        source = span_bytes_view(tensor, span)
        record.device_tensor = source  # held until the D2H copy completes
        record.event = transfer.spill_copy(source, buffer)
        transfer.d2h_inflight.append(record)
        metrics = self.metrics
        metrics.activations_spilled += 1
        metrics.spill_bytes += nbytes
        if pooled:
            metrics.pool_hits += 1
        else:
            metrics.pool_misses += 1
            self.misses[self.pool.class_for(nbytes)] += 1
        self._spilled.append(record)
        if self.planner.active:
            self.planner.active = False  # a new forward after a backward: plan again
        if not transfer.asynchronous:
            self._finalize([record])  # the copy was synchronous
        return SpilledTensor(record, self)

    def refuse(self, tensor: torch.Tensor, seq: int) -> None:
        """Keep ``tensor`` although it was to spill (a KEPT record, counted as denied)."""
        self.registry.create(seq, S.KEPT, tensor)
        self.metrics.spills_denied += 1
        return None

    def poll(self) -> None:
        """Retire the copies the device finished (never blocks)."""
        transfer = self.transfer
        if transfer.d2h_inflight:
            for record in transfer.completed_spills():
                self._spilled_done(record)
        if transfer.h2d_inflight:
            for record in transfer.completed_restores():
                self._restored(record)
        if self._pending:
            self._retire_pending()

    def _finalize(self, records: list[ActivationRecord]) -> None:
        for record in self.transfer.finalize(records):
            self._spilled_done(record)

    def _spilled_done(self, record: ActivationRecord) -> None:
        self.registry.transition(record, S.SPILLED)
        record.device_tensor = None  # the device memory is free once forward drops it too
        if record.grant is not None:
            record.grant.release()
            record.grant = None
        if self.config.debug_checksums:
            record.crc32 = zlib.crc32(record.buffer.numpy())

    # -- unpack side -----------------------------------------------------------------------------
    def unpack(self, record: ActivationRecord) -> torch.Tensor:
        """The tensor ``record`` was spilled from, back on the device: restored now (a stall)
        unless a restore ahead of need got there first.

        Raises:
            ActivationStateError: ``record`` was released (unpacked after its step ended).
            ChecksumError: with ``debug_checksums``, the restored bytes differ.
        """
        if record.state is S.RELEASED:
            raise _released_error(record)
        self.poll()
        if record.state is S.SPILLING:
            self._finalize([record])
        first = not record.unpacked
        if first:
            record.unpacked = True
            self.planner.observe(record)
        if not self.planner.active:
            self._start_plan(prefetch=False)  # this unpack stalls; prefetch starts after it
        metrics = self.metrics
        if record.state is S.SPILLED:
            t0 = time.perf_counter()
            self._restore(record)
            metrics.stall_count += 1
            metrics.stall_time_ms += (time.perf_counter() - t0) * 1e3
        elif first:
            metrics.prefetch_hits += 1  # RESTORING or RESTORED: a prefetch got there first
        if record.state is S.RESTORING:
            record.event.wait()  # device-side: the compute stream waits for the H2D copy
        if self.config.predictive_restore and first:
            self._prefetch(record.plan_pos)
        return rebuild(record.device_tensor, record)

    def _start_plan(self, prefetch: bool = True) -> None:
        live = [r for r in self._spilled if r.state in (S.SPILLING, S.SPILLED)]
        self.planner.build(live, self.packs())
        if prefetch and self.config.predictive_restore:
            self._prefetch(-1)

    def _prefetch(self, pos: int) -> None:
        if pos < 0 and not self.planner.plan:
            return
        for record in self.planner.ahead(pos, self.config.restore_ahead):
            if record.state is S.SPILLING:
                self._finalize([record])
            if record.state is not S.SPILLED:
                continue
            if not self.transfer.can_restore():
                for done in self.transfer.completed_restores():
                    self._restored(done)
                if not self.transfer.can_restore():
                    return
            self._restore(record)

    def _restore(self, record: ActivationRecord) -> None:
        t0 = time.perf_counter()
        if self.track_restored:
            # A restore is big and rare: report exactly, with what is pending. Before the
            # record changes state: an emulated card's out-of-memory error leaves it SPILLED.
            self.publish()
            self.memory.track(record.nbytes, CATEGORY)
            record.tracked = record.nbytes
        self.registry.transition(record, S.RESTORING)
        record.device_tensor, record.event = self.transfer.restore_copy(record.buffer)
        metrics = self.metrics
        metrics.activations_restored += 1
        metrics.restore_bytes += record.nbytes
        if self.transfer.asynchronous:
            self.transfer.h2d_inflight.append(record)
        else:
            self._restored(record)
        metrics.restore_ms += (time.perf_counter() - t0) * 1e3

    def _restored(self, record: ActivationRecord) -> None:
        """The H2D copy of ``record`` completed: check it, return the host buffer."""
        if record.state is not S.RESTORING:
            return  # released while in flight; its buffer went to ``_pending``
        if self.config.debug_checksums:
            crc = zlib.crc32(record.device_tensor.cpu().numpy())
            if crc != record.crc32:
                raise ChecksumError(
                    f"activation record {record.id} (seq {record.seq}): CRC32 {crc:#010x} after "
                    f"restore, {record.crc32:#010x} at spill"
                )
        self.pool.release(record.buffer)
        record.buffer = None
        self.registry.transition(record, S.RESTORED)

    def _retire_pending(self, block: bool = False) -> None:
        keep = []
        for event, buffer in self._pending:
            if block:
                event.synchronize()
            if block or event.query():
                self.pool.release(buffer)
            else:
                keep.append((event, buffer))
        self._pending = keep

    # -- release ---------------------------------------------------------------------------------
    def release(self, record: ActivationRecord) -> None:
        """Autograd freed the saved tensor (or the step ended): free what the record holds."""
        state = record.state
        if state is S.RELEASED:
            return
        if state is S.SPILLING:
            self._finalize([record])
        if record.state is S.RESTORING and record in self.transfer.h2d_inflight:
            self.transfer.h2d_inflight.remove(record)
            # Never consumed: the allocator must not reuse it before the H2D copy lands.
            self.transfer.h2d.hold(record.device_tensor)
            self._pending.append((record.event, record.buffer))
            record.buffer = None
        if record.buffer is not None:
            self.pool.release(record.buffer)
            record.buffer = None
        record.device_tensor = None
        if record.tracked:
            self.memory.untrack(record.tracked, CATEGORY)
            record.tracked = 0
        if record.grant is not None:
            record.grant.release()
            record.grant = None
        self.registry.transition(record, S.RELEASED)
        self.registry.forget(record)


def _released_error(record: ActivationRecord) -> ActivationStateError:
    return ActivationStateError(
        f"activation record {record.id} (seq {record.seq}) was unpacked in state "
        f"{record.state.name}: it was released (end_step before backward?) and expected "
        f"SPILLED, RESTORING or RESTORED"
    )
