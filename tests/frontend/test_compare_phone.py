"""Compare of five runs at phone width (390 px): the config diff's values keep a readable width
and the table scrolls sideways inside its card, instead of one letter a line (synthetic worker,
real backend, Debian chromium)."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import PHONE, Api, picture
from tests.frontend.test_hardening import make_preset

pytestmark = [pytest.mark.browser]


def test_config_diff_of_five_runs_is_readable_at_phone_width(synthetic_server, open_page):
    api = Api(synthetic_server)
    make_preset(api, "phone-diff", steps=2, step_s=0)
    text = "a long description of this run, with words enough to wrap over lines "
    ids = [
        api.call(
            "POST",
            "/api/runs",
            {"preset": "phone-diff", "overrides": {"description": f"{text}{i}"}},
        )["id"]
        for i in range(5)
    ]
    page = open_page(PHONE)
    page.goto(f"{synthetic_server}/#/compare?ids={','.join(map(str, ids))}")
    page.wait_for_selector("#config-diff tr[data-path='description']")
    widths = page.eval_on_selector_all(
        "#config-diff tr[data-path='description'] td:not(.path)",
        "cells => cells.map(c => c.getBoundingClientRect().width)",
    )
    assert len(widths) == 5 and min(widths) >= 80, widths  # before: 47 px, a word cut a line
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    picture(page, "compare-five-runs-phone", full_page=True)
