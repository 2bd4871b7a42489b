"""TransferManager: separate H2D and D2H slot pools; a runtime holds a slot per PCIe copy.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Transfer Slot Management"). A runtime asks for a slot
before it issues a copy and releases it when the copy is done::

    with conductor.request_transfer("h2d", "speculative") as grant:
        if grant.granted:
            ...  # issue the copy
        else:
            log(grant.reason)  # a DenialReason, never a bare False

Order of the checks (the first that fails decides the reason):

1. SPECULATIVE / BACKGROUND while the policy suppresses speculation
   -> ``PHASE_RULE_SUPPRESSED_SPECULATIVE``.
2. Every slot of the direction's pool held -> ``H2D_SLOTS_EXHAUSTED`` / ``D2H_SLOTS_EXHAUSTED``.
   This is a *full check* for Rule 3 (contention); a request that finds a free slot resets
   the run of consecutive full checks.
3. In flight already at the policy's ``max_inflight_h2d`` / ``max_inflight_d2h``
   -> ``POLICY_H2D_LIMIT`` / ``POLICY_D2H_LIMIT``. CRITICAL requests skip this check: the
   policy tightens speculative and ordinary traffic, never work the step cannot do without.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from stagehand.conductor.types import DenialReason, Priority, Releasable

DIRECTIONS = ("h2d", "d2h")
_EXHAUSTED = {"h2d": DenialReason.H2D_SLOTS_EXHAUSTED, "d2h": DenialReason.D2H_SLOTS_EXHAUSTED}
_POLICY = {"h2d": DenialReason.POLICY_H2D_LIMIT, "d2h": DenialReason.POLICY_D2H_LIMIT}


def parse_direction(direction: str) -> str:
    """``"h2d"`` or ``"d2h"`` (any case).

    Raises:
        ValueError: anything else.
    """
    if isinstance(direction, str) and direction.lower() in DIRECTIONS:
        return direction.lower()
    raise ValueError(f'transfer direction must be "h2d" or "d2h", got {direction!r}')


class TransferGrant(Releasable):
    """The answer to one slot request. ``granted`` is True when a slot is held.

    ``reason`` is a ``DenialReason`` when denied, else None. ``release()`` returns the slot and
    is idempotent; as a context manager the slot is returned on every exit path.
    """

    __slots__ = ("id", "direction", "priority", "granted", "reason")

    def __init__(
        self,
        manager: TransferManager | None,
        id: int,
        direction: str,
        priority: Priority,
        reason: DenialReason | None,
    ) -> None:
        self.id = id
        self.direction = direction
        self.priority = priority
        self.granted = reason is None
        self.reason = reason
        self._manager = manager
        self._released = not self.granted or manager is None

    def __bool__(self) -> bool:
        return self.granted

    def __repr__(self) -> str:
        state = "granted" if self.granted else f"denied: {self.reason.name}"  # type: ignore[union-attr]
        return f"TransferGrant({self.direction}, {self.priority.name}, {state})"


class TransferManager:
    """H2D and D2H slot pools of ``h2d_slots`` and ``d2h_slots`` slots (thread-safe).

    ``limit`` holds the policy's caps (``max_inflight_h2d``/``_d2h``) and ``suppress_speculative``
    its suppression; ``set_limits`` updates them at each phase boundary.
    """

    def __init__(
        self,
        h2d_slots: int,
        d2h_slots: int,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        for name, n in (("h2d_slots", h2d_slots), ("d2h_slots", d2h_slots)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        self.slots = {"h2d": h2d_slots, "d2h": d2h_slots}
        self.limit = dict(self.slots)
        self.suppress_speculative = False
        self._held: dict[str, dict[int, TransferGrant]] = {"h2d": {}, "d2h": {}}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._on_event = on_event
        self.consecutive_full = 0
        """Requests in a row that found every slot of their pool held (Rule 3's checks)."""
        self.counts = {"grant": 0, "deny": 0}

    def inflight(self, direction: str) -> int:
        return len(self._held[parse_direction(direction)])

    def looks_full(self, direction: str) -> bool:
        """Whether a request now would find every slot held, or the policy's cap reached
        (``direction`` already parsed): the moment to reclaim finished copies first."""
        held = len(self._held[direction])
        return held >= self.slots[direction] or held >= self.limit[direction]

    def set_limits(self, max_inflight_h2d: int, max_inflight_d2h: int, suppress: bool) -> None:
        """The policy's caps and suppression for the phase now starting."""
        self.limit = {"h2d": max_inflight_h2d, "d2h": max_inflight_d2h}
        self.suppress_speculative = suppress

    def request_transfer(self, direction: str, priority: Priority | str) -> TransferGrant:
        """A slot for one ``direction`` copy of ``priority``, or a typed denial.

        Raises:
            ValueError: ``direction`` is not ``"h2d"``/``"d2h"`` or ``priority`` names no
                priority.
        """
        direction, priority = parse_direction(direction), Priority.parse(priority)
        with self._lock:
            held = self._held[direction]
            reason = None
            if self.suppress_speculative and priority <= Priority.SPECULATIVE:
                reason = DenialReason.PHASE_RULE_SUPPRESSED_SPECULATIVE
            elif len(held) >= self.slots[direction]:
                reason = _EXHAUSTED[direction]
                self.consecutive_full += 1
            else:
                self.consecutive_full = 0
                if priority is not Priority.CRITICAL and len(held) >= self.limit[direction]:
                    reason = _POLICY[direction]
            grant = TransferGrant(self, next(self._ids), direction, priority, reason)
            if grant.granted:
                held[grant.id] = grant
            self.counts["grant" if grant.granted else "deny"] += 1
            fields = {
                "direction": direction,
                "priority": priority.name.lower(),
                "slot": grant.id,
                "reason": reason.value if reason else None,
                "inflight": len(held),
            }
        self._event("slot_acquire" if grant.granted else "slot_denied", fields)
        return grant

    def _release(self, grant: TransferGrant) -> None:
        with self._lock:
            if grant._released:
                return
            grant._released = True
            held = self._held[grant.direction]
            held.pop(grant.id, None)
            fields = {"direction": grant.direction, "slot": grant.id, "inflight": len(held)}
        self._event("slot_release", fields)

    def release_held(self) -> int:
        """Release every slot still held (an aborted step's: its copies were drained, a slot
        granted to a load the card refused was never used); returns how many were held."""
        with self._lock:
            held = [g for pool in self._held.values() for g in pool.values()]
        for grant in held:
            self._release(grant)
        return len(held)

    def reset_counts(self) -> None:
        self.counts = {"grant": 0, "deny": 0}

    def _event(self, event: str, fields: dict[str, Any]) -> None:
        if self._on_event is not None:
            self._on_event(event, fields)
