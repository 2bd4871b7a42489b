"""How a run ended, from its worker's exit and its last telemetry (docs/contracts.md, "Worker").

- killed by a signal: ``killed`` with the signal named (``cancelled`` if we asked it to stop);
- exit 0 (or unknown, for a worker adopted after a restart) with a ``run_finished`` record: that
  record's status (``succeeded`` | ``cancelled``);
- a last ``trainer/error`` record: ``failed`` with its type, message, traceback and ``oom``;
- gone with an unknown exit and no final record: ``crashed``, saying what telemetry last said;
- any other non-zero exit: ``failed``, with the tail of ``worker.log`` (a launch that died
  before writing telemetry still shows why).

A run folder that was removed while its worker ran takes the worker's last records and its log
with it: the error then starts by saying so, naming the folder.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from workbench.contract.status import RunStatus
from workbench.services.run_files import servable

LOG_TAIL_BYTES = 4000


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str | None:
    """The last ``limit`` bytes of the run folder's file ``path`` (``runs/<id>/worker.log``) as
    text, or None when it cannot be read or is not the run's own: the artifact routes' rule
    (``workbench.services.run_files.servable``), a regular file of one name whose real path lies in the
    run folder, the run folder taken where it is named, not where a symlink points. A
    ``worker.log`` that is a symlink to ``/etc/shadow``, or a run folder that is a symlink, is
    never read (it would be served by ``GET /api/runs/{id}/log`` and kept in a failed run's
    error)."""
    run_dir = path.parent.parent.resolve() / path.parent.name
    if not servable(path, run_dir):
        return None
    try:
        # O_NOFOLLOW: a symlink put in its place since the check is refused, not followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def describe(record: dict[str, Any] | None) -> str:
    """``trainer/step at step 12 (seq 340)``: a record in words, for error messages."""
    if not record:
        return "no telemetry at all"
    step = record.get("step")
    where = f" at step {step}" if step is not None else ""
    return f"{record.get('source')}/{record.get('kind')}{where} (seq {record.get('seq')})"


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def classify(
    rc: int | None,
    *,
    cancel_requested: bool,
    finished: dict[str, Any] | None,
    last: dict[str, Any] | None,
    tail: str | None,
    pid: int | None,
    gone_at_start: bool = False,
    missing_dir: Path | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """The run's ``status, exit_code, signal, error`` fields.

    ``rc`` is the exit code (negative: killed by that signal; None: unknown, the worker was not
    our child); ``finished`` the last ``trainer/run_finished`` record; ``last`` the last record;
    ``missing_dir`` the run folder when it no longer exists; ``reason`` the executor's own
    words on how the worker ended (a Ray job's message), added to the error.
    """
    out: dict[str, Any] = {"exit_code": rc, "signal": None, "error": None}
    if rc is not None and rc < 0:
        name = signal_name(-rc)
        out["signal"] = name
        out["status"] = RunStatus.CANCELLED if cancel_requested else RunStatus.KILLED
        if not cancel_requested:
            oom = " (the kernel's OOM killer sends SIGKILL when host RAM runs out)"
            out["error"] = {
                "message": f"worker killed by {name}" + (oom if name == "SIGKILL" else ""),
                "log_tail": tail,
                "last_record": last,
            }
    elif finished is not None and rc in (0, None):
        status = finished.get("status")
        out["status"] = (
            RunStatus(status)
            if status in (RunStatus.SUCCEEDED, RunStatus.CANCELLED)
            else RunStatus.SUCCEEDED
        )
    elif last is not None and last.get("kind") == "error":
        out["status"] = RunStatus.FAILED
        out["error"] = {
            "message": str(last.get("message", "")),
            "error_type": last.get("error_type"),
            "traceback": last.get("traceback"),
            "oom": last.get("oom"),
            "log_tail": tail,
        }
    elif rc is None:
        when = "was gone when the server started" if gone_at_start else "disappeared"
        who = f"worker process (pid {pid})" if pid else "worker"
        out["status"] = RunStatus.CRASHED
        out["error"] = {
            "message": f"{who} {when}; its telemetry last said {describe(last)}",
            "last_record": last,
            "log_tail": tail,
        }
    else:
        missing = "" if rc else " without a run_finished record"
        out["status"] = RunStatus.FAILED
        out["error"] = {
            "message": f"worker exited with code {rc} after {describe(last)}{missing}",
            "log_tail": tail,
            "last_record": last,
        }
    if reason and out["error"] is not None:
        out["error"]["message"] = f"{out['error']['message']} ({reason})"
    if missing_dir is not None and out["error"] is not None:
        gone = f"the run folder {missing_dir} no longer exists (removed while the run was going?)"
        out["error"]["message"] = f"{gone}; {out['error']['message']}"
    return out
