"""Calibration of plans by finished runs: a succeeded run's measured figures stored next to
the plan of the config it started with, under its device profile and family
(``backend/workbench/plan/feedback.py`` says which figures and how they compare).

The plan is made when the run has finished, on the ``Calibrator``'s own thread, not when it
starts: a plan is a function of the config and the profile only, so the start config planned at
the end is the same prediction, and no launch waits for a plan (the first plan on ``cpu``
measures this machine for seconds) nor does a run that fails cost one. A run whose limits were
changed while it ran is not calibrated: its peak and step time mix two configs (the worker's
resolution of ``"auto"`` limits is no such change: it is the config, as the planner resolves it
too). Why a run has no calibration is answered (``Calibrator.why_not``), never left a bare 404.
Plans take the
median of the newest runs' ratios within bounds (``calibration_for``; NOTE [ Ratios the model
can be off by ] in backend/workbench/plan/feedback.py), so one disturbed run does not scale them all.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagehand.config.records import LIMITS_APPLIED
from workbench.contract.records import OOM_REQUEST, RUN_STARTED
from workbench.services.torch_side import import_torch_side
from workbench.store import Store

log = logging.getLogger("workbench.services.calibration")


def calibration_for(store: Store, device: str, family: str) -> dict | None:
    """What a plan of ``device`` and ``family`` is scaled by: the median ratios of the newest
    runs within the bounds (``workbench.plan.feedback.combine``), or None."""
    from workbench.plan.feedback import RUNS, combine  # lazy: the server starts without torch

    return combine(store.calibrations_of(device, family, RUNS))


def recovery_for(store: Store, device: str, family: str) -> dict | None:
    """What a plan of ``device`` (a profile name) and ``family`` learns from the newest runs of
    them that ran out of memory and recovered (``trainer/oom_recovery`` records): the lowest
    limits they went on with (``workbench.plan.recovery.learnt_limits``), or None when there is none."""
    from workbench.plan.feedback import family_of  # lazy: the server starts without torch
    from workbench.plan.recovery import (  # lazy: as workbench.plan.feedback
        RECOVERY_RUNS,
        learnt_limits,
    )

    by_run: dict[int, list[dict]] = {}
    for run_id, rec in store.oom_recoveries():  # newest run first
        by_run.setdefault(run_id, []).append(rec)
    runs = []
    for run_id, records in by_run.items():
        run = store.get_run(run_id)
        if run is None or family_of(run["config"]) != family:
            continue
        started = store.last_record(run_id, *RUN_STARTED) or {}
        if profile_name(started.get("device"), started.get("device_name")) == device:
            runs.append((run_id, records))
        if len(runs) == RECOVERY_RUNS:
            break
    return learnt_limits(device, family, runs)


AUTO_REQUEST = "auto"
"""The ``request_id`` of the ``strategy/limits_applied`` records in which the worker resolves
``"auto"`` limits (at build, and again after the trace step: ``runtime/stagehand/strategy/composed.py``)."""

PENDING, NOT_CALIBRATED = "calibration_pending", "not_calibrated"
"""Codes of the 404 of a run without a calibration: one is being computed (ask again), or
there will be none (the message says why)."""


PROFILE_NAMES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "h100 pcie": "h100-pcie",
    "h100": "h100",
}
"""Device-name parts to profiles, the first that matches wins (an "NVIDIA H100 PCIe" is the
PCIe profile, any other H100 the SXM5 one)."""


def profile_name(device: str | None, device_name: str | None) -> str | None:
    """The device profile a run ran on: ``cpu`` for a CPU run, a named GPU profile when the
    CUDA device's name matches one (``NVIDIA GeForce RTX 4090`` -> ``rtx4090``), else None."""
    if not device:
        return None
    if device == "cpu":
        return "cpu"
    text = (device_name or "").lower()
    for key, name in PROFILE_NAMES.items():
        if key in text:
            return name
    return None


def skip_reason(store: Store, run: dict) -> str | None:
    """Why ``run`` (a store row) gets no calibration, from its row and records alone (no plan):
    it did not succeed, its device has no profile, or a user changed its limits while it ran.
    None: it can be calibrated."""
    if run["status"] != "succeeded":
        return f"only succeeded runs are calibrated; this one {run['status']}"
    started = store.last_record(run["id"], *RUN_STARTED) or {}
    if profile_name(started.get("device"), started.get("device_name")) is None:
        device = started.get("device_name") or started.get("device") or "unknown"
        return f"its device ({device}) has no plan profile to calibrate"
    for _, line in store.telemetry_lines(run["id"], -1, 10_000, *LIMITS_APPLIED):
        rec = json.loads(line)
        if rec.get("changed") and rec.get("request_id") == OOM_REQUEST:
            return (
                f"it ran out of memory and lowered its limits (step {rec.get('step')}): its "
                "peak and step time mix two configs"
            )
        if rec.get("changed") and rec.get("request_id") != AUTO_REQUEST:
            return (
                f"its limits were changed while it ran (step {rec.get('step')}): its peak and "
                "step time mix two configs"
            )
    return None


ProfileOf = Callable[[str], Any]
"""Device profile name -> ``plan.DeviceProfile`` (tests give a fixed one for cpu)."""


def _profile(name: str):
    from workbench.plan import profile  # lazy: the server starts without torch

    return profile(name)


