"""Two ways to serve the app: in-process (``api``, ``api_factory``: a ``TestClient`` over
``create_app``, no worker started) for the HTTP contract, and real server processes on
127.0.0.1 with a free port and real ``workbench train`` workers (``server``,
``server_factory``) where the process is the point."""

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
from inprocess import in_process  # noqa: E402


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
