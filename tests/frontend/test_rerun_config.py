"""What Start sends is the config on the New run page (synthetic worker, real backend, Debian
chromium): "Re-run with changes" of a run whose preset was deleted does not start another
preset, and a value of the preset removed from the form goes out as null (the server removes
the key: the field's default runs)."""

from __future__ import annotations

import json

import pytest

from tests.frontend.conftest import Api
from tests.frontend.test_hardening import make_preset

pytestmark = [pytest.mark.browser]


def _run_posts(page) -> list[str]:
    posts: list[str] = []

    def seen(request) -> None:
        if request.method == "POST" and request.url.endswith("/api/runs"):
            posts.append(request.post_data)

    page.on("request", seen)
    return posts


def test_rerun_of_a_run_whose_preset_was_deleted_starts_its_own_config(synthetic_server, page):
    api = Api(synthetic_server)
    make_preset(api, "rerun-gone", steps=2, step_s=0)
    run = api.call("POST", "/api/runs", {"preset": "rerun-gone", "overrides": {"resolution": 32}})
    api.wait_run(run["id"], {"succeeded"}, timeout=60)
    api.call("DELETE", "/api/presets/rerun-gone")
    posts = _run_posts(page)

    page.goto(f"{synthetic_server}/#/new?from={run['id']}")
    page.wait_for_selector(".page-errors .error-box")
    assert "no longer exists" in page.inner_text(".page-errors")
    # Before: "default" was selected and Start sent it with the changes against the run's config.
    assert page.eval_on_selector("#preset-select", "e => e.value") == ""
    assert page.input_value("#new-preset-name") == "rerun-gone"
    page.click("#start-run")
    page.wait_for_selector(".page-errors .error-box[data-key='start run']")
    assert "save this config as a new preset" in page.inner_text(".page-errors")
    assert posts == []

    page.click("#save-preset")
    page.wait_for_function("document.querySelector('#preset-select').value === 'rerun-gone'")
    page.click("#start-run")
    page.wait_for_url("**/#/runs/*")
    again = api.call("GET", "/api/runs/" + page.url.rsplit("/", 1)[1])
    assert again["preset"] == "rerun-gone"
    assert (again["config"]["max_steps"], again["config"]["resolution"]) == (2, 32)


def test_a_preset_value_cleared_in_the_form_goes_out_as_null_and_the_default_runs(
    synthetic_server, page
):
    posts = _run_posts(page)
    api = Api(synthetic_server)
    page.goto(f"{synthetic_server}/#/new?preset=tiny-ci")
    page.wait_for_function("document.querySelector('#field-vram_high_watermark_mb').value !== ''")
    page.fill("#field-vram_high_watermark_mb", "")  # shows "default"
    page.fill("#field-max_steps", "2")
    page.click("#start-run")
    page.wait_for_url("**/#/runs/*")
    # Before: refused, "cannot remove it". Now null, which the server takes as "not set": the
    # preset's 1 is gone and the field's default runs.
    [body] = [json.loads(p) for p in posts]
    assert body["overrides"]["memory"] == {"stagehand": {"vram_high_watermark_mb": None}}
    run = api.call("GET", "/api/runs/" + page.url.rsplit("/", 1)[1])
    assert "vram_high_watermark_mb" not in run["config"]["memory"]["stagehand"]
