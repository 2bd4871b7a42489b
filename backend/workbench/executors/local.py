"""The local executor: one worker subprocess per run on this machine (the default).

``python -m workbench.cli train DIR/config.json --run-dir DIR``, in its own session (process
group) so a signal to the group reaches its children and a Ctrl-C of the server does not kill
training. Forked from a fork server that already imported the worker's modules once one is
ready (``workbench.executors.forkserver``: a run starts ~5-7 s sooner), else started cold. After a restart a run is adopted when its pid is alive *and* has the recorded start
time (psutil ``create_time``: a reused pid has another). Telemetry is tailed from
``DIR/telemetry.jsonl``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from stagehand.config.wire import TELEMETRY_FILE
from workbench.executors import (
    Executor,
    Exit,
    Job,
    LaunchError,
    TelemetrySource,
    forkserver,
    worker_command,
)
from workbench.executors.forkserver import Forked
from workbench.services.outcome import log_tail
from workbench.services.settings import Settings
from workbench.services.tailer import JsonlTail


class LocalExecutor(Executor):
    """Workers as children of the server (or adopted orphans of a previous server)."""

    name = "local"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.host = socket.gethostname()
        if settings.fork_server and settings.fork_server_early:
            forkserver.prestart(self._env(), Path.cwd())

    @staticmethod
    def _env() -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def submit(self, run: dict[str, Any], run_dir: Path) -> Job:
        cmd = worker_command(sys.executable, self.settings.worker_module, run, run_dir)
        env = self._env()
        try:
            with open(run_dir / "worker.log", "ab") as out:
                child = forkserver.launch(
                    cmd, env=env, cwd=Path.cwd(), stdout=out, fork=self.settings.fork_server
                )
        except OSError as exc:
            raise LaunchError(f"could not start the worker: {exc}") from exc
        try:
            create_time = psutil.Process(child.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = None
        return Job(
            run["id"],
            str(child.pid),
            run["device"] or "default",
            run_dir,
            node=self.host,
            state={"child": child, "create_time": create_time},
        )

    def store_fields(self, job: Job) -> dict[str, Any]:
        return {
            **super().store_fields(job),
            "pid": job.pid,
            "pid_create_time": job.state.get("create_time"),
        }

    def poll(self, job: Job) -> Exit | None:
        child: Forked | subprocess.Popen | None = job.state.get("child")
        if isinstance(child, Forked):
            ended, rc = child.exit()
            return Exit(rc) if ended else None
        if child is not None:
            rc = child.poll()
            return None if rc is None else Exit(rc)
        proc: psutil.Process = job.state["proc"]
        try:
            gone = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        return Exit(None) if gone else None  # not our child: its exit code is unknown

    def signal(self, job: Job, sig: signal.Signals) -> None:
        pid = job.pid
        if pid is None:
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def adopt(self, run: dict[str, Any], run_dir: Path) -> Job | None:
        proc = _same_process(run["pid"], run["pid_create_time"])
        if proc is None:
            return None
        return Job(
            run["id"],
            str(run["pid"]),
            run["device"] or "default",
            run_dir,
            node=run.get("node") or self.host,
            state={"proc": proc, "create_time": run["pid_create_time"]},
        )

    def telemetry(self, run: dict[str, Any], run_dir: Path) -> TelemetrySource:
        return JsonlTail(run_dir / TELEMETRY_FILE, run["tail_offset"] or 0)

    def log_tail(self, job: Job) -> str | None:
        return log_tail(job.run_dir / "worker.log")

    def withdraw(self, job: Job) -> None:
        child: Forked | subprocess.Popen | None = job.state.get("child")
        if child is not None:
            child.kill()
            child.wait()


def _same_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.05:
            return None  # the pid was reused by another process
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None
