"""Records of the saved tensors the activation runtime manages, and their asserted states.

Source: "Activation Stagehand" (``registry.py``: ActivationState,
ActivationRecord, ActivationRegistry). A record exists for every *spilled* tensor and for every
tensor whose spill was refused (Conductor denial, D2H cap 0); tensors kept because VRAM is below
the watermark take the KEEP fast path and are only counted (a record each would cost more than
the near-zero KEEP the seed promises).

States and what moves a record on (FSDP2 ``TrainingState`` style)::

    KEPT      --step end / handle freed-->  RELEASED
    SPILLING  --D2H copy complete-------->  SPILLED     (or RELEASED at step end)
    SPILLED   --restore issued (H2D)----->  RESTORING   (or RELEASED)
    RESTORING --H2D copy complete-------->  RESTORED    (or RELEASED)
    RESTORED  --autograd freed it-------->  RELEASED
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from typing import Any

import torch


class ActivationState(enum.Enum):
    KEPT = "kept"
    """Left on the device although a spill was considered (refused); moved on by release."""
    SPILLING = "spilling"
    """D2H copy into a host buffer in flight; the device tensor is still held until it completes."""
    SPILLED = "spilled"
    """Only the host copy exists; moved on by a restore (prefetch or on demand)."""
    RESTORING = "restoring"
    """H2D copy in flight into a fresh device tensor."""
    RESTORED = "restored"
    """Back on the device; the host buffer has returned to the pool."""
    RELEASED = "released"
    """Autograd dropped the saved tensor, or the step ended: nothing is held."""


_S = ActivationState
LEGAL_NEXT: dict[ActivationState, frozenset[ActivationState]] = {
    _S.KEPT: frozenset({_S.RELEASED}),
    _S.SPILLING: frozenset({_S.SPILLED, _S.RELEASED}),
    _S.SPILLED: frozenset({_S.RESTORING, _S.RELEASED}),
    _S.RESTORING: frozenset({_S.RESTORED, _S.RELEASED}),
    _S.RESTORED: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
}


class ActivationStateError(RuntimeError):
    """A record was moved to a state its current state does not allow."""


class ActivationRecord:
    """One managed saved tensor.

    Layout fields describe the tensor autograd saved: ``size``/``stride`` (elements), ``dtype``,
    ``device``. ``span`` is the number of elements of storage the view covers (see NOTE [ Spilled
    view layout ] in ``hooks.py``) and ``nbytes`` that span in bytes, the amount copied D2H/H2D.
    """

    __slots__ = (
        "id",
        "seq",
        "state",
        "size",
        "stride",
        "dtype",
        "device",
        "span",
        "nbytes",
        "buffer",
        "pooled",
        "device_tensor",
        "event",
        "grant",
        "crc32",
        "tracked",
        "plan_pos",
        "unpacked",
    )

    def __init__(self, id: int, seq: int, state: ActivationState, tensor: torch.Tensor) -> None:
        self.id = id
        self.seq = seq
        """Index of the tensor among those this runtime saw in the step (pack order)."""
        self.state = state
        self.size = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.span = 0
        self.nbytes = 0
        self.buffer: torch.Tensor | None = None
        """Host copy (uint8, ``nbytes`` long) while SPILLING/SPILLED/RESTORING."""
        self.pooled = False
        self.device_tensor: torch.Tensor | None = None
        """The source while SPILLING, the kept tensor while KEPT, the restored span after."""
        self.event: Any = None
        self.grant: Any = None
        self.crc32: int | None = None
        self.tracked = 0
        """Bytes this record counts in the tracked device figure (CPU), untracked on release."""
        self.plan_pos = -1
        """Position in the step's predicted backward order (predictive restore)."""
        self.unpacked = False

    def __repr__(self) -> str:
        return (
            f"ActivationRecord(id={self.id}, seq={self.seq}, {self.state.name}, "
            f"size={list(self.size)}, {self.dtype}, {self.nbytes} bytes)"
        )


class ActivationRegistry:
    """The records of the current step, by id, with asserted transitions."""

    def __init__(self) -> None:
        self._records: dict[int, ActivationRecord] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ActivationRecord]:
        return iter(list(self._records.values()))

    def create(self, seq: int, state: ActivationState, tensor: torch.Tensor) -> ActivationRecord:
        """A new record in ``state`` (KEPT or SPILLING), registered under a fresh id."""
        if state not in (_S.KEPT, _S.SPILLING):
            raise ActivationStateError(
                f"a record starts KEPT or SPILLING, got {state.name} (seq {seq})"
            )
        record = ActivationRecord(next(self._ids), seq, state, tensor)
        self._records[record.id] = record
        return record

    def get(self, record_id: int) -> ActivationRecord:
        """The record ``record_id``.

        Raises:
            KeyError: no such record in this step (released at step end or never created).
        """
        try:
            return self._records[record_id]
        except KeyError:
            raise KeyError(f"no activation record {record_id} in the current step") from None

    @staticmethod
    def transition(record: ActivationRecord, new: ActivationState) -> None:
        """Move ``record`` to ``new``.

        Raises:
            ActivationStateError: ``new`` is not legal after the current state; the message
                names the record, both states and the states that were expected.
        """
        if new not in LEGAL_NEXT[record.state]:
            expected = " or ".join(sorted(s.name for s in LEGAL_NEXT[record.state])) or "nothing"
            raise ActivationStateError(
                f"activation record {record.id}: illegal transition {record.state.name} -> "
                f"{new.name} (after {record.state.name} expected {expected})"
            )
        record.state = new

    def forget(self, record: ActivationRecord) -> None:
        """Drop a RELEASED record from the table."""
        if record.state is not _S.RELEASED:
            raise ActivationStateError(
                f"activation record {record.id}: forget expects RELEASED, found {record.state.name}"
            )
        self._records.pop(record.id, None)

    def in_state(self, state: ActivationState) -> list[ActivationRecord]:
        return [r for r in self._records.values() if r.state is state]

    def iter_spilling(self) -> list[ActivationRecord]:
        """Records whose D2H copy is in flight (the seed's inline finalize works on these)."""
        return self.in_state(_S.SPILLING)

    def counts(self) -> dict[str, int]:
        """Records per state name, for tests and debugging."""
        out = {s.name: 0 for s in ActivationState}
        for r in self._records.values():
            out[r.state.name] += 1
        return out
