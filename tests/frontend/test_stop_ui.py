"""Stop asks before it stops a run, as Delete does: dismissed, the run goes on; accepted, it is
cancelled (synthetic worker, real backend, Debian chromium)."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import Api, picture
from tests.frontend.test_charts_synthetic import make_preset

pytestmark = [pytest.mark.browser]


def test_stop_asks_for_confirmation(synthetic_server, page):
    api = Api(synthetic_server)
    # Stopped below; 200 steps (a minute) ended first on a loaded machine.
    make_preset(api, "stop-confirm", steps=2000, step_s=0.3)
    run = api.call("POST", "/api/runs", {"preset": "stop-confirm", "name": "stop me"})
    page.goto(f"{synthetic_server}/#/runs/{run['id']}")
    page.wait_for_selector(".run-header .badge[data-status='running']", timeout=60_000)
    asked: list[str] = []

    def answer(accept: bool):
        def on_dialog(dialog):
            asked.append(dialog.message)
            dialog.accept() if accept else dialog.dismiss()

        return on_dialog

    page.once("dialog", answer(False))
    page.click("#cancel-run")
    page.wait_for_timeout(1000)
    assert asked == [
        f'Stop run {run["id"]} "stop me"? It finishes its current step and saves its LoRA.'
    ]
    assert api.call("GET", f"/api/runs/{run['id']}")["status"] == "running"
    picture(page, "run-stop-confirm", full_page=False)
    # A run with sample prompts draws its final samples on a stop (the worker's own).
    page.evaluate("window.__runView.run.config.samples = {prompts: ['a digit']}")
    page.once("dialog", answer(True))
    page.click("#cancel-run")
    assert api.wait_run(run["id"], {"cancelled"}, timeout=60)["status"] == "cancelled"
    assert asked[1] == (
        f'Stop run {run["id"]} "stop me"? It finishes its current step, saves its LoRA and '
        "draws its final samples."
    )