class Calibrator:
    """Calibrates finished runs on one thread (``submit``), or at once (``calibrate``).

    ``pending``: a JSON file listing the runs submitted and not yet calibrated, written on
    every submit and every end, so that a calibration still queued or being computed when the
    server stops (or is killed) is done by the next one (``start`` submits them again)."""

    def __init__(
        self,
        store: Store,
        profile_of: ProfileOf = _profile,
        pending: Path | None = None,
        enabled: bool = True,
    ) -> None:
        self.store = store
        self.enabled = enabled
        """Whether the server submits its finished runs (``Settings.calibrate``)."""
        self.profile_of = profile_of
        self.pending_path = pending
        self._pending: list[int] = self._read_pending()
        self._lock = threading.Lock()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.skipped: dict[int, str] = {}
        """Run id -> why its calibration was not stored, for the runs this server tried."""

    def _read_pending(self) -> list[int]:
        if self.pending_path is None or not self.pending_path.is_file():
            return []
        try:
            ids = json.loads(self.pending_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: not read (%s); those runs stay uncalibrated", self.pending_path, exc)
            return []
        return [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else []

    def _write_pending(self) -> None:
        if self.pending_path is None:
            return
        tmp = self.pending_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._pending))
        os.replace(tmp, self.pending_path)

    def start(self) -> None:
        for run_id in self._pending:  # left by a server that stopped before calibrating them
            log.info("run %d: calibration left pending by the last server: done now", run_id)
            self._queue.put(run_id)
        self._thread = threading.Thread(target=self._loop, name="calibrator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)

    def submit(self, run_id: int) -> None:
        with self._lock:
            if run_id not in self._pending:
                self._pending.append(run_id)
                self._write_pending()
        self._queue.put(run_id)

    def _loop(self) -> None:
        while (run_id := self._queue.get()) is not None:
            try:
                self.calibrate(run_id)
            except Exception as exc:
                log.exception("run %d: calibration failed", run_id)
                self.skipped[run_id] = f"its calibration failed: {type(exc).__name__}: {exc}"
            with self._lock:  # done, stored or not: a failure is not retried forever
                if run_id in self._pending:
                    self._pending.remove(run_id)
                    self._write_pending()

    def why_not(self, run_id: int) -> tuple[str, str] | None:
        """``(code, message)`` of a run without a calibration: ``PENDING`` while it is queued or
        being computed, else ``NOT_CALIBRATED`` and why; None when the run is gone."""
        run = self.store.get_run(run_id)
        if run is None:
            return None
        reason = skip_reason(self.store, run)
        if reason is None:
            with self._lock:
                if run_id in self._pending:
                    return PENDING, f"run {run_id} is being calibrated: ask again"
            reason = self.skipped.get(run_id)
        if reason is None and not self.enabled:
            reason = "calibration is off on this server (STAGEHAND_WORKBENCH_CALIBRATE=0)"
        return NOT_CALIBRATED, f"run {run_id} has no calibration: {reason or 'none was stored'}"

    def calibrate(self, run_id: int) -> dict | None:
        """Plan the run's config on its device, store the calibration and return it; None
        (logged, nothing stored) when the run did not succeed, changed limits while it ran, ran
        on a device without a profile, or its config cannot be planned."""
        store = self.store
        run = store.get_run(run_id)
        if run is None:
            return None
        reason = skip_reason(store, run)
        if reason is not None:
            log.info("run %d: not calibrated: %s", run_id, reason)
            self.skipped[run_id] = reason
            return None
        # Only now the torch side: a server whose runs are all skipped (cancelled, failed, of a
        # device without a profile) never imports it for them (~10 CPU-s).
        import_torch_side()
        from workbench.plan import (  # lazy: the server starts without torch
            PlanInputError,
            plan_preset,
        )
        from workbench.plan.feedback import (  # lazy: the server starts without torch
            family_of,
            measured_figures,
            predicted_figures,
            ratios,
        )

        started = store.last_record(run_id, *RUN_STARTED) or {}
        device = profile_name(started.get("device"), started.get("device_name"))
        summary = run["summary"] or store.summary(run_id)
        try:
            plan = plan_preset(run["config"], self.profile_of(device), name=run["name"]).to_dict()
        except (PlanInputError, ValueError, TypeError, KeyError) as exc:
            log.info("run %d: its config cannot be planned (%s): not calibrated", run_id, exc)
            self.skipped[run_id] = f"its config cannot be planned: {exc}"
            return None
        predicted = predicted_figures(plan, summary.get("steps_done"))
        last = summary.get("steps_done")
        measured = measured_figures(
            summary,
            store.max_in_steps(run_id, "rss_mb"),
            store.max_in_steps(run_id, "pinned_mb"),
            store.step_record(run_id, "stagehand", last) if last and last > 1 else None,
        )
        curve = store.step_block_curve(run_id, last) if last else []
        t0 = curve[0][0] if curve else 0.0
        measured["curve"] = {
            "step": last,
            "t_ms": [round((t - t0) * 1e3, 3) for t, _, _ in curve],
            "mb": [v for _, v, _ in curve],
            "event": [e for _, _, e in curve],
        }
        kept = {k: plan[k] for k in ("peak_bytes", "steady_band_bytes", "step_ms", "host")}
        kept["curve"] = plan["curve"]
        kept["device"] = plan["device"]["name"]
        found = ratios(predicted, measured)
        family = family_of(run["config"])
        store.insert_calibration(run_id, device, family, predicted, measured, found, kept)
        log.info("run %d: calibration on %s/%s: %s", run_id, device, family, found)
        return store.get_calibration(run_id)
