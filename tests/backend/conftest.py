"""Three ways to serve the app: in-process (``api``, ``api_factory``: a ``TestClient`` over
``create_app``, no worker started) for the HTTP contract; in-process with real ``workbench
train`` workers forked from this test process's fork server (``local_api``) for runs, their
exits, signals and telemetry; and real server processes on 127.0.0.1 with a free port and
workers started cold (``server``, ``server_factory``) where the server's process is the point
(killed and restarted, its log, its command line)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

# Test modules here import their helpers as a top-level module (tests/ is not a package, and a
# package named "backend" under it would shadow the real one).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend_helpers import Server, kill_workers  # noqa: E402
from inprocess import ForkedExecutor, in_process, warm_fork_server  # noqa: E402

from workbench.services.settings import Settings  # noqa: E402


@pytest.fixture
def server_factory(tmp_path) -> Iterator:
    made: list[Server] = []

    def make(**kw) -> Server:
        srv = Server(kw.pop("data_dir", tmp_path / "data"), **kw)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()
    kill_workers(tmp_path / "data")


@pytest.fixture
def server(server_factory) -> Server:
    return server_factory().start()


@pytest.fixture
def api_factory(tmp_path) -> Iterator:
    """In-process apps (``inprocess.in_process``) over ``tmp_path/"data"``, closed after
    the test: ``api_factory(executor=..., token=...)``. Tests of the HTTP contract use these;
    a real server process is for crashes, restarts, streaming and real workers."""
    made: list[TestClient] = []

    def make(**kw) -> TestClient:
        client = in_process(kw.pop("data_dir", tmp_path / "data"), **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.__exit__(None, None, None)


@pytest.fixture
def api(api_factory) -> TestClient:
    """The app in-process with the default settings and no worker ever started."""
    return api_factory()


@pytest.fixture
def local_api(api_factory, tmp_path) -> Iterator:
    """``local_api(**settings)``: the app in-process (``api_factory``) over the real local
    executor, its workers forked from the test process's fork server (``ForkedExecutor``:
    ready before the first run, so none starts cold), killed after the test."""
    warm_fork_server()
    data_dirs: list[Path] = []

    def make(**kw) -> TestClient:
        data_dir = kw.pop("data_dir", tmp_path / "data")
        data_dirs.append(data_dir)
        executor = ForkedExecutor(Settings(data_dir=data_dir))
        return api_factory(data_dir=data_dir, executor=executor, **kw)

    yield make
    for data_dir in data_dirs:
        kill_workers(data_dir)
