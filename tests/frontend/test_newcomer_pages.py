"""What a newcomer met on the run, Compare and home pages (issue 56, items 5, 6 and 8; synthetic
worker, real backend, Debian chromium): the VRAM chart's refusal and limit-change labels laid out
so that none covers another, Compare's samples under their prompts, and the demo-asset strip's
first view (a build just started: no stages, no estimate) saying so instead of "about – left"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.frontend.conftest import DESKTOP, PHONE, Api, picture
from tests.frontend.test_chart_details import SETUP, STREAMING
from tests.frontend.test_hardening import make_preset
from workbench.api.assets import AssetsPublic
from workbench.services.assets import AssetBuild

pytestmark = [pytest.mark.browser]

# Steps 1..8 a second apart, then, close together on the VRAM chart's time axis, what the issue
# saw: a limits change, the refusal of the next request half a second later, another change.
MARKERS = """
    for (let s = 1; s <= 8; s++) feedStep(s, s, {vram_high_watermark_mb: 12000,
        vram_low_watermark_mb: 8000});
    const applied = (time, step, high) => rec('strategy', 'limits_applied', time, step,
        {request_id: `r${time}`, changed: {vram_high_watermark_mb: [12000, high]}});
    charts.ingest(applied(4.2, 4, 14000));
    charts.ingest(rec('trainer', 'event', 4.7, 4, {event: 'control_rejected',
        message: 'invalid limits: vram_low_watermark_mb (9000) above vram_high_watermark_mb'}));
    charts.ingest(applied(5.1, 5, 15000));
    charts.flush();
"""

# Every marker the VRAM chart drew: its label's text and box on the screen, and its line's box.
MARKER_BOXES = """() => [...document.querySelectorAll('#vram .shape-label')].map((g) => {
    const box = (e) => { const r = e.getBoundingClientRect();
        return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
    const line = document.querySelector(`#vram path[data-index="${g.dataset.index}"]`);
    return {text: g.textContent, ...box(g), line: box(line)};
})"""


def _meets(a: dict, b: dict) -> bool:
    return (
        a["left"] < b["right"]
        and b["left"] < a["right"]
        and a["top"] < b["bottom"]
        and b["top"] < a["bottom"]
    )


def _clashes(markers: list[dict]) -> list[tuple[str, str]]:
    """Pairs of labels that meet, and (label, line) where another marker's line crosses a label."""
    labels = [
        (a["text"], b["text"])
        for i, a in enumerate(markers)
        for b in markers[i + 1 :]
        if _meets(a, b)
    ]
    lines = [
        (a["text"], f"line of {b['text']}")
        for a in markers
        for b in markers
        if a is not b and _meets(a, b["line"])
    ]
    return labels + lines


@pytest.mark.parametrize("width", [DESKTOP["width"], PHONE["width"]], ids=["desktop", "phone"])
def test_vram_chart_marker_labels_do_not_cover_each_other(synthetic_server, open_page, width):
    page = open_page(PHONE if width == PHONE["width"] else DESKTOP)
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(synthetic_server + "/#/compare")
    page.wait_for_selector("#page")
    setup = SETUP.replace("'1300px'", f"'{width - 20}px'")  # the grid as wide as the page
    page.evaluate(f"async (config) => {{ {setup} {MARKERS} }}", STREAMING)
    page.wait_for_function("document.querySelectorAll('#vram .shape-label').length === 3")
    markers = page.evaluate(MARKER_BOXES)
    assert sorted(m["text"].split(":")[0] for m in markers) == ["limits", "limits", "refused"]
    # Before: all three on the plot's top edge, each over the next ("limits: high=14000" under
    # "refused: invalid limits: ..." under "limits: high=15000").
    assert _clashes(markers) == [], markers
    # Every label is inside the figure (a long one cut on a phone), none over the x axis.
    figure = page.eval_on_selector("#vram", "e => e.getBoundingClientRect().toJSON()")
    assert all(figure["top"] <= m["top"] and m["bottom"] <= figure["bottom"] for m in markers)
    assert all(figure["left"] <= m["left"] and m["right"] <= figure["right"] for m in markers)
    picture(page.locator("#vram"), f"vram-marker-labels-{'desktop' if width > 700 else 'phone'}")


def test_compare_samples_are_labelled_with_their_prompts(synthetic_server, open_page):
    api = Api(synthetic_server)
    make_preset(api, "prompted", steps=2, step_s=0)
    prompts = ["a watercolour fox", "a red boat at dawn"]
    ids = [
        api.call(
            "POST", "/api/runs", {"preset": "prompted", "overrides": {"samples": {"prompts": [p]}}}
        )["id"]
        for p in prompts
    ]
    for run_id in ids:
        api.wait_run(run_id, {"succeeded"}, timeout=60)
    for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page = open_page(viewport)
        page.goto(f"{synthetic_server}/#/compare?ids={','.join(map(str, ids))}")
        page.wait_for_selector("#compare-sample-rows figure img")
        rows = page.eval_on_selector_all(
            "#compare-sample-rows .compare-sample-row",
            """rows => rows.map((r) => ({
                run: r.dataset.runId,
                captions: [...r.querySelectorAll('figcaption')].map((c) => c.textContent),
                alts: [...r.querySelectorAll('img')].map((i) => i.alt)}))""",
        )
        # Before: no caption, the image's alt its file name ("step-00002-0.png").
        assert rows == [
            {"run": str(run_id), "captions": [prompt], "alts": [f"{prompt}, step 2"]}
            for run_id, prompt in zip(ids, prompts, strict=True)
        ]
        page.locator("#compare-samples").scroll_into_view_if_needed()
        page.wait_for_function(
            "[...document.querySelectorAll('#compare-samples img')]"
            ".every((i) => i.complete && i.naturalWidth > 0)"
        )
        picture(page.locator("#compare-samples"), f"compare-sample-prompts-{label}")
        page.close()


@pytest.fixture
def just_started(tmp_path):
    """``GET /api/assets``'s body the moment the server has started the build: the build process
    runs (a real process standing in for it) and has not written its status file yet."""
    build = AssetBuild(tmp_path / "cache")
    build._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        body = {**build.status(), "blocked_presets": {"default": "the demo assets are building"}}
    finally:
        build._proc.kill()
        build._proc.wait()
    return AssetsPublic.model_validate(body).model_dump(mode="json")


def test_asset_strip_first_view_says_the_build_is_starting(
    synthetic_server, open_page, just_started
):
    assert just_started["state"] == "building" and just_started["stages"] == []
    assert just_started["estimate_s"] is None
    for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page = open_page(viewport)
        page.route(
            "**/api/assets",
            lambda route: route.fulfill(
                status=200, content_type="application/json", body=json.dumps(just_started)
            ),
        )
        page.goto(synthetic_server + "/#/runs")
        page.wait_for_selector('#asset-strip[data-state="building"]')
        text = page.inner_text("#asset-summary")
        # Before: "building, about – left. Other presets ..." and nothing under it.
        assert "–" not in text
        assert text.startswith("starting the build: its stages and the time left show once")
        picture(page.locator("#asset-strip"), f"asset-strip-starting-{label}")
        page.close()
