"""The app in-process for tests of the HTTP contract: ``create_app`` over a temp data dir with
its lifespan run (real store, presets, hub, tailer, supervisor), served by a ``TestClient``,
over an executor that starts no worker and a probe that answers at once; or over the real
local executor whose workers fork from this test process's fork server (``ForkedExecutor``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import psutil
from fastapi.testclient import TestClient

from workbench.api.app import create_app
from workbench.executors import Executor, Exit, Job, forkserver
from workbench.executors.local import LocalExecutor
from workbench.services.settings import Settings
from workbench.services.tailer import JsonlTail


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


SESSION_ENV = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
"""This test process's environment as its conftest files left it, before any test ran (pytest's
per-test ``PYTEST_CURRENT_TEST`` left out: no worker reads it)."""


def worker_env() -> dict[str, str]:
    """The environment ``ForkedExecutor`` gives every worker: ``SESSION_ENV`` as
    ``LocalExecutor`` passes it on. Not this process's environment at launch time: the libraries
    the tests import write to it as they go (``import sklearn`` sets ``KMP_INIT_AT_FORK``, the
    bench runner ``PYTORCH_NVML_BASED_CUDA_CHECK``, Ray ``RAY_CLIENT_MODE``), and a fork server
    serves only the environment it was started with: each such write cost a new fork server
    (~7 CPU-s of imports) and a cold start (~6 more)."""
    return dict(SESSION_ENV, PYTHONUNBUFFERED="1")


class ForkedExecutor(LocalExecutor):
    """The real local executor (real ``workbench train`` workers, launched by
    ``forkserver.launch``), for an app in this process: its workers fork from one fork server
    per test process (``warm_fork_server``) instead of each importing torch, diffusers and peft
    cold (~8 s of CPU) in a test server of its own. They get the same environment every time
    (``worker_env``)."""

    @staticmethod
    def _env() -> dict[str, str]:
        return worker_env()


def warm_fork_server(timeout_s: float = 300.0) -> None:
    """Make ``forkserver``'s current fork server one for ``ForkedExecutor``'s environment and
    wait until it has imported the worker (once per test process; a later test finds it
    ready). One it replaces (another environment's, or ended) is retired as ``launch`` retires
    it. Should it fail, the workers start cold: slower, the same runs."""
    env = worker_env()
    with forkserver._lock:
        current = forkserver._current
        if current is None or current.env != env or not (current.alive() or current.error):
            if current is not None:
                forkserver._retired.append(current)
            current = forkserver._current = forkserver.ForkServer(
                env, Path.cwd(), forkserver.PRELOAD
            )
    current.ready.wait(timeout_s)


class FixedProbe:
    """A system probe (``workbench.services.system.SystemProbe``'s ``start``, ``default_device``, ``info``)
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
    their own requests with ``client.app.dependency_overrides`` (``workbench.api.deps``). Close
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
