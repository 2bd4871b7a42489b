"""The New run page's errors as a newcomer met them (issue 56, items 2 and 9; synthetic worker,
real backend, Debian chromium): every field the server would refuse shows its error as it is
typed or left, all at once, with Start, Check data, Plan, Tune and Save held back; a Plan's 422
goes beside the field it names; a folder put in by "Use this folder" loses the old folder's
error at once, not when the server next answers."""

from __future__ import annotations

import json

import pytest

from tests.frontend.conftest import PHONE, picture

pytestmark = [pytest.mark.browser]

SENDS = ("start-run", "scan-data", "plan-run", "tune-run", "save-preset")
LOW_ABOVE_HIGH = "vram_low_watermark_mb (30.0) must not be above vram_high_watermark_mb (10.0)"


def _open(page, base: str, preset: str = "default") -> None:
    page.goto(f"{base}/#/new?preset={preset}")
    page.wait_for_function(
        f"document.getElementById('preset-select').value === {json.dumps(preset)}"
        " && document.getElementById('field-max_steps').value !== ''"
    )


def _error(page, field: str) -> str:
    return page.inner_text(f"#error-{field}")


def _wait_error(page, field: str, text: str) -> None:
    page.wait_for_function(
        f"document.getElementById('error-{field}').textContent === {json.dumps(text)}"
    )


def _run_posts(page) -> list[str]:
    """Paths of the POSTs that would start or scan a run (not the checks)."""
    posts: list[str] = []
    page.on(
        "request",
        lambda r: (
            posts.append(r.url.split("/api/", 1)[1])
            if r.method == "POST" and r.url.split("/api/", 1)[-1] in ("runs", "data/scan")
            else None
        ),
    )
    return posts


def test_every_error_shows_as_typed_all_at_once_and_holds_the_buttons(
    synthetic_server, page, tmp_path
):
    missing = str(tmp_path / "does-not-exist")
    posts = _run_posts(page)
    _open(page, synthetic_server)
    page.fill("#field-max_steps", "-5")
    _wait_error(page, "max_steps", "found -5, expected greater than 0")
    page.fill("#field-vram_high_watermark_mb", "10")
    _wait_error(page, "vram_low_watermark_mb", LOW_ABOVE_HIGH)
    page.fill("#field-data", missing)
    assert _error(page, "data") == ""  # a folder half typed is not checked
    page.press("#field-data", "Tab")
    _wait_error(page, "data", f"found '{missing}' (nothing), expected an existing folder")
    # Before: no error at all until Start; the first Start showed the step and watermark
    # errors, the folder's only at the second; Start stayed enabled throughout.
    assert _error(page, "max_steps") == "found -5, expected greater than 0"
    assert _error(page, "vram_low_watermark_mb") == LOW_ABOVE_HIGH
    assert [page.is_disabled(f"#{b}") for b in SENDS] == [True] * len(SENDS)
    note = page.inner_text("#blocked-note")
    assert note.startswith("Start, Check data, Plan, Tune and Save wait. Fix Data folder")
    for label in ("Steps", "VRAM low watermark (MB or auto)"):
        assert label in note
    assert posts == []
    picture(page, "new-run-errors-at-once-desktop", full_page=True)
    page.set_viewport_size(PHONE)
    picture(page, "new-run-errors-at-once-phone", full_page=True)

    # Fixed one by one: each error goes with its fix, the buttons come back with the last.
    page.fill("#field-max_steps", "3")
    page.fill("#field-vram_high_watermark_mb", "50")
    page.wait_for_function(
        "document.getElementById('error-vram_low_watermark_mb').textContent === ''"
    )
    assert page.is_disabled("#start-run")  # the folder still
    page.fill("#field-data", "")
    page.press("#field-data", "Tab")
    page.wait_for_function("!document.getElementById('start-run').disabled")
    assert [_error(page, f) for f in ("max_steps", "vram_low_watermark_mb", "data")] == [""] * 3
    assert [page.is_disabled(f"#{b}") for b in SENDS] == [False] * len(SENDS)


def test_a_plans_422_goes_beside_the_field_it_names(synthetic_server, page):
    _open(page, synthetic_server)
    held = []  # the page's checks, held: Plan gets to the server first
    page.route("**/api/runs/check", lambda route: held.append(route))
    page.select_option("#plan-device", "rtx3090")
    page.fill("#field-vram_high_watermark_mb", "10")
    page.click("#plan-run")
    _wait_error(page, "vram_low_watermark_mb", LOW_ABOVE_HIGH)
    # Before: "plan: preset.memory.stagehand.vram_low_watermark_mb: ..." in a box above Start.
    assert page.inner_text("#plan-errors") == ""
    assert page.query_selector(".page-errors .error-box") is None
    picture(page.locator("#run-form"), "new-run-plan-error-at-field")
    for route in held:
        route.continue_()


def test_use_this_folder_takes_the_old_folders_error_away_at_once(
    synthetic_server, page, tmp_path, asset_cache
):
    from tests.fixtures.pipelines import build_pipeline

    flux = build_pipeline("flux", asset_cache)  # built once a session
    missing = str(tmp_path / "does-not-exist")
    _open(page, synthetic_server, "tiny-ci")
    page.fill("#field-model", missing)
    page.click("#start-run")
    _wait_error(page, "model", f"found '{missing}' (nothing), expected an existing folder")
    page.fill("#pipeline-path", str(flux))
    page.click("#inspect-pipeline")
    page.wait_for_selector("#pipeline-found", timeout=120_000)  # seconds on a busy CPU
    held = []  # the check of the new folder, held: the old error must go before any answer
    page.route("**/api/runs/check", lambda route: held.append(route))
    asked = []
    page.on("request", lambda r: asked.append(r.url) if r.url.endswith("/api/runs/check") else None)
    page.click("#use-pipeline")
    assert page.input_value("#field-model") == str(flux)
    # Before: "found '.../does-not-exist' (nothing), ..." stayed under the new folder.
    assert _error(page, "model") == ""
    assert "invalid" not in (page.get_attribute("#field-model", "class") or "")
    if not asked:  # the new folder is checked at once (its answer held above)
        page.wait_for_event("request", lambda r: r.url.endswith("/api/runs/check"), timeout=5000)
    picture(page.locator("#run-form"), "new-run-used-folder-desktop")
    for route in held:
        route.continue_()
    page.wait_for_function("!document.getElementById('start-run').disabled")
    assert _error(page, "model") == ""
    page.set_viewport_size(PHONE)
    picture(page.locator("#run-form"), "new-run-used-folder-phone")
