"""Queue, launch, watch, cancel and reconcile the workers of runs, over one ``Executor``.

Where a worker runs is the executor's business (``workbench.executors``: a local subprocess, or
a Ray job); the queue, the cancel escalation, stall detection and the exit classification are
the same over both. Workers survive a server restart: on start-up ``reconcile`` asks the
executor to find each "running" run's worker again (``adopt``: a live pid with its recorded
start time, or a Ray job by its submission id), and settles every other one from its
telemetry (finished -> its status, error record -> failed, otherwise crashed). Nothing stays
"running" forever; a run started by another executor than the one serving now is settled as
crashed, saying which executor to serve with.

Exit -> status (docs/contracts.md): 0 -> the last ``run_finished`` record's status; a signal ->
killed (signal named: SIGKILL from the OOM killer); non-zero -> failed with the worker's
``trainer/error`` record (or the tail of ``worker.log`` when it died before writing one).
Cancel: a ``stop`` control file, the executor's SIGTERM after ``stop_grace_s`` (a Ray job:
``stop_job``), its SIGKILL after ``term_grace_s`` more. A run without telemetry for
``stall_factor`` x its median step time (at least ``stall_min_s``) is "stalled" until records
flow again.

A run whose worker ended is an ``Ending`` until its final status is stored
(``workbench.services.endings``): a store that cannot be written (a full disk) leaves it pending
and each tick retries it. While the data dir's disk is full no queued run is launched.
"""

from __future__ import annotations

import logging
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagehand.config.memory import AUTO_DEVICE
from workbench.api.errors import Conflict
from workbench.contract.control import STOP, write_request
from workbench.contract.records import RUN_FINISHED
from workbench.contract.status import ACTIVE, RESUMABLE, RunStatus
from workbench.executors import Executor, Exit, Job, LaunchError
from workbench.services.diskfull import condition, is_disk_full
from workbench.services.endings import Ending, Endings
from workbench.services.outcome import classify
from workbench.services.outcome import log_tail as outcome_log_tail
from workbench.services.run_files import checkpoints, has_config
from workbench.services.settings import Settings
from workbench.services.tailer import Tailer
from workbench.store import Store

log = logging.getLogger("workbench.services.supervisor")


def slot_device(device: str | None, default_device: str | None) -> str:
    """The device whose ``--max-parallel`` slots a run with ``device`` (its ``POST /api/runs``
    field; ``"default"`` in rows written before it existed) takes. ``"auto"`` is the machine's
    default device (``default_device``, from the system probe: ``"cuda:0"`` or ``"cpu"``), so an
    auto run and a ``cuda:0`` run share one GPU's slots. While the probe has not answered
    (``default_device`` None) every run counts against one shared pool: fewer runs at once for
    those seconds, never more."""
    if default_device is None:
        return "default"
    return default_device if device in (None, "", "default", AUTO_DEVICE) else device


