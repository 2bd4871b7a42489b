"""What a live limits change did, on the live-limits panel of a real tiny-ci run (issue 56):
once the runtimes settle under an applied change the worker writes a ``trainer/limits_effect``
record (``backend/workbench/worker/limits_effect.py``) and the panel shows it under the change, "resident blocks
A → B, H2D per step X → Y MB; ...", with the figures of the run's own ``stagehand/step`` records
(the step before the change, and the steady step that settled it)."""

from __future__ import annotations

import re

import pytest

from stagehand.config.memory import MB
from tests.frontend.conftest import PHONE, Api, picture
from tests.frontend.test_live_limits_ui import open_run, start, stop

pytestmark = [pytest.mark.browser, pytest.mark.slow]

EFFECT = re.compile(
    r"^resident blocks (\d+) → (\d+), H2D per step ([\d.]+) → ([\d.]+) MB; "
    r"spill per step ([\d.]+) → ([\d.]+) MB; peak ([\d.]+) → ([\d.]+) MB \(settled by step (\d+)\)$"
)


def test_the_panel_says_what_a_watermark_change_did_once_it_settled(backend_server, page):
    api = Api(backend_server)
    run_id = start(api, "live-settle", {})
    try:
        open_run(page, backend_server, run_id)
        # tiny-ci streams its blocks under 1/0.5 MB; 40/30 keeps every one on the device.
        page.fill("#limit-vram_high_watermark_mb", "40")
        page.fill("#limit-vram_low_watermark_mb", "30")
        page.click("#apply-limits")
        line = page.wait_for_selector("#limits-log li.applied .limits-effect", timeout=120_000)
        text = line.inner_text()
        picture(page.locator("#limits-panel"), "limits-effect-panel")
        page.set_viewport_size(PHONE)
        line.scroll_into_view_if_needed()
        picture(page.locator("#limits-panel"), "limits-effect-panel-phone")
    finally:
        stop(api, run_id)

    def records(source: str, kind: str) -> list[dict]:
        url = f"/api/runs/{run_id}/telemetry?source={source}&kind={kind}&limit=1000"
        return api.call("GET", url)["data"]

    [effect] = records("trainer", "limits_effect")
    [applied] = records("strategy", "limits_applied")
    assert effect["request_id"] == applied["request_id"]
    assert effect["applied_step"] == applied["step"] and effect["settled"]
    weights: dict[int, dict] = {}
    for r in records("stagehand", "step"):
        weights.setdefault(r["step"], r)  # the training step's (a sampling step comes after)
    before, after = weights[effect["applied_step"] - 1], weights[effect["step"]]
    spill: dict[int, dict] = {}
    for r in records("activation_stagehand", "step"):
        spill.setdefault(r["step"], r)
    match = EFFECT.match(text)
    assert match, text
    assert match.groups()[:6] == (
        str(before["resident_blocks"]),
        str(after["resident_blocks"]),
        f"{before['h2d_bytes'] / MB:.2f}",
        f"{after['h2d_bytes'] / MB:.2f}",
        f"{spill[effect['applied_step'] - 1]['spill_bytes'] / MB:.2f}",
        f"{spill[effect['step']]['spill_bytes'] / MB:.2f}",
    )
    assert match.group(9) == str(effect["step"])
    # What the change did: the blocks streamed before, all kept and none moved once settled.
    assert before["h2d_bytes"] > 0 and after["h2d_bytes"] == 0
    assert after["resident_blocks"] > before["resident_blocks"]
    # Settled: the step before the record's gave the same figures.
    assert weights[effect["step"] - 1]["h2d_bytes"] == 0
