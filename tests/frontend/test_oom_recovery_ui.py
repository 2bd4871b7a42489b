"""An out-of-memory recovery on the run page and in Compare (issue 57 item 2), against the fixed
record format of docs/contracts.md: the synthetic worker runs out of memory in step 3's backward
once (``oom_at=3``), writes ``trainer/oom_recovery`` and its rerun's ``limits_applied`` (request
``oom``). The charts mark the step, the live-limits panel lists the change as the run's, the
header and Compare count it, and the New run page's plan of the family on that card is capped
at the limits the run went on with (real backend, Debian chromium)."""

from __future__ import annotations

import copy

import pytest

from tests.frontend.conftest import PHONE, Api, is_marker_label, picture

pytestmark = [pytest.mark.browser]

LABEL = "out of memory at step 3 (backward): limits lowered"
LINE = (
    "lowered by the run after out of memory at step 3 (backward): "
    "vram_high_watermark_mb 12000 → 6600, vram_low_watermark_mb 8000 → 4400"
)
LOGGED = "#limits-log li.run-change"
MARKERS = """(id) => {
    window.__runView.charts.flush();
    const shapes = document.getElementById(id).layout.shapes || [];
    return shapes.map((s) => [s.x0, s.label.text, s.line.color]);
}"""


def make_preset(api: Api, name: str, steps: int, description: str) -> None:
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, max_steps=steps, description=description)
    config["memory"]["stagehand"].update(vram_high_watermark_mb=12000, vram_low_watermark_mb=8000)
    api.call("POST", "/api/presets", {"name": name, "config": config})


def test_a_recovery_is_marked_listed_and_counted(synthetic_server, page, open_page):
    api = Api(synthetic_server)
    # Long enough to look at while it runs (the panel shows only then); stopped below. A step a
    # second: its ~75 records a step are drawn live while the pictures are taken.
    # On an RTX 4090 (its run_started record's device_name), so that plans of rtx4090 learn.
    oom = "synthetic step_s=1 oom_at=3 device_name=NVIDIA_GeForce_RTX_4090"
    make_preset(api, "synth-oom", steps=2000, description=oom)
    run = api.call("POST", "/api/runs", {"preset": "synth-oom", "name": "oom-once"})["id"]
    page.goto(f"{synthetic_server}/#/runs/{run}")
    page.wait_for_selector(LOGGED, timeout=90_000)

    # The panel: one line, the run's change (not a request of the user's), the inputs moved.
    assert page.locator("#limits-log li").count() == 1
    assert page.inner_text(LOGGED) == LINE
    assert page.input_value("#limit-vram_high_watermark_mb") == "6600"
    assert page.input_value("#limit-vram_low_watermark_mb") == "4400"
    # The charts: the VRAM chart at the record's time, a per-step chart at step 3; one marker
    # each (the rerun's limits_applied draws no second one).
    page.wait_for_function(
        "(window.__runView.charts.flush(), !!document.getElementById('loss').layout.shapes?.length)"
    )
    vram = page.evaluate(MARKERS, "vram")
    loss = page.evaluate(MARKERS, "loss")
    # Each label is LABEL, or LABEL cut where the room beside its line ends (a young run's chart
    # leaves little room right of step 3).
    assert [color for _, _, color in vram] == ["#c92a2a"] and is_marker_label(vram[0][1], LABEL)
    assert [(x, color) for x, _, color in loss] == [(3, "#c92a2a")]
    assert is_marker_label(loss[0][1], LABEL), loss
    # The header counts it while the run goes.
    page.wait_for_selector("#fact-recoveries")
    assert page.inner_text("#fact-recoveries .fact-value") == "1"
    picture(page, "oom-recovery-desktop", full_page=True, timeout=120_000)

    small = open_page(PHONE)
    small.goto(f"{synthetic_server}/#/runs/{run}")
    small.wait_for_selector(LOGGED, timeout=30_000)
    assert small.inner_text(LOGGED) == LINE
    small.wait_for_function(
        "(window.__runView.charts.flush(), !!document.getElementById('vram').layout.shapes?.length)"
    )
    picture(small, "oom-recovery-phone", full_page=True, timeout=120_000)
    small.close()

    api.call("POST", f"/api/runs/{run}/cancel")
    stopped = api.wait_run(run, {"cancelled"}, timeout=60)
    assert stopped["summary"]["recoveries"] == 1
    # Opened again once stopped: the count of the stored summary and records.
    page.reload()
    page.wait_for_selector(".run-header .badge[data-status='cancelled']", timeout=120_000)
    page.wait_for_selector("#fact-recoveries")
    assert page.inner_text("#fact-recoveries .fact-value") == "1"

    # The next plan of the family on that card starts at the limits the run went on with.
    page.goto(f"{synthetic_server}/#/new")
    page.wait_for_selector("#preset-select option[value='synth-oom']", state="attached")
    page.select_option("#preset-select", "synth-oom")
    page.select_option("#plan-device", "rtx4090")
    page.click("#plan-run")
    page.wait_for_selector("#plan-recovery", timeout=120_000)
    assert page.inner_text("#plan-recovery") == (
        f"a past run (#{run}) ran out of memory on rtx4090/flux (at step 3, backward); limits"
        " capped at what it went on with: vram_high_watermark_mb 12000 → 6600,"
        " vram_low_watermark_mb 8000 → 4400"
    )

    # Compare counts it per run, beside a run that never ran out of memory.
    make_preset(api, "synth-no-oom", steps=3, description="synthetic step_s=0")
    other = api.call("POST", "/api/runs", {"preset": "synth-no-oom", "name": "no-oom"})["id"]
    api.wait_run(other, {"succeeded"}, timeout=60)
    page.goto(f"{synthetic_server}/#/compare?ids={run},{other}")
    cells = "#compare-summary td[data-figure='recoveries']"
    page.wait_for_selector(cells)
    assert page.locator(cells).all_inner_texts() == ["1", "0"]
    headers = page.locator("#compare-summary th").evaluate_all(
        "(th) => th.map((e) => e.textContent)"
    )
    assert "OOM recoveries" in headers
