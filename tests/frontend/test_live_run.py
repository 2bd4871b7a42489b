"""A real tiny-ci run driven from the dashboard: New run page -> live charts -> limits -> finish.

One run covers the live path so the file stays near a minute on 2 cores: the run is started
from the form, its loss chart is seen gaining points while it runs, a watermark is changed and
the applied marker appears, the socket is dropped and the stream resumes without duplicates,
and the run finishes with one point per step.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.frontend.conftest import Api, start_refused

pytestmark = [pytest.mark.browser, pytest.mark.slow]

STEPS = 120  # long enough that the limits request always lands mid-run, even on an idle machine
LOSS_X = "(document.getElementById('loss')?.data?.[0]?.x ?? [])"


def loss_points(page) -> int:
    return page.evaluate(f"{LOSS_X}.length")


def test_new_run_form_shows_api_validation_error_beside_the_field(backend_server, page):
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    start_refused(page, lambda: page.fill("#field-max_steps", "0"))
    assert json.loads(page.input_value("#config-json"))["max_steps"] == 0
    err = page.wait_for_selector("#error-max_steps:not(:empty)")
    assert "greater than 0" in err.inner_text()
    assert "invalid" in page.get_attribute("#field-max_steps", "class")
    # The page-level box names the field too, with the API's code.
    assert "overrides.max_steps" in page.inner_text(".page-errors .error-box")
    # A client-side parse error never reaches the API.
    page.fill("#field-learning_rate", "fast")
    assert "expected a number" in page.inner_text("#error-learning_rate")


def test_start_from_form_watch_live_change_watermark_reconnect_finish(backend_server, page, shoot):
    api = Api(backend_server)
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.fill("#field-max_steps", str(STEPS))
    page.fill("#run-name", "ui-live")
    # The form and the JSON editor are one config.
    assert json.loads(page.input_value("#config-json"))["max_steps"] == STEPS
    shoot(backend_server + "/#/new", "new-run", ready="#config-json")
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    assert api.call("GET", f"/api/runs/{run_id}")["config"]["max_steps"] == STEPS

    # Live: the loss chart gains points while the run is still running, watched as a user
    # would, scrolled to (below the window, it would redraw only every OUT_OF_VIEW_MS).
    page.locator("#loss").scroll_into_view_if_needed()
    page.wait_for_function(f"{LOSS_X}.length >= 2", timeout=150_000)
    first = loss_points(page)
    page.wait_for_function(f"{LOSS_X}.length > {first}", timeout=60_000)
    assert loss_points(page) < STEPS, "the run finished before the live growth could be seen"
    assert page.get_attribute(".run-header .badge", "data-status") == "running"
    # The contexts ask for reduced motion (conftest): the running badge does not pulse then.
    badge_animation = "getComputedStyle(document.querySelector('.run-header .badge')).animationName"
    assert page.evaluate(badge_animation) == "none"
    assert re.fullmatch(rf"\d+/{STEPS}", page.inner_text("#fact-step .fact-value"))
    # How weight streaming reaches the device, and why, from the worker's stagehand records
    # (tiny-ci streams file-backed; the host cache is off on a CPU device).
    records = api.call("GET", f"/api/runs/{run_id}/telemetry?source=stagehand&kind=step")
    last = records["data"][-1]
    page.wait_for_selector("#fact-weights")
    assert page.inner_text("#fact-weights .fact-value") == last["weights_mode"] == "file-backed"
    assert page.inner_text("#fact-weights .fact-note") == last["weights_mode_reason"]

    # A dropped socket: banner while reconnecting, then the stream resumes after its last seq.
    before = page.evaluate("window.__runView.stream.lastSeq")
    page.evaluate(
        "window.__runView.stream.stateLog.length = 0; window.__runView.stream.simulateDrop()"
    )
    page.wait_for_function(
        "(() => { const log = window.__runView.stream.stateLog;"
        " return log.includes('reconnecting') && log[log.length - 1] === 'live'; })()",
        timeout=15_000,
    )
    assert page.evaluate("window.__runView.stream.stateLog") == [
        "reconnecting",
        "catching-up",
        "live",
    ]
    warning = page.get_attribute("#stream-banner", "data-last-warning")
    assert "Reconnecting in" in warning
    behind_at = int(re.search(r"drawn up to record (\d+)", warning).group(1))
    assert before <= behind_at <= page.evaluate("window.__runView.stream.lastSeq")
    assert page.is_hidden("#stream-banner")

    # Live limits: the worker applies them at the next step; the charts get a marker.
    # tiny-ci streams a tiny model: its watermarks are a few MB. Double the high one.
    high = float(page.input_value("#limit-vram_high_watermark_mb"))
    page.fill("#limit-vram_high_watermark_mb", f"{2 * high:g}")
    page.click("#apply-limits")
    page.wait_for_selector("#limits-log li")  # pending, until the worker's record arrives
    applied = page.wait_for_selector("#limits-log li.applied", timeout=60_000)
    assert f"vram_high_watermark_mb={2 * high:g}" in applied.inner_text()
    assert f"vram_high_watermark_mb {high:g} → {2 * high:g}" in applied.inner_text()
    assert "applied at step" in applied.inner_text()
    # The VRAM chart's high-watermark line moves to the new value.
    page.evaluate("window.__runView.charts.flush()")
    wm = page.evaluate("Array.from(document.getElementById('vram').data[2].y)")
    assert wm[-1] == pytest.approx(2 * high) and wm[0] == pytest.approx(high)
    shapes = page.evaluate("document.getElementById('loss').layout.shapes")
    assert len(shapes) == 1 and shapes[0]["type"] == "line"
    step_applied = int(re.search(r"applied at step (\d+)", applied.inner_text()).group(1))
    assert shapes[0]["x0"] == step_applied
    assert shapes[0]["label"]["text"].startswith(f"limits: high={2 * high:g}")
    vram_shapes = page.evaluate("document.getElementById('vram').layout.shapes.length")
    assert vram_shapes == 1
    shoot(backend_server + f"/#/runs/{run_id}", "run-live", ready="#loss .main-svg")

    # Finish: one point per step, no duplicates from the resume, values equal the records.
    page.wait_for_selector(".run-header .badge[data-status='succeeded']", timeout=180_000)
    page.wait_for_function(f"{LOSS_X}.length === {STEPS}", timeout=10_000)
    xs = page.evaluate(f"Array.from({LOSS_X})")
    ys = page.evaluate("Array.from(document.getElementById('loss').data[0].y)")
    records = api.call("GET", f"/api/runs/{run_id}/telemetry?source=trainer&kind=step&limit=1000")
    assert xs == list(range(1, STEPS + 1))
    assert ys == pytest.approx([r["loss"] for r in records["data"]])
    assert page.inner_text("#fact-step .fact-value") == f"{STEPS}/{STEPS}"
    # The header's peak is the training stage's, as the summary Compare uses.
    peak = api.call("GET", f"/api/runs/{run_id}")["summary"]["peak_vram_mb"]
    assert page.text_content("#fact-peak .fact-label") == "peak VRAM (training)"
    assert page.inner_text("#fact-peak .fact-value") == f"{peak:.1f} MB"
    summary = api.call("GET", f"/api/runs/{run_id}")["summary"]
    assert page.inner_text("#fact-weights .fact-value") == summary["weights_mode"] == "file-backed"
    assert page.get_attribute("#fact-weights", "title") == summary["weights_mode_reason"]
    phases = page.evaluate("document.getElementById('phases').data.map(t => t.x.length)")
    assert phases == [STEPS] * 4
    shoot(backend_server + f"/#/runs/{run_id}", "run-finished", ready="#loss .main-svg")
