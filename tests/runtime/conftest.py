"""Runtime tests run in their own temp folder: a runtime built without a ``Telemetry`` writes
its default JSONL file (``stagehand_telemetry.jsonl``...) into the working directory.

``STAGEHAND_TEST_LAG=N`` runs every test under the device double with a lag of N operations
(``device_double.py``: device memory apart from the host, copies and kernels late in stream order, a caching allocator per stream, freed memory poisoned)."""

import os

import pytest

from .device_double import device_double


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _device_double(request):
    lag = os.environ.get("STAGEHAND_TEST_LAG")
    if not lag or request.node.get_closest_marker("sync_device"):
        yield
        return
    with device_double(int(lag)):
        yield
