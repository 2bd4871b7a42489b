"""The demo-asset build on the dashboard and through the API: a server that starts the real
``workbench demo-assets`` beside it (a temp cache, 2 training steps per model so it takes
seconds), a stage that fails (a file where its folder goes) shown with its reason and a Retry
button and named by ``GET /api/assets``, the New run page and ``POST /api/runs`` refusing
``default`` meanwhile while other presets start, the retry's progress bars (a second build
refused while it runs, the built stage kept, not rebuilt), then ``default`` started from the
page once the assets are on disk. (``tests/backend/test_assets.py`` holds the refusals before
any build and a build stopped with the server.)"""

from __future__ import annotations

import re
import time

import pytest

from tests.frontend.conftest import Api, _start_server, _stop_server, picture

pytestmark = [pytest.mark.browser]

TINY_BUILD = '{"vae_steps": 2, "vae_batch": 4, "base_steps": 2, "base_batch": 4, "sample_steps": 1}'


def settled(api: Api, timeout: float = 60) -> dict:
    """``GET /api/assets`` once the build process has exited (it writes its last state to the
    status file, which the page shows, just before it exits)."""
    deadline = time.monotonic() + timeout
    while (body := api.call("GET", "/api/assets"))["running"]:
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    return body


@pytest.fixture
def building_server(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "build").write_text("in the way")  # the demo's work folder cannot be made
    env = {
        "STAGEHAND_WORKBENCH_DEMO_ASSETS": "1",
        "STAGEHAND_WORKBENCH_CACHE": str(cache),
        "STAGEHAND_WORKBENCH_DEMO_SPEC": TINY_BUILD,
        "STAGEHAND_WORKBENCH_FORK_SERVER": "0",  # one run: a fork server would not pay back
    }
    proc, base = _start_server(tmp_path / "data", env)
    yield base, cache
    _stop_server(proc)


def test_asset_progress_failure_retry_then_default_starts(building_server, page):
    base, cache = building_server
    api = Api(base)
    page.goto(base + "/#/new")
    strip = page.locator("#asset-strip")
    page.wait_for_selector('#asset-strip[data-state="failed"]', timeout=120_000)
    text = strip.inner_text()
    assert 'Stage "demo VAE" failed: AssetError: cache folder' in text
    assert "Retry starts again at that stage; the stages already built are kept" in text
    assert page.locator('.asset-stage[data-stage="digits"]').get_attribute("data-state") == "done"
    assert "1797/1797 images" in page.locator('.asset-stage[data-stage="digits"]').inner_text()
    assert (
        page.locator('.asset-stage[data-stage="demo VAE"]').get_attribute("data-state") == "failed"
    )
    # The API says the same: the failed stage, why, and the stages after it still to build.
    failed = settled(api)
    assert failed["state"] == "failed"
    assert failed["failed_stage"] == "demo VAE"
    assert failed["error"].startswith("AssetError: cache folder ")
    assert "is not writable" in failed["error"]
    assert [(s["name"], s["state"]) for s in failed["stages"]] == [
        ("digits", "done"),
        ("demo VAE", "failed"),
        ("demo base", "pending"),
        ("demo samples", "pending"),
        ("factory models", "pending"),
    ]
    digits = failed["stages"][0]
    assert digits["done"] == digits["total"] == 1797 and digits["unit"] == "images"
    assert digits["elapsed_s"] > 0
    # default waits for its assets; Start is off, and says why.
    page.wait_for_function("document.querySelector('#preset-select').value === 'default'")
    page.wait_for_selector("#asset-note:not([hidden])")
    note = page.locator("#asset-note").inner_text()
    assert "This preset cannot start until the demo assets are built" in note
    assert "the build failed at stage 'demo VAE'" in note
    page.click("#start-run")  # the server refuses it, with the same reason
    box = page.wait_for_selector(".page-errors .error-box")
    assert "This run cannot start yet: the demo assets it needs" in box.inner_text()
    assert "(HTTP 409, assets_not_ready)" in box.inner_text()
    assert api.call("GET", "/api/runs")["count"] == 0
    status, body = api.send("POST", "/api/runs", {"preset": "default"})
    assert status == 409 and body["error"]["code"] == "assets_not_ready", body
    why = body["error"]["message"]
    assert "the build failed at stage 'demo VAE' (AssetError: cache folder" in why
    assert "retry with the dashboard's Retry button (POST /api/assets/build)" in why
    picture(page, "assets-failed-desktop", full_page=True)
    page.select_option("#preset-select", "tiny-ci")  # another preset is not held back
    assert page.locator("#asset-note").is_hidden()
    page.select_option("#preset-select", "default")
    assert page.locator("#asset-note").is_visible()

    digits_marker = cache / "data" / "digits-64px" / ".complete"
    built_at = digits_marker.stat().st_mtime_ns
    (cache / "build").unlink()
    page.click("#asset-retry")
    running = page.wait_for_selector('.asset-stage[data-state="running"]', timeout=60_000)
    row = running.inner_text()
    assert re.search(r"elapsed \d+s · about \d+s left", row), row
    assert "already built, kept" in page.locator('.asset-stage[data-stage="digits"]').inner_text()
    assert "building, about" in page.locator("#asset-summary").inner_text()
    status, body = api.send("POST", "/api/assets/build")  # one build at a time
    assert status == 409 and body["error"]["code"] == "conflict", body
    picture(page, "assets-progress-desktop", full_page=True)

    page.wait_for_selector('#asset-strip[data-state="ready"]', timeout=240_000)
    assert digits_marker.stat().st_mtime_ns == built_at  # the retry kept the digits
    assert "ready: the default preset can start" in page.locator("#asset-summary").inner_text()
    ready = settled(api)
    assert ready["state"] == "ready"
    assert [s["kept"] for s in ready["stages"]] == [True, False, False, False, False]
    assert ready["blocked_presets"] == {} and ready["estimate_s"] is None
    page.wait_for_selector("#asset-note", state="hidden")
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"), timeout=60_000)
    run_id = int(page.url.rsplit("/", 1)[1])
    run = api.call("GET", f"/api/runs/{run_id}")
    assert run["preset"] == "default"
    # The worker found the assets on disk (no rebuild): it records run_started, then trains.
    deadline = time.monotonic() + 180
    while True:
        recs = api.call("GET", f"/api/runs/{run_id}/telemetry?kind=run_started")["data"]
        if recs:
            break
        assert time.monotonic() < deadline, api.call("GET", f"/api/runs/{run_id}")
        time.sleep(0.2)
    assert recs[0]["model"].endswith("models/flux-small-digits/transformer")
    picture(page, "assets-default-run-desktop", full_page=True)
    api.call("POST", f"/api/runs/{run_id}/cancel")
    api.wait_run(run_id, {"cancelled", "succeeded", "failed", "killed"}, timeout=120)
