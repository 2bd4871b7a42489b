"""The New run page's watermark fields take MB or "auto" (the 24 GB family presets say
"auto"): a preset's "auto" is shown, a value typed over it and "auto" typed back both go into the
config, and anything else is named beside the field (real backend, Debian chromium)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.browser]


def _config(page) -> dict:
    return json.loads(page.input_value("#config-json"))


def test_watermark_fields_take_mb_or_auto(synthetic_server, page):
    page.goto(synthetic_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='flux-dev-24gb']", state="attached")
    page.select_option("#preset-select", "flux-dev-24gb")
    page.wait_for_function("document.querySelector('#field-vram_high_watermark_mb').value !== ''")
    assert page.input_value("#field-vram_high_watermark_mb") == "auto"
    assert page.input_value("#field-activation_vram_high_watermark_mb") == "auto"

    page.fill("#field-vram_high_watermark_mb", "18000")
    assert _config(page)["memory"]["stagehand"]["vram_high_watermark_mb"] == 18000
    page.fill("#field-vram_high_watermark_mb", "auto")  # before: 'expected a number, got "auto"'
    assert page.inner_text("#error-vram_high_watermark_mb") == ""
    assert _config(page)["memory"]["stagehand"]["vram_high_watermark_mb"] == "auto"

    page.fill("#field-activation_vram_low_watermark_mb", "lots")
    error = page.inner_text("#error-activation_vram_low_watermark_mb")
    assert error == 'expected a number or "auto", got "lots"'


def test_plan_says_no_limit_for_auto_without_a_budget(synthetic_server, page):
    """On a tracked (CPU) device with no Conductor cap, "auto" leaves every block on the device:
    the plan says "no limit" where it printed the 1e9 MiB that stands for it."""
    page.goto(synthetic_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.wait_for_function("document.querySelector('#field-vram_high_watermark_mb').value !== ''")
    config = _config(page)
    stagehand = config["memory"]["stagehand"]
    del stagehand["conductor_config"]  # no cap: on a CPU device nothing bounds the budget
    stagehand["vram_high_watermark_mb"] = stagehand["vram_low_watermark_mb"] = "auto"
    page.fill("#config-json", json.dumps(config))
    page.select_option("#plan-device", "cpu")
    page.click("#plan-run")
    page.wait_for_selector("#plan-auto", timeout=120_000)
    text = page.inner_text("#plan-auto")
    assert text.startswith('"auto": weight watermarks no limit'), text
    assert "1000000000" not in text
