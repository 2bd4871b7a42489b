"""The demo-asset build beside the server: ONE background ``workbench demo-assets`` process,
started when the server starts (``Settings.demo_assets``) and again by ``POST
/api/assets/build`` (retry / resume), read through its status file (``backend/workbench/worker/asset_status.py``).

The build process holds the cache's build lock, so a second starter (another server, a user's
``workbench demo-assets``) never builds at once with it. Its output goes to the server's
terminal: one progress bar per stage, then the failed stage and why.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from workbench.worker.asset_status import current, lock_holder, run_refusal

log = logging.getLogger("workbench.services.assets")


class AssetBuild:
    """Starts, stops and reports the demo-asset build of the cache folder ``cache``."""

    def __init__(self, cache: Path) -> None:
        self.cache = Path(cache)
        self._proc: subprocess.Popen | None = None

    def running(self) -> bool:
        """True while a build process (ours or another's) holds the cache's build lock, or ours
        has started and not yet taken it."""
        starting = self._proc is not None and self._proc.poll() is None
        return starting or lock_holder(self.cache) is not None

    def start(self) -> bool:
        """Start ``workbench demo-assets`` for the cache unless a build is running; True when
        started. The stages already built are kept, so this is also the retry and the resume."""
        if self.running():
            return False
        self.cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "workbench.cli", "demo-assets", "--cache-dir", str(self.cache)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        log.info("demo assets: building in process %d (%s)", self._proc.pid, " ".join(cmd))
        return True

    def stop(self) -> None:
        """SIGTERM the build this server started, if it still runs: it marks the running stage
        ``interrupted`` and the next start resumes there."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def status(self, on_disk: dict[str, Any] | None = None) -> dict[str, Any]:
        """The status file settled against the lock (``asset_status.current``; ``on_disk``:
        read already); ``running`` also counts a build this server started that has not taken
        the lock yet."""
        status = dict(on_disk) if on_disk is not None else current(self.cache)
        if not status["running"] and self._proc is not None and self._proc.poll() is None:
            status.update(running=True, state="building" if status["state"] != "ready" else "ready")
        return status

    def refusal(self, config: dict[str, Any], status: dict[str, Any] | None = None) -> str | None:
        """Why a run of ``config`` may not start until the build is done (``run_refusal``;
        ``status``: ``current(self.cache)`` already read)."""
        return run_refusal(config, self.cache, status)


class QuietAssetPolls(logging.Filter):
    """Drops uvicorn's access lines of the dashboard's status polls (``GET /api/assets``, every
    second while the assets build), which would bury the build's progress bars."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and args[2] == "/api/assets")
