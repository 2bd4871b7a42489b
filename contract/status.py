"""Run status: the names the store, the supervisor, the API, the worker and the dashboard share,
and the transitions a run may make. Torch-free (the backend imports it).

A run moves on as follows (one comment per member says what moves it)::

    queued  -> running -> succeeded | failed | cancelled | killed | crashed
               running <-> stalled (no telemetry for too long, then records again)
    queued  -> any ending                  (cancelled before a worker; the launch failed; a
                                            worker that ended before it was seen running)
    failed | cancelled | killed | crashed -> queued   (resume from a checkpoint)

An illegal transition raises ``RunStatusError`` naming the statuses expected and found.
"""

from __future__ import annotations

import enum


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    """Created (or resumed); waits for a worker slot of its device."""
    RUNNING = "running"
    """A worker was launched for it (or adopted after a server restart)."""
    STALLED = "stalled"
    """Running, but no telemetry for longer than the stall limit; records move it back."""
    SUCCEEDED = "succeeded"
    """The worker finished every step (or stopped early on request with its LoRA saved)."""
    FAILED = "failed"
    """The worker exited with an error (or could not be launched)."""
    CANCELLED = "cancelled"
    """Cancelled by the user: before a worker started, or the worker stopped on request."""
    KILLED = "killed"
    """The worker died from a signal nobody asked for (OOM killer, SIGKILL)."""
    CRASHED = "crashed"
    """The worker vanished without an exit status the server saw (server restart, lost node)."""


ACTIVE = frozenset({RunStatus.RUNNING, RunStatus.STALLED})
"""A worker is (believed to be) alive."""
RESUMABLE = frozenset({RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.KILLED, RunStatus.CRASHED})
"""Ended without finishing: ``POST /api/runs/{id}/resume`` re-queues it from a checkpoint."""
TERMINAL = frozenset({RunStatus.SUCCEEDED, *RESUMABLE})
"""Ended."""

_ENDINGS = frozenset(TERMINAL)
LEGAL_NEXT: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, *_ENDINGS}),
    RunStatus.RUNNING: frozenset({RunStatus.STALLED, *_ENDINGS}),
    RunStatus.STALLED: frozenset({RunStatus.RUNNING, *_ENDINGS}),
    RunStatus.SUCCEEDED: frozenset(),
    **{status: frozenset({RunStatus.QUEUED}) for status in RESUMABLE},
}


class RunStatusError(ValueError):
    """A run was moved to a status its current status does not allow."""


def check_status_transition(old: str, new: str) -> None:
    """Raise ``RunStatusError`` unless ``old -> new`` is a legal move (``LEGAL_NEXT``); also
    for a name that is no ``RunStatus``."""
    try:
        old_s, new_s = RunStatus(old), RunStatus(new)
    except ValueError:
        names = ", ".join(s.value for s in RunStatus)
        raise RunStatusError(f"run status must be one of {names}, got {old!r} -> {new!r}") from None
    if new_s not in LEGAL_NEXT[old_s]:
        allowed = ", ".join(sorted(s.value for s in LEGAL_NEXT[old_s])) or "nothing"
        raise RunStatusError(f"a {old_s.value} run may become {allowed}, not {new_s.value}")
