"""Helpers of the backend tests: a real server process, the app in-process over an executor
that starts no worker, waiting, reading records back."""

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
import psutil
from fastapi.testclient import TestClient
from websockets.sync.client import connect

from backend.app import create_app
from backend.executors import Executor, Exit, Job
from backend.settings import Settings
from backend.tailer import JsonlTail

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
        # test_calibration.py tests them) unless a test asks.
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "STAGEHAND_WORKBENCH_CALIBRATE": "0",
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
            "backend.cli",
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


class IdleExecutor(Executor):
    """Starts no process. With ``slots`` 0 (the default) every run stays queued; otherwise the
    supervisor "starts" up to ``slots`` runs per device as jobs without a worker, live until the
    test ends one (``end``) or the supervisor signals it. Their telemetry is tailed from
    ``DIR/telemetry.jsonl`` as the local executor's is, so a test plays the worker by appending
    records there (``append_records``)."""

    name = "idle"

    def __init__(self, slots: int = 0) -> None:
        self.n_slots = slots
        self.exits: dict[int, Exit] = {}

    def slots(self, max_parallel: int | None) -> float:
        return self.n_slots

    def submit(self, run: dict, run_dir: Path) -> Job:
        return Job(run["id"], f"idle-{run['id']}", run["device"] or "default", run_dir)

    def poll(self, job: Job) -> Exit | None:
        return self.exits.get(job.run_id)

    def signal(self, job: Job, sig: signal.Signals) -> None:
        self.exits.setdefault(job.run_id, Exit(-int(sig)))

    def adopt(self, run: dict, run_dir: Path) -> Job | None:
        return None

    def telemetry(self, run: dict, run_dir: Path) -> JsonlTail:
        return JsonlTail(run_dir / "telemetry.jsonl", run["tail_offset"] or 0)

    def log_tail(self, job: Job) -> str | None:
        return None

    def withdraw(self, job: Job) -> None:
        pass

    def end(self, run_id: int, rc: int = 0) -> None:
        """The job of ``run_id`` exits with ``rc`` (the supervisor's next tick settles it)."""
        self.exits[run_id] = Exit(rc)


class FixedProbe:
    """A system probe (``backend.system.SystemProbe``'s ``start``, ``default_device``, ``info``)
    that answers at once for a CPU-only machine, without asking torch in a subprocess (over a
    second of CPU per app). ``test_bad_input.test_system_info`` checks the real one."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def start(self) -> None:
        pass

    def default_device(self) -> str:
        return "cpu"

    def info(self, timeout_s: float = 30.0) -> dict:
        return {
            "device": "cpu",
            "device_name": None,
            "vram_total_mb": None,
            "cuda_devices": 0,
            "ram_total_mb": psutil.virtual_memory().total / 2**20,
            "torch_version": None,
            "cuda_version": None,
            "version": "0.0.0",
            "executor": self.executor.name,
            "cluster": None,
        }


def in_process(data_dir: Path, executor: Executor | None = None, **settings) -> TestClient:
    """The app of ``create_app`` over ``data_dir`` (lifespan run: real store, presets, hub,
    tailer and supervisor), served in this process by a ``TestClient`` whose requests go to
    ``http://HOST:8000`` (``settings["host"]``, 127.0.0.1 by default: a loopback Host, as the
    security middleware wants without a token). The executor is an ``IdleExecutor`` unless
    given, the probe a ``FixedProbe``, and no calibration runs. Tests replace a service for
    their own requests with ``client.app.dependency_overrides`` (``backend.api.deps``). Close
    it (or use ``with``)."""
    config = Settings(data_dir=data_dir, calibrate=False, **settings)
    executor = executor if executor is not None else IdleExecutor()
    app = create_app(config, executor, FixedProbe(executor))
    return TestClient(app, base_url=f"http://{config.host}:8000").__enter__()


def ws_url(client: TestClient, path: str) -> str:
    """The websocket URL of ``path`` on the in-process app's host (``websocket_connect`` would
    otherwise send ``Host: testserver``, which the security middleware refuses)."""
    return f"ws://{client.base_url.netloc.decode()}{path}"


def raw_request(
    client: TestClient,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    chunks: list[bytes] = (),
) -> httpx.Response:
    """``method path`` sent to the in-process app exactly as written, the way uvicorn passes a
    request on (httpx would normalise ``..`` away), with its body as ``chunks``, one ASGI
    message each (a chunked upload)."""
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    wire_headers = [(b"host", b"127.0.0.1:8000")]
    wire_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def call() -> list[dict]:
        sent: list[dict] = []

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": wire_headers,
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        await client.app(scope, receive, send)
        return sent

    sent = client.portal.call(call)
    return httpx.Response(
        sent[0]["status"],
        headers=[(k.decode(), v.decode()) for k, v in sent[0].get("headers", [])],
        content=b"".join(m.get("body", b"") for m in sent[1:]),
    )


def append_records(data_dir: Path, run_id: int, records: list[dict]) -> None:
    """Append ``records`` to the run's ``telemetry.jsonl``, as its worker would."""
    path = data_dir / "runs" / str(run_id) / "telemetry.jsonl"
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


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
    path = data_dir / "runs" / str(run_id) / "telemetry.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
