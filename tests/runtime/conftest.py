"""Runtime tests run in their own temp folder: a runtime built without a ``Telemetry`` writes
its default JSONL file (``stagehand_telemetry.jsonl``...) into the working directory."""

import pytest


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
