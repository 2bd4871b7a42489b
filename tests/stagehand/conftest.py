"""Runtime tests run in their own temp folder: a runtime built without a ``Telemetry`` writes
its default JSONL file (``stagehand_telemetry.jsonl``...) into the working directory.

``STAGEHAND_TEST_LAG=N`` runs every test under a device that lags the host by N operations
(``lagging.py``; ``./dev test`` runs the runtime suites so with lags 1, 2 and 4)."""

import os

import pytest

from .lagging import lagging_device


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _lagging_device(request):
    lag = os.environ.get("STAGEHAND_TEST_LAG")
    if not lag or request.node.get_closest_marker("sync_device"):
        yield
        return
    with lagging_device(int(lag)):
        yield
