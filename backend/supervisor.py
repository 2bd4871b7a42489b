"""Launch, queue, watch, cancel and reconcile the worker processes of runs.

One worker subprocess per run (``python -m backend.cli train DIR/config.json --run-dir DIR``),
in its own session (process group) so a signal to the group reaches its children and a
Ctrl-C of the server does not kill training. Workers survive a server restart: on start-up
``reconcile`` adopts a run whose pid is alive *and* has the recorded start time (psutil
``create_time``: a reused pid has another), and marks every other "running" run from its
telemetry (finished -> its status, error record -> failed, otherwise crashed). Nothing stays
"running" forever.

Exit -> status (docs/contracts.md): 0 -> the last ``run_finished`` record's status; a signal ->
killed (signal named: SIGKILL from the OOM killer); non-zero -> failed with the worker's
``trainer/error`` record (or the tail of ``worker.log`` when it died before writing one).
Cancel: a ``stop`` control file, SIGTERM to the group after ``stop_grace_s``, SIGKILL after
``term_grace_s`` more. A run without telemetry for ``stall_factor`` x its median step time
(at least ``stall_min_s``) is "stalled" until records flow again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from backend.errors import Conflict
from backend.outcome import classify, log_tail
from backend.settings import REPO_ROOT, Settings
from backend.store import ACTIVE, Store
from backend.tailer import Tailer

log = logging.getLogger("backend.supervisor")

TELEMETRY = "telemetry.jsonl"


@dataclass
class Worker:
    """A live worker: our child (``popen``) or one adopted after a restart (``proc`` only)."""

    run_id: int
    pid: int
    device: str
    run_dir: Path
    popen: subprocess.Popen | None
    proc: psutil.Process | None
    cancel_at: float | None = None
    sent_term: bool = False
    sent_kill: bool = False

    def exit_status(self) -> tuple[bool, int | None]:
        """``(exited, returncode)``; the return code is unknown (None) for adopted workers."""
        if self.popen is not None:
            rc = self.popen.poll()
            return rc is not None, rc
        assert self.proc is not None
        try:
            gone = not self.proc.is_running() or self.proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        return gone, None

    def signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def device_of(config: dict[str, Any]) -> str:
    """The device a run's config asks for (``device`` at the top or under ``train``)."""
    for section in (config, config.get("train") if isinstance(config.get("train"), dict) else {}):
        value = section.get("device") if isinstance(section, dict) else None
        if isinstance(value, str) and value:
            return "cuda:0" if value == "cuda" else value
    return "default"


