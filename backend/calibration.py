"""Calibration of plans by finished runs: a succeeded run's measured figures stored next to
the plan of the config it started with, under its device profile and family
(``workbench/plan/feedback.py`` says which figures and how they compare).

The plan is made when the run has finished, on the ``Calibrator``'s own thread, not when it
starts: a plan is a function of the config and the profile only, so the start config planned at
the end is the same prediction, and no launch waits for a plan (the first plan on ``cpu``
measures this machine for seconds) nor does a run that fails cost one. A run whose limits were
changed while it ran is not calibrated: its peak and step time mix two configs. Plans take the
median of the newest runs' ratios within bounds (``calibration_for``; NOTE [ Ratios the model
can be off by ] in workbench/plan/feedback.py), so one disturbed run does not scale them all.
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

from backend.store import Store
from contract.records import LIMITS_APPLIED, RUN_STARTED

log = logging.getLogger("backend.calibration")


def calibration_for(store: Store, device: str, family: str) -> dict | None:
    """What a plan of ``device`` and ``family`` is scaled by: the median ratios of the newest
    runs within the bounds (``workbench.plan.feedback.combine``), or None."""
    from workbench.plan.feedback import RUNS, combine  # workbench.plan imports torch: not at start

    return combine(store.calibrations_of(device, family, RUNS))


ProfileOf = Callable[[str], Any]
"""Device profile name -> ``workbench.plan.DeviceProfile`` (tests give a fixed one for cpu)."""


def _profile(name: str):
    from workbench.plan import profile

    return profile(name)


class Calibrator:
    """Calibrates finished runs on one thread (``submit``), or at once (``calibrate``).

    ``pending``: a JSON file listing the runs submitted and not yet calibrated, written on
    every submit and every end, so that a calibration still queued or being computed when the
    server stops (or is killed) is done by the next one (``start`` submits them again)."""

    def __init__(
        self, store: Store, profile_of: ProfileOf = _profile, pending: Path | None = None
    ) -> None:
        self.store = store
        self.profile_of = profile_of
        self.pending_path = pending
        self._pending: list[int] = self._read_pending()
        self._lock = threading.Lock()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None

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
            except Exception:
                log.exception("run %d: calibration failed", run_id)
            with self._lock:  # done, stored or not: a failure is not retried forever
                if run_id in self._pending:
                    self._pending.remove(run_id)
                    self._write_pending()

    def calibrate(self, run_id: int) -> dict | None:
        """Plan the run's config on its device, store the calibration and return it; None
        (logged, nothing stored) when the run did not succeed, changed limits while it ran, ran
        on a device without a profile, or its config cannot be planned."""
        from workbench.plan import PlanInputError, plan_preset
        from workbench.plan.feedback import (
            family_of,
            measured_figures,
            predicted_figures,
            profile_name,
            ratios,
        )

        store = self.store
        run = store.get_run(run_id)
        if run is None or run["status"] != "succeeded":
            return None
        started = store.last_record(run_id, *RUN_STARTED) or {}
        device = profile_name(started.get("device"), started.get("device_name"))
        if device is None:
            log.info("run %d: no device profile for %r: not calibrated", run_id, started)
            return None
        for _, line in store.telemetry_lines(run_id, -1, 10_000, *LIMITS_APPLIED):
            if json.loads(line).get("changed"):
                log.info("run %d: limits changed while it ran: not calibrated", run_id)
                return None
        summary = run["summary"] or store.summary(run_id)
        try:
            plan = plan_preset(run["config"], self.profile_of(device), name=run["name"]).to_dict()
        except (PlanInputError, ValueError, TypeError, KeyError) as exc:
            log.info("run %d: its config cannot be planned (%s): not calibrated", run_id, exc)
            return None
        predicted = predicted_figures(plan, summary.get("steps_done"))
        measured = measured_figures(
            summary, store.max_in_steps(run_id, "rss_mb"), store.max_in_steps(run_id, "pinned_mb")
        )
        last = summary.get("steps_done")
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
