"""The New run page's Plan panel: the config being edited is planned through
``POST /api/plan`` on a device profile; the verdict, the numbers and the VRAM curve show, and a
bad field shows the API's error naming it."""

from __future__ import annotations

import json
import re

import pytest

from tests.frontend.conftest import PHONE, SHOTS, TAKE_SHOTS

pytestmark = [pytest.mark.browser]


def test_plan_panel_before_start(backend_server, page):
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.select_option("#plan-device", "rtx4090")
    page.click("#plan-run")
    # The first plan of a server measures the worker's baseline RSS (backend/workbench/plan/baseline.py).
    page.wait_for_selector("#plan-verdict", timeout=120_000)
    assert page.get_attribute("#plan-verdict", "data-fits") == "true"
    assert "on rtx4090" in page.inner_text("#plan-summary")
    assert page.inner_text("#plan-peak").startswith("peak VRAM ")
    page.wait_for_selector("#plan-chart .main-svg")
    points = page.evaluate("document.getElementById('plan-chart').data[0].y.length")
    assert points > 8
    # What a step moves: resident vs streamed blocks, GB of H2D per step and from where.
    residency = page.inner_text("#plan-residency")
    assert " blocks resident (" in residency and "iB), " in residency and " streamed (" in residency
    moved = page.inner_text("#plan-moved")
    assert "iB H2D per step in " in moved and "block loads, from " in moved
    assert re.search(r"; \d+ miss their prefetch \(loaded on demand\), \d+ host waits", moved)
    assert page.inner_text("#plan-bound").startswith("bound max(compute ")
    assert page.inner_text("#plan-profile") == (
        "profile 165.2 TFLOPs, H2D 25 GB/s, memory 1008 GB/s"
    )
    assert "MiB" in page.inner_text("#plan-peak")
    if TAKE_SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "new-run-plan.png"), full_page=True)
        page.set_viewport_size(PHONE)
        page.wait_for_timeout(300)
        page.screenshot(path=str(SHOTS / "new-run-plan-phone.png"), full_page=True)

    config = json.loads(page.input_value("#config-json"))
    config["memory"]["stagehand"]["prefetch_window_blocks"] = -1
    page.fill("#config-json", json.dumps(config))
    # The server's check of the form (as it is typed) puts the error at its field and holds
    # Plan back (tests/frontend/test_newcomer_newrun.py: Plan's own 422 goes there too).
    error = page.wait_for_selector("#error-prefetch_window_blocks:text('found -1')")
    assert error.inner_text() == "found -1, expected greater than or equal to 0"
    assert page.is_disabled("#plan-run")


def test_plan_panel_shows_a_damped_calibration_and_the_stored_cpu_profile(backend_server, page):
    """The plan's answer as a server with one calibrating run (x4.9) and this machine's stored
    CPU profile would give it: the answer of ``rtx4090`` with those two parts put in (a real
    CPU profile is minutes of measuring; feedback.combine and stored_profile are tested on
    their own)."""
    measured = {"count": 3, "wanted": 3, "path": "/x/cpu-profile.json"}
    measured["values"] = {"op_us": [257.6, 668.5, 300.0]}
    device = {"tracked": True, "op_us": 300.0, "load_us": 3000.0, "measured": measured}
    calibration = {
        "run_ids": [7],
        "device": "rtx4090",
        "family": "flux",
        "ratios": {"step_ms": 4.9 ** (1 / 3), "peak_vram_mb": 0.9},
        "medians": {"step_ms": 4.9, "peak_vram_mb": 0.9},
        "runs": {"step_ms": 1, "peak_vram_mb": 3},
        "refused": [],
    }

    def with_calibration(route):
        response = route.fetch()
        plan = response.json()
        plan["device"].update(device)
        plan["calibration"] = calibration
        route.fulfill(response=response, json=plan)

    page.route("**/api/plan", with_calibration)
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.select_option("#plan-device", "rtx4090")
    page.click("#plan-run")
    page.wait_for_selector("#plan-calibration", timeout=120_000)
    assert page.inner_text("#plan-calibration") == (
        "calibrated by run #7 on rtx4090/flux: step ×1.698 (median ×4.900 of 1 run, damped "
        "toward 1), VRAM ×0.900"
    )
    assert page.inner_text("#plan-profile") == (
        "profile 165.2 TFLOPs, H2D 25 GB/s, memory 1008 GB/s, 300 µs/op, 3000 µs/load; median "
        "of 3 of 3 measurements on this machine (µs/op measured: 257.6, 668.5, 300)"
    )
    if TAKE_SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.locator("#plan-summary").screenshot(path=str(SHOTS / "new-run-plan-calibrated.png"))


def test_a_plan_that_measures_the_cpu_first_says_so_and_counts_its_seconds(backend_server, page):
    """The first plans on ``cpu`` measure this machine (tens of seconds, a minute while the
    demo builds): the panel says so and counts the seconds instead of leaving a greyed-out
    button with nothing else. The plan request is held until the test has seen that (and is
    then answered for ``rtx4090``, so no real measurement runs); ``GET /api/plan/cpu-profile``
    answers as a machine with one measurement of three stored would."""
    held = []
    page.route("**/api/plan", lambda route: held.append(route))
    status = {
        "will_measure": True,
        "measuring": False,
        "measurements": 1,
        "wanted": 3,
        "measure_s": 41.2,
    }
    page.route("**/api/plan/cpu-profile", lambda route: route.fulfill(json=status))
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.select_option("#plan-device", "cpu")
    page.click("#plan-run")
    progress = page.locator("#plan-progress")
    progress.wait_for(state="visible", timeout=5_000)
    page.wait_for_function(
        "document.getElementById('plan-progress').textContent.includes('measuring')"
    )
    text = progress.inner_text()
    assert text.startswith(
        "Planning: measuring this machine's CPU first (measurement 2 of 3, once per machine; "
        "the last took 41 s)… "
    ), text
    # The seconds count up while the plan is held.
    page.wait_for_function(
        "/… [2-9] s$/.test(document.getElementById('plan-progress').textContent)"
    )
    assert page.is_disabled("#plan-run")
    if TAKE_SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.locator(".plan-panel").screenshot(path=str(SHOTS / "new-run-plan-measuring.png"))
    assert len(held) == 1
    body = json.loads(held[0].request.post_data)
    assert body["device"] == "cpu"
    held[0].continue_(post_data=json.dumps({**body, "device": "rtx4090"}))
    page.wait_for_selector("#plan-verdict", timeout=120_000)
    assert progress.is_hidden() and page.is_enabled("#plan-run")
