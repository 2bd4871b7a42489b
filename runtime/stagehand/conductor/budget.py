"""BudgetManager: VRAM headroom and pinned-host reservations with typed modes and priorities.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Budget Arbitration"). The seed gives one line per mode;
the rules below are what this module implements, with the choices the seed leaves open.

Resources: ``"vram"`` (measured against ``vram_soft_cap_mb`` / ``vram_hard_cap_mb``; *used* is
``DeviceMemory.usage_bytes()`` plus the VRAM reservations still held, which counts a reservation
twice once its tensor exists: conservative, and reservations are short-lived) and ``"pinned"``
(``pinned_budget_mb``; *used* is the pinned reservations held; its soft and hard cap are equal).

Cap a request is measured against (``limit``), by priority and mode:

=============  ==========================  ==========================================
priority       HARD, SOFT                  BURST, FLOOR
=============  ==========================  ==========================================
CRITICAL       hard cap                    hard cap
REQUIRED       soft cap                    hard cap
SPECULATIVE    soft cap                    soft cap
BACKGROUND     threshold x soft cap        threshold x soft cap
=============  ==========================  ==========================================

(``threshold`` is ``backward_pressure_threshold``, 0.8.) Why: CRITICAL work cannot wait, so it
may always use the region between the caps; BURST ("can exceed soft cap up to hard cap") and
FLOOR ("guaranteed minimum") open that region to REQUIRED work too, but never to speculative
work, which must not eat the headroom kept for emergencies. BACKGROUND work stops below Rule 1's
pressure threshold so that it can never itself be what triggers backward pressure.

Shape of the grant, by mode, with ``room = limit - used`` (and, when the owner declared a
CEILING for this resource, ``room`` at most ``ceiling - owner's held reservations``):

=========  ==========================================================================
mode       grant
=========  ==========================================================================
HARD       FULL when ``mb <= room``, else DENIED (never partial).
SOFT       FULL when ``mb <= room``; PARTIAL of ``room`` when ``min_mb <= room < mb`` and
           ``room > 0``; else DENIED.
BURST      as SOFT, against the BURST column's cap.
FLOOR      as HARD, against the BURST column's cap: a guaranteed minimum is all or nothing.
CEILING    always FULL and reserves nothing: declares ``mb`` as the owner's upper bound for
           this resource until released ("upper bound hint"); later requests of that owner
           are clipped to it (HARD/FLOOR denied with CEILING_EXCEEDED, SOFT/BURST partial).
=========  ==========================================================================

Whatever the mode, SPECULATIVE and BACKGROUND requests are DENIED with
PHASE_RULE_SUPPRESSED_SPECULATIVE while the policy suppresses speculation (Rules 1, 2).
A phase-scoped reservation is released when the phase it was made in ends.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

from stagehand.common.phases import Phase
from stagehand.conductor.types import BudgetMode, DenialReason, GrantOutcome, Priority, Releasable
from stagehand.config.memory import MB, ConductorConfig

RESOURCES = ("vram", "pinned")


class Reservation(Releasable):
    """One budget request and its answer; ``release()`` (idempotent) gives the MB back.

    Usable as a context manager: the reservation is released on leaving the block, errors
    included. ``granted_mb`` is what the holder may use (0 when denied, and for CEILING).
    """

    __slots__ = (
        "id",
        "resource",
        "owner",
        "mode",
        "priority",
        "requested_mb",
        "granted_mb",
        "outcome",
        "reason",
        "scope",
    )

    def __init__(self, manager: BudgetManager | None, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        self._manager = manager
        self._released = manager is None or fields["outcome"] is GrantOutcome.DENIED

    @property
    def granted(self) -> bool:
        """True for FULL and PARTIAL grants."""
        return self.outcome is not GrantOutcome.DENIED

    def __repr__(self) -> str:
        return (
            f"Reservation({self.resource}, {self.outcome.value}, {self.granted_mb:.1f}/"
            f"{self.requested_mb:.1f} MB, {self.mode.name}, {self.priority.name}, "
            f"reason={self.reason.name if self.reason else None})"
        )


class BudgetManager:
    """VRAM and pinned-host reservations for the runtimes a Conductor arbitrates.

    Args:
        config: caps (``vram_soft_cap_mb``, ``vram_hard_cap_mb``, ``pinned_budget_mb``) and
            ``backward_pressure_threshold``.
        vram_usage_bytes: the VRAM figure, in bytes (``DeviceMemory.usage_bytes``); None
            counts only reservations.
        on_event: called with ``(event, fields)`` for the debug trace.
    """

    def __init__(
        self,
        config: ConductorConfig,
        vram_usage_bytes: Callable[[], int] | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = config
        self._usage = vram_usage_bytes
        self._on_event = on_event
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._held: dict[int, Reservation] = {}
        self._ceilings: dict[tuple[str, str], Reservation] = {}
        self.phase: Phase | None = None
        self.suppress_speculative = False
        self.counts = {"grant": 0, "partial": 0, "deny": 0}
        """Answers since the last ``reset_counts`` (FULL, PARTIAL, DENIED)."""

    # -- figures --------------------------------------------------------------------------------
    def vram_usage_mb(self) -> float:
        """Device usage in MB, without reservations."""
        return self._usage() / MB if self._usage is not None else 0.0

    def held_mb(self, resource: str, owner: str | None = None) -> float:
        """MB of ``resource`` held by reservations (of ``owner`` when given)."""
        return sum(
            r.granted_mb
            for r in self._held.values()
            if r.resource == resource and (owner is None or r.owner == owner)
        )

    def used_mb(self, resource: str) -> float:
        """What caps are compared against: usage plus held reservations (VRAM), or held (pinned)."""
        held = self.held_mb(resource)
        return self.vram_usage_mb() + held if resource == "vram" else held

    def vram_headroom_mb(self) -> float:
        """MB left under the soft cap (negative above it)."""
        return self.config.vram_soft_cap_mb - self.used_mb("vram")

    def limit_mb(self, resource: str, mode: BudgetMode, priority: Priority) -> float:
        """The cap a request of ``mode`` and ``priority`` is measured against (module table)."""
        if resource == "pinned":
            soft = hard = self.config.pinned_budget_mb
        else:
            soft, hard = self.config.vram_soft_cap_mb, self.config.vram_hard_cap_mb
        if priority is Priority.CRITICAL:
            return hard
        if priority is Priority.REQUIRED:
            return hard if mode in (BudgetMode.BURST, BudgetMode.FLOOR) else soft
        if priority is Priority.SPECULATIVE:
            return soft
        return self.config.backward_pressure_threshold * soft

    # -- requests -------------------------------------------------------------------------------
    def reserve(
        self,
        resource: str,
        mb: float,
        *,
        mode: BudgetMode | str = BudgetMode.SOFT,
        priority: Priority | str = Priority.REQUIRED,
        owner: str = "",
        phase_scoped: bool = False,
        min_mb: float = 0.0,
    ) -> Reservation:
        """Ask for ``mb`` MB of ``resource``; the answer follows the module's tables.

        ``phase_scoped`` releases the reservation when the current phase ends. ``min_mb`` is
        the smallest PARTIAL grant worth having (SOFT/BURST).

        Raises:
            ValueError: unknown ``resource``, ``mode`` or ``priority``; ``mb`` or ``min_mb``
                negative or not finite.
        """
        if resource not in RESOURCES:
            raise ValueError(f"resource must be one of {RESOURCES}, got {resource!r}")
        for name, value in (("mb", mb), ("min_mb", min_mb)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        mode, priority = BudgetMode.parse(mode), Priority.parse(priority)
        with self._lock:
            outcome, granted, reason = self._decide(
                resource, float(mb), mode, priority, owner, min_mb
            )
            res = Reservation(
                self,
                id=next(self._ids),
                resource=resource,
                owner=owner,
                mode=mode,
                priority=priority,
                requested_mb=float(mb),
                granted_mb=granted,
                outcome=outcome,
                reason=reason,
                scope=self.phase if phase_scoped else None,
            )
            key = {GrantOutcome.FULL: "grant", GrantOutcome.PARTIAL: "partial"}
            self.counts[key.get(outcome, "deny")] += 1
            if outcome is not GrantOutcome.DENIED:
                if mode is BudgetMode.CEILING:
                    self._ceilings[(owner, resource)] = res
                else:
                    self._held[res.id] = res
        self._event("reserve", res)
        return res

    def _decide(
        self,
        resource: str,
        mb: float,
        mode: BudgetMode,
        priority: Priority,
        owner: str,
        min_mb: float,
    ) -> tuple[GrantOutcome, float, DenialReason | None]:
        if self.suppress_speculative and priority <= Priority.SPECULATIVE:
            return GrantOutcome.DENIED, 0.0, DenialReason.PHASE_RULE_SUPPRESSED_SPECULATIVE
        if mode is BudgetMode.CEILING:
            return GrantOutcome.FULL, 0.0, None
        exhausted = (
            DenialReason.VRAM_BUDGET_EXHAUSTED
            if resource == "vram"
            else DenialReason.PINNED_BUDGET_EXHAUSTED
        )
        room, bound = self.limit_mb(resource, mode, priority) - self.used_mb(resource), exhausted
        ceiling = self._ceilings.get((owner, resource))
        if ceiling is not None:
            ceiling_room = ceiling.requested_mb - self.held_mb(resource, owner)
            if ceiling_room < room:
                room, bound = ceiling_room, DenialReason.CEILING_EXCEEDED
        if mb <= room:
            return GrantOutcome.FULL, mb, None
        if mode in (BudgetMode.SOFT, BudgetMode.BURST) and room > 0 and room >= min_mb:
            return GrantOutcome.PARTIAL, room, bound
        return GrantOutcome.DENIED, 0.0, bound

    def _release(self, res: Reservation) -> None:
        with self._lock:
            if res._released:
                return
            res._released = True
            self._held.pop(res.id, None)
            if self._ceilings.get((res.owner, res.resource)) is res:
                del self._ceilings[(res.owner, res.resource)]
        self._event("release", res)

    # -- phases ---------------------------------------------------------------------------------
    def begin_phase(self, phase: Phase) -> None:
        """Reservations made from now on with ``phase_scoped=True`` end with ``phase``."""
        self.phase = phase

    def end_phase(self, phase: Phase) -> int:
        """Release every reservation scoped to ``phase``; return how many were released."""
        with self._lock:
            scoped = [r for r in self._held.values() if r.scope is phase]
            scoped += [r for r in self._ceilings.values() if r.scope is phase]
        for res in scoped:
            res.release()
        return len(scoped)

    def reset_counts(self) -> None:
        self.counts = {"grant": 0, "partial": 0, "deny": 0}

    def release_all(self) -> None:
        with self._lock:
            every = list(self._held.values()) + list(self._ceilings.values())
        for res in every:
            res.release()

    def _event(self, event: str, res: Reservation) -> None:
        if self._on_event is not None:
            self._on_event(
                event,
                {
                    "reservation": res.id,
                    "resource": res.resource,
                    "owner": res.owner,
                    "mode": res.mode.value,
                    "priority": res.priority.name.lower(),
                    "requested_mb": res.requested_mb,
                    "granted_mb": res.granted_mb,
                    "outcome": res.outcome.value,
                    "reason": res.reason.value if res.reason else None,
                },
            )