class Supervisor:
    """Owns the worker processes. Thread-safe; ``tick`` runs on its own thread every 0.1 s."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        tailer: Tailer,
        on_change: Callable[[int], None],
        tick_s: float = 0.1,
    ) -> None:
        self.settings = settings
        self.store = store
        self.tailer = tailer
        self.on_change = on_change
        self.tick_s = tick_s
        self._workers: dict[int, Worker] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_dir(self, run_id: int) -> Path:
        return self.settings.runs_dir / str(run_id)

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        self.reconcile()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching. Workers keep running; the next start adopts them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:
                log.exception("supervisor tick failed")

    def reconcile(self) -> None:
        """Adopt live workers of "running" runs; settle the runs whose worker is gone."""
        with self._lock:
            for run in self.store.runs_with_status(*ACTIVE):
                run_id, pid = run["id"], run["pid"]
                run_dir = self.run_dir(run_id)
                self.tailer.watch(run_id, run_dir / TELEMETRY, run["tail_offset"] or 0)
                proc = _same_process(pid, run["pid_create_time"])
                if proc is not None:
                    log.info("run %d: adopting worker pid %d", run_id, pid)
                    self._workers[run_id] = Worker(
                        run_id,
                        pid,
                        run["device"] or "default",
                        run_dir,
                        None,
                        proc,
                        cancel_at=run["cancel_requested_at"],
                    )
                    continue
                self._settle(
                    run_id,
                    run_dir,
                    None,
                    cancel_requested=bool(run["cancel_requested_at"]),
                    gone_at_start=True,
                    pid=pid,
                )

    # -- the loop ------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            now = time.time()
            for run_id, w in list(self._workers.items()):
                exited, rc = w.exit_status()
                if exited:
                    del self._workers[run_id]
                    self._settle(
                        run_id, w.run_dir, rc, cancel_requested=w.cancel_at is not None, pid=w.pid
                    )
                    continue
                self._escalate(w, now)
                self._check_stall(run_id, now)
            self._launch_queued()

    def _escalate(self, w: Worker, now: float) -> None:
        if w.cancel_at is None:
            return
        waited = now - w.cancel_at
        if not w.sent_term and waited > self.settings.stop_grace_s:
            log.info("run %d: no exit %.0f s after stop; SIGTERM", w.run_id, waited)
            w.signal_group(signal.SIGTERM)
            w.sent_term = True
        elif not w.sent_kill and waited > self.settings.stop_grace_s + self.settings.term_grace_s:
            log.warning("run %d: no exit after SIGTERM; SIGKILL", w.run_id)
            w.signal_group(signal.SIGKILL)
            w.sent_kill = True

    def _check_stall(self, run_id: int, now: float) -> None:
        run = self.store.get_run(run_id)
        if run is None:
            return
        quiet_s = now - max(run["last_record_at"] or 0, run["started_at"] or 0)
        times = self.store.step_times_ms(run_id)
        if times:
            limit = max(
                self.settings.stall_min_s,
                self.settings.stall_factor * statistics.median(times) / 1e3,
            )
        else:
            limit = self.settings.startup_stall_s
        if run["status"] == "running" and quiet_s > limit:
            if self.store.set_status_if(run_id, ["running"], status="stalled"):
                log.warning(
                    "run %d: no telemetry for %.1f s (limit %.1f s): stalled",
                    run_id,
                    quiet_s,
                    limit,
                )
                self.on_change(run_id)
        elif run["status"] == "stalled" and quiet_s <= limit:
            if self.store.set_status_if(run_id, ["stalled"], status="running"):
                self.on_change(run_id)

    def _launch_queued(self) -> None:
        busy: dict[str, int] = {}
        for w in self._workers.values():
            busy[w.device] = busy.get(w.device, 0) + 1
        for run in self.store.runs_with_status("queued"):
            device = run["device"] or "default"
            if busy.get(device, 0) >= self.settings.max_parallel:
                continue
            if self._launch(run):
                busy[device] = busy.get(device, 0) + 1

    def _launch(self, run: dict[str, Any]) -> bool:
        run_id = run["id"]
        run_dir = self.run_dir(run_id)
        cmd = [
            sys.executable,
            "-m",
            self.settings.worker_module,
            "train",
            str(run_dir / "config.json"),
            "--run-dir",
            str(run_dir),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            with open(run_dir / "worker.log", "ab") as out:
                popen = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=REPO_ROOT,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            self.store.set_status_if(
                run_id,
                ["queued"],
                status="failed",
                finished_at=time.time(),
                error={
                    "message": f"could not start the worker: {exc}",
                    "error_type": type(exc).__name__,
                },
            )
            self.on_change(run_id)
            return False
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = None
        started = self.store.set_status_if(
            run_id,
            ["queued"],
            status="running",
            started_at=time.time(),
            pid=popen.pid,
            pid_create_time=create_time,
        )
        if not started:  # cancelled between the query and the launch
            popen.kill()
            popen.wait()
            return False
        self._workers[run_id] = Worker(
            run_id, popen.pid, run["device"] or "default", run_dir, popen, None
        )
        self.tailer.watch(run_id, run_dir / TELEMETRY, run["tail_offset"] or 0)
        log.info("run %d: worker pid %d started", run_id, popen.pid)
        self.on_change(run_id)
        return True

    def _settle(
        self,
        run_id: int,
        run_dir: Path,
        rc: int | None,
        *,
        cancel_requested: bool,
        pid: int | None,
        gone_at_start: bool = False,
    ) -> None:
        """Final status of a run whose worker is gone, after its last records are ingested."""
        self.tailer.drain(run_id)
        fields = classify(
            rc,
            cancel_requested=cancel_requested,
            finished=self.store.last_record(run_id, "trainer", "run_finished"),
            last=self.store.last_record(run_id),
            tail=log_tail(run_dir / "worker.log"),
            pid=pid,
            gone_at_start=gone_at_start,
            missing_dir=None if run_dir.is_dir() else run_dir,
        )
        fields["finished_at"] = time.time()
        fields["summary"] = self.store.summary(run_id)
        if self.store.set_status_if(run_id, [*ACTIVE, "queued"], **fields):
            log.info(
                "run %d: %s (exit %s, signal %s)", run_id, fields["status"], rc, fields["signal"]
            )
            self.on_change(run_id)

    # -- API operations ------------------------------------------------------------------
    def wake(self) -> None:
        """Launch queued runs now rather than at the next tick."""
        with self._lock:
            self._launch_queued()

    def cancel(self, run_id: int) -> None:
        """Cancel a queued run at once, or ask a running one to stop (then escalate).

        Raises ``Conflict`` when the run already ended.
        """
        with self._lock:
            if self.store.set_status_if(
                run_id, ["queued"], status="cancelled", finished_at=time.time()
            ):
                self.on_change(run_id)
                return
            w = self._workers.get(run_id)
            if w is None:
                run = self.store.get_run(run_id)
                raise Conflict(
                    f"run {run_id} is {run['status'] if run else 'gone'}; only queued or running runs can be cancelled"
                )
            if w.cancel_at is None:
                w.cancel_at = time.time()
                self.store.update_run(run_id, cancel_requested_at=w.cancel_at)
                self.send_control(run_id, {"command": "stop"})

    def send_control(self, run_id: int, payload: dict[str, Any]) -> str:
        """Drop a control request into ``DIR/control/`` (temp name, then rename); its id."""
        request_id = payload.get("request_id") or uuid.uuid4().hex[:12]
        body = {**payload, "request_id": request_id}
        n = self.store.next_control_seq(run_id)
        control = self.run_dir(run_id) / "control"
        control.mkdir(parents=True, exist_ok=True)
        final = control / f"{n:06d}-{request_id}.json"
        tmp = control / f".{final.name}.tmp"
        tmp.write_text(json.dumps(body))
        os.replace(tmp, final)
        return request_id

    def is_live(self, run_id: int) -> bool:
        with self._lock:
            return run_id in self._workers


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
