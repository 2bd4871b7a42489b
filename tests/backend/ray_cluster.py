"""A real one-node Ray cluster on loopback for the Ray executor's tests.

``ray start --head --block`` as our child, bound to 127.0.0.1 with 2 CPUs, its own temp dir
and its own ports (other test sessions on this machine may run a cluster too: Ray's default
ports would collide). It is stopped by its pid: SIGTERM to ``ray start --block`` stops the
processes it started; any left behind (its descendants, found before the SIGTERM, and anything
naming our temp dir) are killed by pid. Never ``ray stop``: that stops every cluster on the machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from backend_helpers import free_port

RAY = Path(sys.executable).parent / "ray"


class RayCluster:
    def __init__(self) -> None:
        # Short: Ray's unix sockets live under the temp dir (108-byte path limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="wbray-", dir="/tmp"))
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        self.log = self.temp_dir / "ray-start.log"

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 120) -> RayCluster:
        base = random.randrange(20000, 29000, 100)
        cmd = [
            str(RAY),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            "--num-cpus=2",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--min-worker-port={base}",
            f"--max-worker-port={base + 99}",
            "--disable-usage-stats",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        t0 = time.monotonic()
        out = open(self.log, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        from ray.job_submission import JobSubmissionClient

        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {self.log.read_text()[-3000:]}")
            try:
                JobSubmissionClient(self.address).list_jobs()
                # The job API can answer before the raylet has registered: up means the
                # head node is ALIVE in the state API too (CI once saw 0 nodes alive).
                if self.nodes_alive() >= 1:
                    self.start_s = time.monotonic() - t0
                    return self
            except Exception:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"Ray's job API and its node not up after {timeout} s: {self.log.read_text()[-3000:]}"
        )

    def nodes_alive(self) -> int:
        """ALIVE nodes in the state API (``/api/v0/nodes``), as the executor reads them."""
        url = f"{self.address}/api/v0/nodes?limit=100"
        with urllib.request.urlopen(url, timeout=5) as resp:
            listed = json.loads(resp.read())["data"]["result"]["result"]
        return sum(n["state"] == "ALIVE" for n in listed)

    def ours(self) -> list[psutil.Process]:
        """Processes of this cluster: they name our temp dir (or session dir) on their line."""
        mine = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.temp_dir) in part for part in proc.info["cmdline"] or []):
                    mine.append(proc)
            except psutil.Error:
                continue
        return mine

    def stop(self) -> None:
        family: list[psutil.Process] = []
        if self.proc is not None:
            try:  # gcs, raylet, dashboard and their workers and jobs: children of ray start
                family = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for proc in family + self.ours():
            try:
                proc.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
