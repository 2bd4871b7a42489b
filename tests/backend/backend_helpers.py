"""Helpers of the backend tests: a real server process, waiting, reading records back (the app
in-process is ``inprocess.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

REPO = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """``workbench serve`` in a subprocess; ``client`` talks to it over HTTP."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", args: tuple = (), env=None):
        self.data_dir, self.host, self.args = data_dir, host, list(args)
        self.port = free_port(host)
        # No calibration plans after each run (seconds of CPU each: tests/backend/
        # test_calibration.py tests them) unless a test asks. Workers start cold: these servers
        # live for a test or two, and a fork server's imports (~10 s of CPU) pay back from a
        # server's second run on (tests/backend/test_forkserver.py and the dashboard tests'
        # session servers run forked workers).
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "STAGEHAND_WORKBENCH_CALIBRATE": "0",
            "STAGEHAND_WORKBENCH_FORK_SERVER": "0",
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--no-browser",
            "--log-level",
            "warning",
            *self.args,
        ]

    def start(self, wait: bool = True) -> Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            self.command(), cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.log.read_text()[-3000:]}"
            try:
                httpx.get(self.url + "/openapi.json", timeout=1, headers=self.headers())
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError(f"server not up after {timeout} s")

    def headers(self) -> dict:
        token = self.env.get("STAGEHAND_WORKBENCH_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers=self.headers())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def ws(self, run_id: int, since: int = -1):
        url = f"ws://{self.host}:{self.port}/api/runs/{run_id}/stream?since={since}"
        return connect(url, additional_headers=self.headers(), max_size=None, open_timeout=10)


def kill_workers(data_dir: Path) -> None:
    """Leave no worker behind: SIGKILL the group of every run the store thinks is alive."""
    import sqlite3

    db = data_dir / "workbench.db"
    if not db.exists():
        return
    with sqlite3.connect(db) as conn:
        pids = [p for (p,) in conn.execute("SELECT pid FROM runs WHERE pid IS NOT NULL")]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# -- helpers used by several test files -----------------------------------------------------------
def wait_for(predicate, timeout: float = 120, interval: float = 0.1, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached in {timeout} s")


def run_status(client: httpx.Client, run_id: int) -> dict:
    return client.get(f"/api/runs/{run_id}").json()


def wait_status(client, run_id, statuses, timeout=180) -> dict:
    statuses = {statuses} if isinstance(statuses, str) else set(statuses)
    return wait_for(
        lambda: (r := run_status(client, run_id))["status"] in statuses and r,
        timeout,
        0.2,
        f"run {run_id} in {statuses}",
    )


def file_records(data_dir: Path, run_id: int) -> list[dict]:
    """The run folder's records; a torn last line (a worker killed mid-write) is no record, as
    the server's tailer reads it."""
    text = (data_dir / "runs" / str(run_id) / "telemetry.jsonl").read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def stored_records(client, run_id: int) -> list[dict]:
    out, since = [], -1
    while True:
        page = client.get(f"/api/runs/{run_id}/telemetry", params={"since": since, "limit": 10000})
        assert page.status_code == 200, page.text
        body = page.json()
        if not body["data"]:
            return out
        out += body["data"]
        since = body["next_since"]


def assert_error_body(resp, status: int | None = None) -> dict:
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message", "field", "details"}, err
    assert isinstance(err["code"], str) and err["code"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["field"] is None or isinstance(err["field"], str)
    assert isinstance(err["details"], list)
    return err


def rec(seq: int, **kw) -> str:
    """One telemetry line (JSON) of a trainer step record with ``seq`` and ``kw``."""
    return json.dumps(
        {
            "seq": seq,
            "time": 1.0,
            "source": "trainer",
            "kind": "step",
            "step": seq,
            "phase": None,
            **kw,
        }
    )
