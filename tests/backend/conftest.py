"""Real server processes on 127.0.0.1 with a free port, real ``workbench train`` workers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Test modules here import their helpers as a top-level module (tests/ is not a package, and a
# package named "backend" under it would shadow the real one).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend_helpers import Server, kill_workers  # noqa: E402


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