class Supervisor:
    """Owns the runs' workers through ``executor``. Thread-safe; ``tick`` runs on its own
    thread every 0.1 s."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        tailer: Tailer,
        on_change: Callable[[int], None],
        executor: Executor,
        tick_s: float = 0.1,
        on_finished: Callable[[int], None] | None = None,
        default_device: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.tailer = tailer
        self.on_change = on_change
        self.executor = executor
        self.tick_s = tick_s
        self.on_finished = on_finished
        """Called with a run's id once its final status is stored (the calibrator's submit)."""
        self.default_device = default_device
        self._workers: dict[int, Job] = {}
        self.disk = condition(settings.data_dir)
        self._endings = Endings(self._store_end, self.disk)
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
                run_id = run["id"]
                run_dir = self.run_dir(run_id)
                gone = Job(run_id, run["job_id"] or str(run["pid"] or ""), "default", run_dir)
                started_by = run["executor"] or "local"
                if started_by != self.executor.name:
                    reason = (
                        f"the run was started by the {started_by} executor and the server now "
                        f"serves with --executor {self.executor.name}; serve with --executor "
                        f"{started_by} to follow it"
                    )
                    self._endings.add(
                        Ending(
                            gone,
                            Exit(None, reason),
                            bool(run["cancel_requested_at"]),
                            run["pid"],
                            gone_at_start=True,
                        )
                    )
                    continue
                self.tailer.watch(run_id, self.executor.telemetry(run, run_dir))
                job = self.executor.adopt(run, run_dir)
                if job is not None:
                    log.info("run %d: adopting %s job %s", run_id, self.executor.name, job.key)
                    job.cancel_at = run["cancel_requested_at"]
                    self._workers[run_id] = job
                    continue
                self._endings.add(
                    Ending(
                        gone,
                        Exit(None),
                        bool(run["cancel_requested_at"]),
                        run["pid"],
                        gone_at_start=True,
                    )
                )

    # -- the loop ------------------------------------------------------------------------
    def tick(self) -> None:
        """Store the ends still pending, watch each live worker, launch queued runs. A write
        that fails for a full disk is counted on the disk condition (logged once) and the tick
        goes on with the next run; the launches wait for the disk."""
        with self._lock:
            now = time.time()
            self._endings.retry_due(now)
            for run_id, job in list(self._workers.items()):
                try:
                    self._watch(run_id, job, now)
                except Exception as exc:
                    if not is_disk_full(exc):
                        raise
                    self.disk.failed(exc, f"watching run {run_id}")
            self.disk.refresh()
            if not self.disk.full:
                self._launch_queued()

    def _watch(self, run_id: int, job: Job, now: float) -> None:
        node = job.node
        ended = self.executor.poll(job)
        if job.node != node:
            self.store.update_run(run_id, node=job.node)
            self.on_change(run_id)
        if ended is not None:
            del self._workers[run_id]
            self._endings.add(Ending(job, ended, job.cancel_at is not None, job.pid))
            return
        self._escalate(job, now)
        self._check_stall(run_id, now)

    def _escalate(self, job: Job, now: float) -> None:
        if job.cancel_at is None:
            return
        waited = now - job.cancel_at
        if not job.sent_term and waited > self.settings.stop_grace_s:
            log.info("run %d: no exit %.0f s after stop; SIGTERM", job.run_id, waited)
            self.executor.signal(job, signal.SIGTERM)
            job.sent_term = True
        elif not job.sent_kill and waited > self.settings.stop_grace_s + self.settings.term_grace_s:
            log.warning("run %d: no exit after SIGTERM; SIGKILL", job.run_id)
            self.executor.signal(job, signal.SIGKILL)
            job.sent_kill = True

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
        if run["status"] == RunStatus.RUNNING and quiet_s > limit:
            if self.store.set_status_if(run_id, [RunStatus.RUNNING], status=RunStatus.STALLED):
                log.warning(
                    "run %d: no telemetry for %.1f s (limit %.1f s): stalled",
                    run_id,
                    quiet_s,
                    limit,
                )
                self.on_change(run_id)
        elif run["status"] == RunStatus.STALLED and quiet_s <= limit:
            if self.store.set_status_if(run_id, [RunStatus.STALLED], status=RunStatus.RUNNING):
                self.on_change(run_id)

    def _launch_queued(self) -> None:
        """Launch queued runs, oldest first, while their device has a free slot and no other
        trial of their tune is live: trials of one tune run one after another on every
        executor (Ray's default has no slots of ours), or the step times they compare measure
        each other's load."""
        queued = self.store.runs_with_status(RunStatus.QUEUED)
        if not queued:
            return
        default = self.default_device()
        busy: dict[str, int] = {}
        for w in self._workers.values():
            device = slot_device(w.device, default)
            busy[device] = busy.get(device, 0) + 1
        live = (self.store.get_run(run_id) for run_id in list(self._workers))
        groups = {run["group_id"] for run in live if run is not None} - {None}
        for run in queued:
            if not has_config(self.run_dir(run["id"])):
                continue  # its folder is still being written (write_run_config)
            device = slot_device(run["device"], default)
            if busy.get(device, 0) >= self.executor.slots(self.settings.max_parallel):
                continue
            if run["group_id"] is not None and run["group_id"] in groups:
                continue
            if self._launch(run):
                busy[device] = busy.get(device, 0) + 1
                groups.add(run["group_id"])

    def _launch(self, run: dict[str, Any]) -> bool:
        run_id = run["id"]
        run_dir = self.run_dir(run_id)
        try:
            job = self.executor.submit(run, run_dir)
        except LaunchError as exc:
            self.store.set_status_if(
                run_id,
                [RunStatus.QUEUED],
                status=RunStatus.FAILED,
                finished_at=time.time(),
                error={"message": str(exc), "error_type": type(exc.__cause__ or exc).__name__},
            )
            self.on_change(run_id)
            return False
        try:
            started = self.store.set_status_if(
                run_id,
                [RunStatus.QUEUED],
                status=RunStatus.RUNNING,
                started_at=time.time(),
                **self.executor.store_fields(job),
            )
        except Exception:  # a worker the store does not know of would run twice
            self.executor.withdraw(job)
            raise
        if not started:  # cancelled between the query and the launch
            self.executor.withdraw(job)
            return False
        self._workers[run_id] = job
        self.tailer.watch(run_id, self.executor.telemetry(self.store.get_run(run_id), run_dir))
        log.info("run %d: %s job %s started", run_id, self.executor.name, job.key)
        self.on_change(run_id)
        return True

    def _store_end(self, e: Ending, ended: Exit) -> None:
        self._settle(
            e.job.run_id,
            e.job.run_dir,
            ended,
            e.job,
            cancel_requested=e.cancel_requested,
            pid=e.pid,
            gone_at_start=e.gone_at_start,
        )

    def _settle(
        self,
        run_id: int,
        run_dir: Path,
        ended: Exit,
        job: Job,
        *,
        cancel_requested: bool,
        pid: int | None,
        gone_at_start: bool = False,
    ) -> None:
        """Final status of a run whose worker is gone, after its last records are ingested."""
        self.tailer.drain(run_id)
        tail = self.executor.log_tail(job)
        fields = classify(
            ended.rc,
            cancel_requested=cancel_requested,
            finished=self.store.last_record(run_id, *RUN_FINISHED),
            last=self.store.last_record(run_id),
            tail=tail,
            pid=pid,
            gone_at_start=gone_at_start,
            missing_dir=None if run_dir.is_dir() else run_dir,
            reason=ended.reason,
        )
        fields["finished_at"] = time.time()
        fields["summary"] = self.store.summary(run_id)
        if self.store.set_status_if(run_id, [*ACTIVE, RunStatus.QUEUED], **fields):
            log.info(
                "run %d: %s (exit %s, signal %s)",
                run_id,
                fields["status"],
                ended.rc,
                fields["signal"],
            )
            self.on_change(run_id)
            if self.on_finished is not None:
                self.on_finished(run_id)

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
                run_id, [RunStatus.QUEUED], status=RunStatus.CANCELLED, finished_at=time.time()
            ):
                self.on_change(run_id)
                return
            job = self._workers.get(run_id)
            if job is None:
                self._settle_dead(run_id)
                return
            if job.cancel_at is None:
                job.cancel_at = time.time()
                try:
                    self.store.update_run(run_id, cancel_requested_at=job.cancel_at)
                    self.send_control(run_id, {"command": STOP})
                except Exception as exc:
                    if not is_disk_full(exc):
                        raise
                    # No stop request reached the worker: it is told by SIGTERM now instead.
                    self.disk.failed(exc, f"asking run {run_id} to stop")
                    self.executor.signal(job, signal.SIGTERM)
                    job.sent_term = True

    def _settle_dead(self, run_id: int) -> None:
        """Cancel of a run with no live worker: a pending end (or a run left running without a
        worker) is stored now. Raises the store's error when it still cannot be written (a full
        disk: the API's 507), ``Conflict`` when the run already ended."""
        run = self.store.get_run(run_id)
        status = run["status"] if run else "gone"
        if run_id not in self._endings and status in ACTIVE:
            gone = Job(
                run_id, run["job_id"] or str(run["pid"] or ""), "default", self.run_dir(run_id)
            )
            error = self._endings.add(Ending(gone, Exit(None), True, run["pid"]))
        elif run_id in self._endings:
            error = self._endings.store(run_id)
        else:
            raise Conflict(
                f"run {run_id} is {status}; only queued or running runs can be cancelled"
            )
        if error is not None:
            raise error

    def log_tail(self, run_id: int) -> str | None:
        """The end of the run's worker output (progress lines, warnings): from its executor
        while it runs, from ``DIR/worker.log`` after (None when there is none)."""
        job = self._workers.get(run_id)
        if job is not None:
            return self.executor.log_tail(job)
        return outcome_log_tail(self.run_dir(run_id) / "worker.log")

    def resume(self, run_id: int) -> None:
        """Queue a run that stopped before its end to continue from its last checkpoint: the
        same run (id, folder, telemetry continuing its ``seq``), its worker started with
        ``--resume``.

        Raises ``Conflict`` (field ``id``) when the run did not stop early or has no checkpoint.
        """
        with self._lock:
            run = self.store.get_run(run_id)
            status = run["status"] if run else "gone"
            if status not in RESUMABLE:
                raise Conflict(
                    f"run {run_id} is {status}; only a failed, cancelled, killed or crashed run "
                    "can resume",
                    field="id",
                )
            if not checkpoints(self.settings.runs_dir.resolve() / str(run_id)):
                raise Conflict(
                    f"run {run_id} saved no checkpoint to resume from (checkpoint_every)",
                    field="id",
                )
            ended = ("finished_at", "exit_code", "signal", "error", "pid", "summary")
            fields = dict.fromkeys(ended)
            if self.store.set_status_if(
                run_id,
                list(RESUMABLE),
                status=RunStatus.QUEUED,
                resume=1,
                cancel_requested_at=None,
                **fields,
            ):
                self.on_change(run_id)

    def send_control(self, run_id: int, payload: dict[str, Any]) -> str:
        """Drop a control request into the run's control folder (``workbench.contract.control``); its id."""
        return write_request(self.run_dir(run_id), self.store.next_control_seq(run_id), payload)

    def is_live(self, run_id: int) -> bool:
        with self._lock:
            return run_id in self._workers
