"""One child process per benchmark job, forked from a server that already imported torch.

Each row runs in its own process so its RSS peak is its own (``ru_maxrss`` of that child), and
all rows come from one parent, one after another, so their ratios hold on a noisy machine.
A ``forkserver`` (not ``fork``) keeps the parent free of CUDA and OpenMP state; the server
imports ``workbench.bench.child`` once, so a child starts in ~0.1 s instead of ~6 s.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
from typing import Any

PRELOAD = ["workbench.bench.child"]


def _child(conn: multiprocessing.connection.Connection, kind: str, job: dict[str, Any]) -> None:
    from workbench.bench.child import (  # lazy: the parent stays torch-free (its forkserver preloads it)
        run_job,
    )

    try:
        conn.send(run_job(kind, job))
    except BaseException as exc:  # report, then exit non-zero
        conn.send({"status": "error", "reason": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        conn.close()


class Runner:
    """Runs jobs (``prepare`` / ``hardware`` / ``row``) each in a fresh forked child."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        # ``torch.cuda.is_available()`` initialises the CUDA driver (and poisons fork) unless it
        # asks NVML: the server and every child it forks inherit this, so a check in the server
        # (at import, say) leaves its children free to use CUDA (PyTorch's is_available docs).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def run(self, kind: str, job: dict[str, Any], timeout_s: float | None = None) -> dict:
        """The child's result dict; a crash or timeout becomes ``{"status": "error", ...}``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child, args=(child, kind, job), daemon=True)
        proc.start()
        child.close()
        try:
            if parent.poll(timeout):
                try:
                    result = parent.recv()
                except EOFError:
                    result = None
            else:
                proc.kill()
                result = {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
        finally:
            proc.join(10)
            parent.close()
        if result is None:
            result = {"status": "error", "reason": f"child exited with code {proc.exitcode}"}
        return result
