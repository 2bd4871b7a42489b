"""The New run page sends only what it shows (synthetic worker, real backend, Debian chromium):
nothing leaves while a field is marked invalid; the model folder, data folder and sample prompts
are form fields, a folder dropping the preset's data fields and a removed key going out as null;
errors after Start say so and read as one requirement; a saved preset is confirmed, named as
saved and can be deleted."""

from __future__ import annotations

import json
import re

import pytest

from tests.fixtures.images import captioned_images
from tests.frontend.conftest import Api, picture, start_refused

pytestmark = [pytest.mark.browser]

PROMPTS = ["a watercolour fox", "a red boat at dawn"]
SENDS = ("start-run", "scan-data", "plan-run", "tune-run", "save-preset")
"""The buttons that send the config to the server."""


def _posts(page) -> list[tuple[str, dict]]:
    """``(path, body)`` of every POST the page makes to the API, in order."""
    posts: list[tuple[str, dict]] = []

    def seen(request) -> None:
        if request.method == "POST" and "/api/" in request.url:
            path = "/api/" + request.url.split("/api/", 1)[1]
            posts.append((path, json.loads(request.post_data or "null")))

    page.on("request", seen)
    return posts


def _open(page, base: str, preset: str = "default") -> None:
    page.goto(f"{base}/#/new?preset={preset}")
    page.wait_for_function(
        f"document.getElementById('preset-select').value === {json.dumps(preset)}"
        " && document.getElementById('field-max_steps').value !== ''"
    )


def _config(page) -> dict:
    return json.loads(page.input_value("#config-json"))


def test_nothing_is_sent_while_a_field_is_marked_invalid(synthetic_server, page):
    posts = _posts(page)
    _open(page, synthetic_server)
    page.fill("#field-vram_high_watermark_mb", "lots")
    assert page.inner_text("#error-vram_high_watermark_mb") == (
        'expected a number or "auto", got "lots"'
    )
    # Before: Start was live and ran the preset's 40; Plan said "fits" at 40.
    assert [page.is_disabled(f"#{b}") for b in SENDS] == [True] * len(SENDS)
    note = page.inner_text("#blocked-note")
    assert note.startswith("Start, Check data, Plan, Tune and Save wait.")
    assert "VRAM high watermark (MB or auto)" in note
    picture(page.locator("#page"), "new-run-invalid-field")
    page.keyboard.press("Enter")
    assert posts == []

    # JSON that does not parse holds them back the same way.
    page.fill("#field-vram_high_watermark_mb", "50")
    assert not page.is_disabled("#start-run") and page.is_hidden("#blocked-note")
    text = page.input_value("#config-json")
    page.fill("#config-json", text[:-2])
    assert page.is_disabled("#start-run") and page.is_disabled("#plan-run")
    assert "Full config (JSON)" in page.inner_text("#blocked-note")
    page.fill("#config-json", text)
    assert not page.is_disabled("#plan-run")

    # Once valid, what is sent is what is shown.
    page.click("#scan-data")
    page.wait_for_selector("#data-scan:not([hidden])")
    # (The page's own field check, 350 ms after the last change, may go out too: it asks about
    # the same request.)
    checks = [b for path, b in posts if path == "/api/runs/check"]
    [(path, body)] = [(path, b) for path, b in posts if path != "/api/runs/check"]
    assert path == "/api/data/scan"
    assert body["overrides"] == {"memory": {"stagehand": {"vram_high_watermark_mb": 50}}}
    assert all(b["overrides"] == body["overrides"] for b in checks)


def test_my_folders_and_prompts_are_form_fields_and_drop_the_presets_data(
    synthetic_server, page, tmp_path
):
    api = Api(synthetic_server)
    images = captioned_images(tmp_path / "photos", count=4)
    model = tmp_path / "my-model"  # the synthetic worker loads no model: any folder
    model.mkdir()
    posts = _posts(page)
    _open(page, synthetic_server)
    assert page.input_value("#field-prompts").splitlines()[0] == "a handwritten digit zero"

    page.fill("#field-model", str(model))
    page.fill("#field-data", str(images))
    config = _config(page)
    assert config["data"] == {"path": str(images)}  # no factory, limit 512 or 16 tokens
    assert config["model"] == {
        "path": str(model),
        "dtype": "float32",
        "text_encoder_model_name": "minilm",
    }
    assert "prompts" not in config["samples"] and page.input_value("#field-prompts") == ""
    page.fill("#field-prompts", "\n".join(PROMPTS) + "\n")
    page.fill("#field-max_steps", "2")
    page.fill("#run-name", "fox on my photos")
    assert _config(page)["samples"]["prompts"] == PROMPTS
    picture(page.locator("#run-form"), "new-run-own-folders")
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))

    run = api.call("GET", "/api/runs/" + page.url.rsplit("/", 1)[1])
    assert run["config"]["data"] == {"path": str(images)}
    assert run["config"]["samples"]["prompts"] == PROMPTS
    [body] = [b for path, b in posts if path == "/api/runs"]
    assert body["overrides"]["data"] == {
        "path": str(images),
        "factory": None,
        "limit": None,
        "max_caption_tokens": None,
    }
    api.wait_run(run["id"], {"succeeded"}, timeout=120)

    # The runs list: the name typed, then the preset with the run's own folders under it.
    page.goto(f"{synthetic_server}/#/runs")
    row = page.wait_for_selector(f"tr[data-run-id='{run['id']}']")
    assert row.query_selector("td.name a").inner_text() == "fox on my photos"
    preset = row.query_selector("td[data-label='preset']").inner_text()
    assert preset.splitlines() == ["default", "model my-model · data photos"]
    picture(row, "runs-list-own-folders")

    # Clearing the data folder puts the preset's digits back, prompts as typed.
    _open(page, synthetic_server)
    page.fill("#field-data", str(images))
    page.fill("#field-data", "")
    assert _config(page)["data"] == {"factory": "digits", "limit": 512, "max_caption_tokens": 16}


