"""D2H spill and H2D restore copies on dedicated streams, with in-flight caps.

Source: "Activation Stagehand" ("transfer.py", "D2H transfer engine"). Spills
and restores use their own streams, separate from the weight runtime's, and at most
``d2h_limit`` / ``h2d_limit`` copies are in flight so the PCIe link stays shared: the user's
``max_d2h`` / ``max_h2d`` (live knobs) under the Conductor's caps (``set_caps``; a D2H cap of 0 in
OPTIMIZER: no new spills). On CPU both streams are synchronous stand-ins: a copy is complete when it returns.
"""

from __future__ import annotations

from typing import Any

import torch

from stagehand.common.device import TransferEvent, TransferStream, device_empty


def _check_cap(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ActivationTransferEngine:
    """Copies for the activation runtime; tracks which records have copies in flight.

    Args:
        device: the compute device.
        max_d2h: D2H copies in flight at once; 0 means no new spills.
        max_h2d: H2D copies in flight at once (>= 1: backward cannot proceed without restores).

    Raises:
        ValueError: a negative ``max_d2h`` or a ``max_h2d`` below 1 (also on assignment).
    """

    def __init__(self, device: torch.device | str, max_d2h: int = 1, max_h2d: int = 1) -> None:
        self.device = torch.device(device)
        self._d2h_cap: int | None = None
        self._h2d_cap: int | None = None
        self._max_d2h = _check_cap("max_inflight_d2h", max_d2h, 0)
        self._max_h2d = _check_cap("max_inflight_h2d", max_h2d, 1)
        self._refresh_limits()
        self.d2h = TransferStream(self.device)
        self.h2d = TransferStream(self.device)
        self.d2h_inflight: list[Any] = []
        """Records whose D2H copy was issued and not yet finalized."""
        self.h2d_inflight: list[Any] = []
        """Records whose H2D copy was issued and whose host buffer is not yet returned."""

    @property
    def asynchronous(self) -> bool:
        """Whether copies may still run after they were issued (``TransferStream``)."""
        return self.d2h.asynchronous

    @property
    def max_d2h(self) -> int:
        return self._max_d2h

    @max_d2h.setter
    def max_d2h(self, value: int) -> None:
        self._max_d2h = _check_cap("max_inflight_d2h", value, 0)
        self._refresh_limits()

    @property
    def max_h2d(self) -> int:
        return self._max_h2d

    @max_h2d.setter
    def max_h2d(self, value: int) -> None:
        self._max_h2d = _check_cap("max_inflight_h2d", value, 1)
        self._refresh_limits()

    def set_caps(self, d2h: int | None, h2d: int | None) -> None:
        """The Conductor's caps (its adapter publishes them; None: no cap). The limits in force
        are ``d2h_limit = min(max_d2h, d2h)`` and ``h2d_limit = min(max_h2d, h2d)``; the user's
        ``max_d2h``/``max_h2d`` are never written, so a live change of them survives a cap.

        Raises:
            ValueError: a negative ``d2h`` or an ``h2d`` below 1.
        """
        self._d2h_cap = None if d2h is None else _check_cap("d2h cap", d2h, 0)
        self._h2d_cap = None if h2d is None else _check_cap("h2d cap", h2d, 1)
        self._refresh_limits()

    def _refresh_limits(self) -> None:
        # Computed when a setting or a cap changes, not per saved tensor: the pack hook reads
        # ``d2h_limit`` once per tensor.
        d2h, h2d = self._d2h_cap, self._h2d_cap
        self.d2h_limit = self._max_d2h if d2h is None else min(self._max_d2h, d2h)
        self.h2d_limit = self._max_h2d if h2d is None else min(self._max_h2d, h2d)

    # -- D2H ---------------------------------------------------------------------------------------
    def can_spill(self) -> bool:
        """True when one more D2H copy fits under ``d2h_limit``."""
        return len(self.d2h_inflight) < self.d2h_limit

    def spill_copy(self, source: torch.Tensor, buffer: torch.Tensor) -> TransferEvent:
        """Copy ``source`` (1-D, contiguous, uint8 view of the device span) into the host
        ``buffer`` on the D2H stream. The caller must keep ``source`` alive until the returned
        event completes (``finalize``)."""
        with self.d2h.use():
            self.d2h.copy_(buffer, source)
            return self.d2h.record()

    def finalize(self, records: list[Any]) -> list[Any]:
        """Block until the D2H copies of ``records`` finished; return them (the seed's inline
        finalize: frees the in-flight slots so the next spill can start)."""
        for record in records:
            record.event.synchronize()
            if record in self.d2h_inflight:
                self.d2h_inflight.remove(record)
        return records

    def completed_spills(self) -> list[Any]:
        """In-flight spills whose copy has finished (never blocks)."""
        done = [r for r in self.d2h_inflight if r.event.query()]
        for record in done:
            self.d2h_inflight.remove(record)
        return done

    # -- H2D ---------------------------------------------------------------------------------------
    def can_restore(self) -> bool:
        """True when one more H2D copy fits under ``h2d_limit``."""
        return len(self.h2d_inflight) < self.h2d_limit

    def restore_copy(self, buffer: torch.Tensor) -> tuple[torch.Tensor, TransferEvent]:
        """A new device tensor (uint8, same length) filled from the host ``buffer`` on the H2D
        stream, and the event its consumer must wait on.

        The destination is allocated on the compute stream (so the caching allocator ties it to
        the stream that will read it) before the H2D stream, which first waits for the compute
        stream's queued work, writes it.
        """
        target = device_empty(buffer.nbytes, self.device).view(buffer.shape)
        with self.h2d.use():
            self.h2d.copy_(target, buffer)
            return target, self.h2d.record()

    def completed_restores(self, block: bool = False) -> list[Any]:
        """In-flight restores whose copy has finished (all of them, waiting, when ``block``)."""
        done = []
        for record in list(self.h2d_inflight):
            if block:
                record.event.synchronize()
            if block or record.event.query():
                done.append(record)
                self.h2d_inflight.remove(record)
        return done
