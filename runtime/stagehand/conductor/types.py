"""Priorities, budget modes and typed denial reasons shared by the Conductor's managers.

Source: "Conductor: Resource Arbitration Across Memory Runtimes" ("Budget Arbitration", "Transfer Slot Management").
A request the Conductor cannot serve always carries a ``DenialReason``, never a bare ``False``.
"""

from __future__ import annotations

import enum
from typing import Any, Self


class Priority(enum.IntEnum):
    """Who wins when resources are short: CRITICAL > REQUIRED > SPECULATIVE > BACKGROUND."""

    BACKGROUND = 0
    """Work that may be dropped at any time (pool growth, housekeeping)."""
    SPECULATIVE = 1
    """Work done ahead of need (weight prefetch); suppressed by policy Rules 1 and 2."""
    REQUIRED = 2
    """Work the step needs now or soon (activation spill/restore, a block about to run)."""
    CRITICAL = 3
    """Work without which the step cannot continue; never held to the policy's tighter caps."""

    @classmethod
    def parse(cls, value: Priority | str) -> Priority:
        """``Priority`` from an enum member or its name in any case (``"speculative"``).

        Raises:
            ValueError: ``value`` names no priority.
        """
        if isinstance(value, Priority):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"priority must be one of {names}, got {value!r}")


class BudgetMode(enum.Enum):
    """How a reservation may be granted; the rules are in ``runtime/stagehand/conductor/budget.py``."""

    HARD = "hard"
    SOFT = "soft"
    BURST = "burst"
    FLOOR = "floor"
    CEILING = "ceiling"

    @classmethod
    def parse(cls, value: BudgetMode | str) -> BudgetMode:
        """``BudgetMode`` from a member or its name in any case.

        Raises:
            ValueError: ``value`` names no mode.
        """
        if isinstance(value, BudgetMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"budget mode must be one of {names}, got {value!r}")


class GrantOutcome(enum.Enum):
    FULL = "full"
    PARTIAL = "partial"
    DENIED = "denied"


class DenialReason(enum.Enum):
    """Why a reservation or a transfer slot was not (fully) granted."""

    H2D_SLOTS_EXHAUSTED = "h2d_slots_exhausted"
    """Every H2D slot of the pool is held."""
    D2H_SLOTS_EXHAUSTED = "d2h_slots_exhausted"
    """Every D2H slot of the pool is held."""
    POLICY_H2D_LIMIT = "policy_h2d_limit"
    """Slots are free but the policy's ``max_inflight_h2d`` is reached (Rule 2: 1 in OPTIMIZER)."""
    POLICY_D2H_LIMIT = "policy_d2h_limit"
    """Slots are free but the policy's ``max_inflight_d2h`` is reached (Rule 2: 0 in OPTIMIZER)."""
    PHASE_RULE_SUPPRESSED_SPECULATIVE = "phase_rule_suppressed_speculative"
    """Speculative or background work while the policy suppresses speculation (Rules 1, 2)."""
    VRAM_BUDGET_EXHAUSTED = "vram_budget_exhausted"
    """The VRAM cap that applies to this mode and priority has too little headroom left."""
    PINNED_BUDGET_EXHAUSTED = "pinned_budget_exhausted"
    """``pinned_budget_mb`` has too little left."""
    CEILING_EXCEEDED = "ceiling_exceeded"
    """The owner declared a CEILING below what it now asks for (HARD/FLOOR requests)."""
    PARTIAL_GRANT = "partial_grant"
    """Granted, but less than requested (SOFT/BURST)."""
    CONDUCTOR_SHUT_DOWN = "conductor_shut_down"
    """The Conductor was shut down; nothing is granted any more."""


class Releasable:
    """A budget reservation or a transfer slot: ``release()`` hands it back to its manager
    (``manager._release(self)``, which sets ``_released``) once; further calls do nothing. As a
    context manager it is released on every exit path, errors included."""

    __slots__ = ("_manager", "_released")
    _manager: Any
    _released: bool

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released and self._manager is not None:
            self._manager._release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
