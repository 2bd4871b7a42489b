"""The live-limits loop and the live run header in the browser, on real tiny-ci runs.

Two runs: one without activation spill, where a spill watermark change passes the API and the
worker refuses it (the panel and the charts say so, the PATCH answer held back until the
worker's record has reached the page); one with it, whose header figures move
while it runs, whose VRAM watermark change leaves the spill watermarks alone, and whose
changed limits Compare and "Re-run with changes" show once it has stopped.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.frontend.conftest import Api, is_marker_label, picture

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LONG = 100_000  # runs stop when the test cancels them
LOSS_X = "(document.getElementById('loss')?.data?.[0]?.x ?? [])"
NO_SPILL = {"memory": {"stagehand": {"activation_stagehand": {"enabled": False}}}}
REFUSED_COLOR = "#d9480f"


def start(api: Api, name: str, overrides: dict) -> int:
    body = {"preset": "tiny-ci", "name": name, "overrides": {"max_steps": LONG, **overrides}}
    return api.call("POST", "/api/runs", body)["id"]


def stop(api: Api, run_id: int) -> None:
    if api.call("GET", f"/api/runs/{run_id}")["status"] in ("queued", "running"):
        api.call("POST", f"/api/runs/{run_id}/cancel")
    api.wait_run(run_id, {"cancelled", "succeeded", "failed"})


@pytest.fixture(scope="module")
def no_spill_run(backend_server):
    """A tiny-ci run without activation spill (stopped by its tests)."""
    api = Api(backend_server)
    run_id = start(api, "no-spill", NO_SPILL)
    yield run_id
    stop(api, run_id)


def open_run(page, base: str, run_id: int) -> None:
    page.goto(f"{base}/#/runs/{run_id}")
    # The worker takes limits once it trains (before, it has no strategy): a first step.
    page.wait_for_function(f"{LOSS_X}.length >= 1", timeout=120_000)


def test_a_change_the_worker_refuses_is_shown_on_the_panel_and_charts(
    backend_server, no_spill_run, page, shoot
):
    api = Api(backend_server)
    open_run(page, backend_server, no_spill_run)
    # The panel sits beside the VRAM chart, not under every chart.
    vram = page.locator("#vram").bounding_box()
    panel = page.locator("#limits-panel").bounding_box()
    assert panel["y"] < vram["y"] + vram["height"], (panel, vram)
    assert "Activations spill to the host above it." in page.inner_text("#limits-panel")

    def rejections(request_id=None) -> list[dict]:
        url = f"/api/runs/{no_spill_run}/telemetry?source=trainer&kind=event&limit=100"
        return [
            r
            for r in api.call("GET", url)["data"]
            if r.get("event") == "control_rejected" and request_id in (None, r["request_id"])
        ]

    def answer_late(route):
        # A busy server: the worker's answer reaches the page before the PATCH's own.
        response = route.fetch()
        request_id = response.json()["request_id"]
        deadline = time.monotonic() + 60
        while not rejections(request_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the live stream hands it to the page meanwhile
        route.fulfill(response=response)

    page.route(re.compile(r"/api/runs/\d+/limits$"), answer_late)
    spill_high = "#limit-activation_vram_high_watermark_mb"
    assert page.input_value(spill_high) == "0.5"
    page.fill(spill_high, "0.75")
    page.click("#apply-limits")
    refused = page.wait_for_selector("#limits-log li.refused", timeout=60_000)
    text = refused.inner_text()
    assert text.startswith("activation_vram_high_watermark_mb=0.75: refused by the worker at step")
    assert text.endswith(
        "invalid limits: activation_vram_high_watermark_mb: no runtime of this strategy has "
        "that limit"
    )
    assert page.input_value(spill_high) == "0.5"  # the value in force, again
    picture(page.locator("#limits-panel"), "limits-refused-panel")
    # The worker's record is the one shown.
    rejected = rejections()
    assert len(rejected) == 1 and rejected[0]["message"] in text
    assert f"at step {rejected[0]['step']}:" in text

    # A marker on the charts, in the refusal's colour, on time and step axes alike.
    page.evaluate("window.__runView.charts.flush()")
    for chart in ("vram", "loss"):
        shapes = page.evaluate(f"document.getElementById('{chart}').layout.shapes")
        assert len(shapes) == 1, chart
        assert shapes[0]["line"]["color"] == REFUSED_COLOR
        # The refusal's reason, cut with "…" where the room beside its line ends (the panel
        # above shows it whole; the room depends on the step the worker refused at).
        label, full = shapes[0]["label"]["text"], f"refused: {rejected[0]['message']}"
        assert label.startswith("refused: invalid limits"), label
        assert is_marker_label(label, full), label
    loss_shape = page.evaluate("document.getElementById('loss').layout.shapes[0]")
    assert loss_shape["x0"] == rejected[0]["step"]
    shoot(f"{backend_server}/#/runs/{no_spill_run}", "limits-refused", ready="#vram .main-svg")
    stop(api, no_spill_run)


def fact(page, name: str) -> str:
    return page.inner_text(f"#fact-{name} .fact-value")


def test_header_live_watermark_alone_compare_and_rerun_show_effective_limits(
    backend_server, no_spill_run, page, shoot
):
    api = Api(backend_server)
    stop(api, no_spill_run)  # one run at a time: this one would queue behind it
    run_id = start(api, "live-limits", {})
    open_run(page, backend_server, run_id)

    # The header's figures follow the records while the run goes.
    assert page.text_content("#fact-loss .fact-label") == "loss"
    steps = int(fact(page, "step").split("/")[0])
    before = {name: fact(page, name) for name in ("loss", "peak", "mean-step", "spill")}
    assert "–" not in before.values(), before
    page.wait_for_function(
        "(n) => +document.querySelector('#fact-step .fact-value').textContent.split('/')[0] > n + 2",
        arg=steps,
        timeout=60_000,
    )
    # The loss moves from step to step; the mean step time and the spill per step may round
    # to the same figures (CI saw "162 ms" and "0.9 MB" twice), so they are only present.
    after = {name: fact(page, name) for name in ("loss", "peak", "mean-step", "spill")}
    assert after["loss"] != before["loss"]
    assert "–" not in after.values(), after

    # A VRAM (weight) watermark change moves only that watermark.
    page.fill("#limit-vram_high_watermark_mb", "2")
    page.click("#apply-limits")
    applied = page.wait_for_selector("#limits-log li.applied", timeout=60_000)
    # Its first line: the change; a second, once the run settles, says what it did.
    assert applied.inner_text().splitlines()[0].endswith("vram_high_watermark_mb 1 → 2")
    assert page.input_value("#limit-activation_vram_high_watermark_mb") == "0.5"
    assert page.input_value("#limit-activation_vram_low_watermark_mb") == "0.25"
    records = api.call(
        "GET", f"/api/runs/{run_id}/telemetry?source=strategy&kind=limits_applied&limit=10"
    )["data"]
    assert [r["changed"] for r in records] == [{"vram_high_watermark_mb": [1.0, 2.0]}]
    step = records[0]["step"]
    picture(page, "limits-applied-live")
    # An API refusal (low above the high in force) beside its field.
    page.fill("#limit-vram_low_watermark_mb", "3")
    page.click("#apply-limits")
    err = page.wait_for_selector("#limits-panel .field-error:not(:empty)")
    assert err.inner_text() == (
        "vram_low_watermark_mb (3) must not be above the high watermark in force, "
        "vram_high_watermark_mb (2)"
    )
    shoot(f"{backend_server}/#/runs/{run_id}", "limits-applied", ready="#vram .main-svg")
    stop(api, run_id)
    page.wait_for_selector(".run-header .badge[data-status='cancelled']")
    assert page.text_content("#fact-loss .fact-label") == "final loss"

    # Compare: the config's value, then the change and its step.
    page.goto(f"{backend_server}/#/compare?ids={run_id},{no_spill_run}")
    row = page.wait_for_selector("tr[data-path='memory.stagehand.vram_high_watermark_mb']")
    cells = [c.inner_text() for c in row.query_selector_all("td")]
    assert cells[1:] == [f"1 → 2 at step {step}", "1"]
    shoot(
        f"{backend_server}/#/compare?ids={run_id},{no_spill_run}",
        "compare-live-limits",
        ready="#config-diff table",
    )

    # Re-run offers the limits the run ended with.
    page.goto(f"{backend_server}/#/new?from={run_id}")
    page.wait_for_selector("#rerun-limits")
    assert page.input_value("#field-vram_high_watermark_mb") == "2"
    assert page.input_value("#field-activation_vram_high_watermark_mb") == "0.5"
    assert "vram_high_watermark_mb 1 → 2" in page.inner_text("#rerun-limits")
    assert re.search(r'"vram_high_watermark_mb": 2\b', page.input_value("#config-json"))
