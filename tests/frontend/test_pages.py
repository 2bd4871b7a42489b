"""Issue 17's pages in a real browser (synthetic worker, real backend, Debian chromium): the API
docs with the network blocked, the charts' window, smoothing, log scale and CSV export, the
Runs list's sorting and search, Compare across runs of different lengths, error banners."""

from __future__ import annotations

import copy
import shutil

import pytest

from tests.frontend.conftest import DESKTOP, SHOTS, Api

pytestmark = [pytest.mark.browser]
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


def make_preset(api: Api, name: str, steps: int, step_s: float = 0) -> None:
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, max_steps=steps, description=f"synthetic step_s={step_s}")
    api.call("POST", "/api/presets", {"name": name, "config": config})


def offline_page(browser, base: str):
    """A desktop page whose every request to anything but ``base`` is aborted (and listed)."""
    context = browser.new_context(viewport=DESKTOP)
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    return context, context.new_page(), blocked


def test_api_docs_render_with_the_network_blocked(synthetic_server, browser, tmp_path):
    context, pg, blocked = offline_page(browser, synthetic_server)
    try:
        pg.goto(synthetic_server + "/docs")
        # Swagger UI drew the operations from /openapi.json: its script and styles came from here.
        pg.wait_for_selector(".swagger-ui .opblock-summary-path", timeout=20_000)
        paths = pg.eval_on_selector_all(
            ".opblock-summary-path", "els => els.map(e => e.getAttribute('data-path'))"
        )
        assert "/api/runs" in paths and "/api/compare" in paths
        assert (
            pg.evaluate(
                "getComputedStyle(document.querySelector('.swagger-ui .opblock')).borderRadius"
            )
            != ""
        )
        pg.screenshot(path=str(tmp_path / "docs-offline-desktop.png"), full_page=False)

        pg.goto(synthetic_server + "/redoc")
        pg.wait_for_selector("redoc .api-content h1", timeout=20_000)
        assert pg.inner_text("redoc .api-content h1").startswith("Stagehand Workbench")
        assert pg.eval_on_selector_all("redoc [data-section-id]", "els => els.length") > 10
        # ReDoc's sidebar asks its CDN for the Redocly logo and drops the image when that fails
        # (its onError): the one request allowed to go unanswered, and nothing broken shown.
        pg.wait_for_function("!document.querySelector(\"redoc img[alt='redocly logo']\")")
        pg.screenshot(path=str(tmp_path / "redoc-offline-desktop.png"), full_page=False)
        assert set(blocked) <= {REDOC_LOGO}, f"the docs pages asked the network for {blocked}"
    finally:
        context.close()
    SHOTS.mkdir(parents=True, exist_ok=True)
    for name in ("docs-offline-desktop.png", "redoc-offline-desktop.png"):
        shutil.copy(tmp_path / name, SHOTS / name)