def test_keys_removed_by_hand_go_out_as_null_and_conflicts_come_back_together(
    synthetic_server, page, tmp_path
):
    images = captioned_images(tmp_path / "photos", count=2)
    posts = _posts(page)
    # The steps: "data": {"path": DIR} on default was refused three times in a row.
    _open(page, synthetic_server)
    config = _config(page)
    config["data"] = {"path": str(images)}
    page.fill("#config-json", json.dumps(config, indent=2))
    page.click("#scan-data")
    page.wait_for_selector("#data-scan:not([hidden])")
    assert page.query_selector(".page-errors .error-box") is None
    assert "2 samples" in page.inner_text("#data-scan")

    # wan21's frames, removed by hand: null, which the server takes as "not set".
    model = tmp_path / "wan"
    model.mkdir()
    _open(page, synthetic_server, "wan21-14b-24gb")
    page.fill("#field-model", str(model))
    page.fill("#field-data", str(images))
    config = _config(page)
    del config["data"]["frames"]
    page.fill("#config-json", json.dumps(config, indent=2))
    page.click("#scan-data")
    page.wait_for_selector("#data-scan:not([hidden])")
    scans = [b for path, b in posts if path == "/api/data/scan"]
    assert scans[-1]["overrides"]["data"]["frames"] is None
    assert page.query_selector(".page-errors .error-box") is None

    # Two rules broken: both named at once, each at its field.
    _open(page, synthetic_server)
    config = _config(page)
    config.update(lora_rank=8, lora_alpha=4)
    box = start_refused(page, lambda: page.fill("#config-json", json.dumps(config, indent=2)))
    items = [li.inner_text() for li in box.query_selector_all("li")]
    assert [i.split(":")[0] for i in items] == ["overrides.lora_rank", "overrides.lora_alpha"]
    assert all("disagree: set one (null removes the other)" in i for i in items)
    picture(page.locator("#page"), "new-run-two-conflicts")


def test_an_error_after_start_is_the_starts_and_names_what_the_field_takes(synthetic_server, page):
    _open(page, synthetic_server, "tiny-ci")
    box = start_refused(page, lambda: page.fill("#field-vram_high_watermark_mb", "-1"))
    # Before: "check data: ... found -1, expected greater than or equal to 0" and a list with
    # "found -1, expected 'auto'" under it.
    assert box.get_attribute("data-key") == "start run"
    assert box.query_selector("ul") is None
    assert (
        box.inner_text()
        .removeprefix("×\n")
        .startswith(
            "start run: overrides.memory.stagehand.vram_high_watermark_mb is -1; "
            "expected greater than or equal to 0, or 'auto'"
        )
    )
    picture(page.locator("#page"), "new-run-start-error")


def test_a_saved_preset_is_confirmed_named_as_saved_and_can_be_deleted(synthetic_server, page):
    api = Api(synthetic_server)
    _open(page, synthetic_server)
    assert page.is_hidden("#delete-preset")  # a built-in preset
    page.fill("#field-max_steps", "12")
    page.fill("#new-preset-name", "my-digits")
    page.click("#save-preset")
    page.wait_for_selector("#preset-note:not([hidden])")
    assert (
        page.inner_text("#preset-note")
        == 'Saved preset "my-digits"; it is selected. Runs started now use it.'
    )
    assert page.eval_on_selector("#preset-select", "e => e.value") == "my-digits"
    saved = api.call("GET", "/api/presets/my-digits")
    assert saved["config"]["name"] == "my-digits" and saved["config"]["max_steps"] == 12
    assert (
        saved["description"]
        == saved["config"]["description"]
        == ('From preset "default", with changes to max_steps.')
    )
    picture(page.locator("#preset-note").locator(".."), "new-run-preset-saved")

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete-preset")
    page.wait_for_function(
        "document.getElementById('preset-note').textContent.startsWith('Deleted')"
    )
    assert page.eval_on_selector("#preset-select", "e => e.value") == "default"
    names = [p["name"] for p in api.call("GET", "/api/presets")["data"]]
    assert "my-digits" not in names
