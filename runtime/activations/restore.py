"""The backward side of ``ActivationRuntime``: unpack, restore (on demand or predictive), release.

Kept apart from ``runtime.py`` (the lifecycle and the pack side) to keep each file readable; the
mixin works on the runtime's registry, transfer engine, pool, planner and counters. Restores run
on the H2D stream; on CUDA a restored tensor's consumer waits on its event on the device (no
host synchronize), and the host buffer returns to the pool once the host sees the copy done.
"""

from __future__ import annotations

import time
import zlib

import torch

from runtime.activations.hooks import rebuild
from runtime.activations.registry import ActivationRecord, ActivationStateError
from runtime.activations.registry import ActivationState as S

CATEGORY = "activations"
"""``DeviceMemory`` category of kept and restored saved tensors (tracked on CPU)."""


class ChecksumError(RuntimeError):
    """A restored tensor's CRC32 differs from the one taken when it was spilled."""


class RestoreMixin:
    """Backward-side methods of ``ActivationRuntime`` (see the module docstring)."""

    # -- unpack and restore ------------------------------------------------------------------------
    def _unpack_record(self, record: ActivationRecord) -> torch.Tensor:
        if record.state is S.RELEASED:
            raise _released_error(record)
        self._poll()
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
        if self.predictive_restore and first:
            self._prefetch(record.plan_pos)
        return rebuild(record.device_tensor, record)

    def _start_plan(self, prefetch: bool = True) -> None:
        live = [r for r in self._spilled if r.state in (S.SPILLING, S.SPILLED)]
        self.planner.build(live, self._seq)
        if prefetch and self.predictive_restore:
            self._prefetch(-1)

    def _prefetch(self, pos: int) -> None:
        if pos < 0 and not self.planner.plan:
            return
        for record in self.planner.ahead(pos, self.restore_ahead):
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
        self.registry.transition(record, S.RESTORING)
        record.device_tensor, record.event = self.transfer.restore_copy(record.buffer)
        metrics = self.metrics
        metrics.activations_restored += 1
        metrics.restore_bytes += record.nbytes
        if self._track_kept:
            self._publish()  # a restore is big and rare: report exactly, with what is pending
            self.memory.track(record.nbytes, CATEGORY)
            record.tracked = record.nbytes
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

    def _poll(self) -> None:
        transfer = self.transfer
        if transfer.d2h_inflight:
            for record in transfer.completed_spills():
                self._spilled_done(record)
        if transfer.h2d_inflight:
            for record in transfer.completed_restores():
                self._restored(record)
        if self._pending:
            self._retire_pending()

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
    def _release_record(self, record: ActivationRecord) -> None:
        """Autograd freed the saved tensor (or the step ended): free what the record holds."""
        state = record.state
        if state is S.RELEASED:
            return
        if state is S.SPILLING:
            self._finalize([record])
        if record.state is S.RESTORING and record in self.transfer.h2d_inflight:
            self.transfer.h2d_inflight.remove(record)
            if self.is_cuda:
                # Never consumed: the allocator must not reuse it before the H2D copy lands.
                record.device_tensor.record_stream(self.transfer.h2d.stream)
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
