"""The run page's "Plan vs measured" card: asked for once per load, and when a succeeded run has
no calibration the card says why (the Qwen-Image and Wan run pages asked five times, got a 404
each time and showed nothing). A calibrated run's card: tests/frontend/test_tune_ui.py.
Synthetic worker, real backend with calibration on."""

from __future__ import annotations

import copy
import time

import pytest

from tests.frontend.conftest import Api, picture

pytestmark = [pytest.mark.browser]


def _run(api: Api, name: str, description: str) -> int:
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, max_steps=2, description=f"synthetic step_s=0 {description}")
    config["memory"]["stagehand"].update(vram_high_watermark_mb=12000, vram_low_watermark_mb=8000)
    api.call("POST", "/api/presets", {"name": name, "config": config})
    run_id = api.call("POST", "/api/runs", {"preset": name, "name": name})["id"]
    api.wait_run(run_id, {"succeeded"}, timeout=120)
    return run_id


def _settled(api: Api, run_id: int) -> None:
    """Until the server's calibrator has taken the run (stored, or refused with a reason)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            api.call("GET", f"/api/runs/{run_id}/calibration")
            return
        except AssertionError as exc:
            if "calibration_pending" not in str(exc):
                return
        assert time.monotonic() < deadline, "the calibration stayed pending"
        time.sleep(0.2)


def _open(page, base: str, run_id: int) -> list[str]:
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if r.url.endswith("/calibration") else None)
    page.goto(f"{base}/#/runs/{run_id}")
    page.wait_for_selector("#run-calibration:not([hidden])", timeout=30_000)
    page.wait_for_timeout(2000)  # the page used to ask again every 1.5 s
    return asked


def test_a_run_without_calibration_says_why_once(synthetic_server, page):
    api = Api(synthetic_server)
    # The synthetic worker's device is "cuda" with no name: no plan profile matches it.
    run_id = _run(api, "cal-none", "")
    _settled(api, run_id)
    asked = _open(page, synthetic_server, run_id)
    assert len(asked) == 1, asked
    text = page.inner_text("#run-calibration")
    assert text.startswith("Plan vs measured")
    assert "its device (cuda) has no plan profile to calibrate" in page.inner_text(
        "#calibration-none"
    )
    assert not page.query_selector("#calibration-table")
    picture(page.locator("#run-calibration"), "run-calibration-none")
