"""The dashboard's pages in a real browser (synthetic worker, real backend, Debian chromium): the API
docs with the network blocked, the charts' window, smoothing, log scale and CSV export, the
Runs list's sorting and search, Compare across runs of different lengths, error banners."""

from __future__ import annotations

import copy
import csv
import re

import pytest

from tests.frontend.conftest import DESKTOP, Api, picture, start_refused

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


def test_api_docs_render_with_the_network_blocked(synthetic_server, browser):
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
        picture(pg, "docs-offline-desktop", full_page=False)

        pg.goto(synthetic_server + "/redoc")
        pg.wait_for_selector("redoc .api-content h1", timeout=20_000)
        assert pg.inner_text("redoc .api-content h1").startswith("Stagehand Workbench")
        assert pg.eval_on_selector_all("redoc [data-section-id]", "els => els.length") > 10
        # ReDoc's sidebar asks its CDN for the Redocly logo and drops the image when that fails
        # (its onError): the one request allowed to go unanswered, and nothing broken shown.
        pg.wait_for_function("!document.querySelector(\"redoc img[alt='redocly logo']\")")
        picture(pg, "redoc-offline-desktop", full_page=False)
        assert set(blocked) <= {REDOC_LOGO}, f"the docs pages asked the network for {blocked}"
    finally:
        context.close()


def ema(values: list[float], w: float) -> list[float]:
    out, s = [], None
    for v in values:
        s = v if s is None else w * s + (1 - w) * v
        out.append(s)
    return out


def read_csv(download) -> list[list[str]]:
    with open(download.path(), newline="") as f:
        return list(csv.reader(f))


def test_run_charts_window_linked_axes_smoothing_log_and_csv(synthetic_server, page, tmp_path):
    api = Api(synthetic_server)
    make_preset(api, "synth-window", steps=30)
    run = api.call("POST", "/api/runs", {"preset": "synth-window", "name": "window"})
    api.wait_run(run["id"], {"succeeded"}, timeout=60)
    records = api.call("GET", f"/api/runs/{run['id']}/telemetry?limit=5000")["data"]
    steps = [r for r in records if (r["source"], r["kind"]) == ("trainer", "step")]
    steps = [r for r in steps if not r.get("sampling")]
    assert [r["step"] for r in steps] == list(range(1, 31))
    t0 = records[0]["time"]
    page.goto(synthetic_server + f"/#/runs/{run['id']}")
    page.wait_for_selector("#charts[data-all-drawn-ms]", state="attached", timeout=30_000)

    # The last 10 steps: step charts show steps 21-30, the time charts from the end of step 20.
    page.fill("#chart-window", "10")
    page.press("#chart-window", "Enter")
    page.evaluate("window.__runView.charts.flush()")
    ranges = page.evaluate(
        "Object.fromEntries(['loss', 'phases', 'vram', 'residency'].map((id) =>"
        " [id, Array.from(document.getElementById(id).layout.xaxis.range)]))"
    )
    assert ranges["loss"] == ranges["phases"] == [20.5, 30.5]
    shown = page.evaluate(
        "(() => { const t = document.getElementById('loss').data[0];"
        " const [lo, hi] = document.getElementById('loss').layout.xaxis.range;"
        " return Array.from(t.x).filter((x) => x >= lo && x <= hi); })()"
    )
    assert shown == list(range(21, 31))
    end_of_20 = round((steps[19]["time"] - t0) * 1000) / 1000
    # The newest record the time charts follow (runcharts.js ingest's tLast): the weight
    # stream's block and step records and the trainer's steps, not a sampling step's. The
    # Conductor's and the activation spill's step records, written just after, are not among
    # them (on a loaded machine, milliseconds later).
    followed = {("stagehand", "block"), ("stagehand", "step"), ("trainer", "step")}
    drawn = [r for r in records if (r["source"], r["kind"]) in followed]
    last_drawn = max(r["time"] for r in drawn if not (r["kind"] == "step" and r.get("sampling")))
    assert ranges["vram"] == pytest.approx([end_of_20, round((last_drawn - t0) * 1000) / 1000])
    assert ranges["residency"] == ranges["vram"]

    box = page.locator("#vram .nsewdrag").first.bounding_box()
    y = box["y"] + box["height"] / 2
    # Pixels of the VRAM points in the window, at 30%, 45% and 60% of them (a step_s=0 run
    # has gaps of no records: the mouse goes where there are some).
    px = page.evaluate(
        "(() => { const d = document.getElementById('vram'); const xa = d._fullLayout.xaxis;"
        " const [lo, hi] = xa.range; const xs = Array.from(d.data[0].x).filter((x) => x >= lo && x <= hi);"
        " return [0.3, 0.45, 0.6].map((f) => xa.l2p(xs[Math.floor(f * xs.length)])); })()"
    )
    # Hover: the figure in MB, the block and the event of the record under the mouse.
    page.mouse.move(box["x"] + px[1] - 3, y)
    page.mouse.move(box["x"] + px[1], y, steps=3)
    page.wait_for_selector("#vram .hoverlayer text", state="attached")
    hover = page.eval_on_selector("#vram .hoverlayer", "h => h.textContent")
    assert re.search(r"\d MB", hover) and "(block " in hover and "event: " in hover, hover

    # Dragging a zoom on the VRAM chart moves the residency map with it; a double-click goes
    # back to the window on both.
    page.mouse.move(box["x"] + px[0], y)
    page.mouse.down()
    page.mouse.move(box["x"] + px[2], y, steps=5)
    page.mouse.up()
    zoomed = page.evaluate("Array.from(document.getElementById('vram').layout.xaxis.range)")
    assert ranges["vram"][0] < zoomed[0] < zoomed[1] < ranges["vram"][1]
    page.wait_for_function(
        "JSON.stringify(Array.from(document.getElementById('residency').layout.xaxis.range))"
        f" === JSON.stringify({zoomed})"
    )
    page.mouse.dblclick(box["x"] + px[1], y)
    page.wait_for_function(
        "document.getElementById('residency').layout.xaxis.range[0]"
        f" === {ranges['vram'][0]} && document.getElementById('vram').layout.xaxis.range[0]"
        f" === {ranges['vram'][0]}"
    )

    # Smoothing 0.5: the EMA line is the losses' EMA with that weight; log y on the loss chart.
    page.evaluate(
        "(() => { const s = document.getElementById('loss-ema'); s.value = '0.5';"
        " s.dispatchEvent(new Event('input')); })()"
    )
    page.evaluate("window.__runView.charts.flush()")
    smooth = page.evaluate("document.getElementById('loss').data[1]")
    losses = [r["loss"] for r in steps]
    assert smooth["name"] == "loss (EMA 0.5)"
    assert smooth["y"] == pytest.approx(ema(losses, 0.5), rel=1e-12)
    page.check("#loss-log")
    page.wait_for_function("document.getElementById('loss').layout.yaxis.type === 'log'")

    # CSV: one row per step, the losses exactly as the API gave them.
    with page.expect_download() as dl:
        page.click("#loss-csv")
    assert dl.value.suggested_filename == f"run-{run['id']}-loss.csv"
    rows = read_csv(dl.value)
    assert rows[0] == ["step", "loss", "loss (EMA 0.5)", "grad norm"]
    assert [int(r[0]) for r in rows[1:]] == list(range(1, 31))
    assert [float(r[1]) for r in rows[1:]] == losses
    assert [float(r[3]) for r in rows[1:]] == [r["grad_norm"] for r in steps]
    with page.expect_download() as dl:
        page.click("#residency-csv")
    rows = read_csv(dl.value)
    assert rows[0][:2] == ["time (s)", "block"]
    assert {int(r[1]) for r in rows[1:]} == set(range(12))
    page.mouse.move(0, 0)
    picture(page, "run-window-desktop", full_page=True)


@pytest.fixture(scope="module")
def three_runs(synthetic_server) -> dict[str, int]:
    """Finished runs of 8 ("sortme-a", a long name, notes, 8 tags), 5 ("sortme-b") and 3 steps
    ("sortme-c", tagged Sweep-42, a long config path changed) for the Runs list and Compare."""
    api = Api(synthetic_server)
    make_preset(api, "synth-list", steps=8)
    spill = {"memory": {"stagehand": {"activation_stagehand": {"min_spill_bytes": 2048}}}}
    ids = {}
    for name, overrides in (
        ("sortme-b", {"max_steps": 5}),
        ("sortme-a", {"max_steps": 8}),
        ("sortme-c", {"max_steps": 3, **spill}),
    ):
        ids[name] = api.call(
            "POST", "/api/runs", {"preset": "synth-list", "name": name, "overrides": overrides}
        )["id"]
    api.call("PATCH", f"/api/runs/{ids['sortme-c']}", {"tags": ["Sweep-42", "x"]})
    # A long name, notes and many tags must still fit 1440 px.
    long_name = "sortme-a-flux-dev-lora-sweep-high-watermark-28-low-20-spill-on-prefetch-4"
    api.call(
        "PATCH",
        f"/api/runs/{ids['sortme-a']}",
        {"name": long_name, "notes": "n " * 200, "tags": [f"tag-{i}" for i in range(8)]},
    )
    for run_id in ids.values():
        api.wait_run(run_id, {"succeeded"}, timeout=60)
    return ids


def test_runs_list_sorts_searches_keeps_filters_in_the_url(synthetic_server, three_runs, page):
    api = Api(synthetic_server)
    ids = three_runs
    total = api.call("GET", "/api/runs")["count"]
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(synthetic_server + "/#/runs")
    page.wait_for_selector(f"tr[data-run-id='{ids['sortme-c']}']")

    # Substring search over names and tags, any case; kept in the URL.
    page.fill("#filter-tag", "ortme")
    rows = "Array.from(document.querySelectorAll('#runs-body tr[data-run-id]')).map(r => +r.dataset.runId)"
    page.wait_for_function(
        f"document.getElementById('runs-count').textContent === '3 of {total} runs'"
    )
    assert len(page.evaluate(rows)) == 3
    page.fill("#filter-tag", "sweep-4")
    page.wait_for_function(f"{rows}.join() === '{ids['sortme-c']}'")
    assert "q=sweep-4" in page.url

    # Sort by final loss, then reversed: the order of the runs' real final losses.
    page.fill("#filter-tag", "sortme")
    page.wait_for_function(f"{rows}.length === 3 && location.hash.endsWith('q=sortme')")
    losses = {i: api.call("GET", f"/api/runs/{i}")["summary"]["final_loss"] for i in ids.values()}
    ascending = sorted(ids.values(), key=losses.get)
    assert len(set(losses.values())) == 3
    page.click("th[data-sort='loss'] button")
    assert page.evaluate(rows) == ascending
    assert page.get_attribute("th[data-sort='loss']", "aria-sort") == "ascending"
    page.click("th[data-sort='loss'] button")
    assert page.evaluate(rows) == ascending[::-1]
    page.click("th[data-sort='steps'] button")
    assert page.evaluate(rows) == [ids["sortme-c"], ids["sortme-b"], ids["sortme-a"]]
    assert page.url.endswith("#/runs?q=sortme&sort=steps&dir=asc")

    # No horizontal overflow at 1440 px, the table included.
    widths = page.evaluate(
        "[document.documentElement.scrollWidth, document.querySelector('.table-wrap').scrollWidth,"
        " document.querySelector('.table-wrap').clientWidth]"
    )
    assert widths[0] <= 1440 and widths[1] <= widths[2], widths

    # The URL alone gives the same rows in the same order (a reload, a shared link).
    url = page.url
    page.goto(synthetic_server + "/#/new")
    page.goto(url)
    page.wait_for_function(f"{rows}.length === 3")
    assert page.evaluate(rows) == [ids["sortme-c"], ids["sortme-b"], ids["sortme-a"]]
    assert page.input_value("#filter-tag") == "sortme"

    # Filters that hide every run say so, with the total, and clear in one click.
    page.select_option("#filter-status", "failed")
    page.wait_for_selector("#runs-empty:not([hidden])")
    assert page.inner_text("#runs-empty").startswith(f"0 of {total} runs match these filters")
    assert page.inner_text("#runs-count") == f"0 of {total} runs"
    page.click("#clear-filters")
    page.wait_for_function(f"{rows}.length === {total}")
    assert page.url.endswith("#/runs?sort=steps&dir=asc")
    picture(page, "runs-1440-desktop", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    picture(page, "runs-phone", full_page=True)


def test_compare_lengths_deltas_missing_id_add_remove_and_path_wrap(
    synthetic_server, three_runs, page
):
    api = Api(synthetic_server)
    ids = {"long": three_runs["sortme-a"], "short": three_runs["sortme-c"]}
    ids["third"] = three_runs["sortme-b"]
    a, b, c = ids["long"], ids["short"], ids["third"]
    gone = 4_000_000  # never created
    cmp = api.call("GET", f"/api/compare?ids={a},{b},{gone}&metrics=loss")
    assert cmp["missing"] == [gone] and [r["id"] for r in cmp["runs"]] == [a, b]

    # A missing id: the others are compared, and a notice names it.
    page.goto(synthetic_server + f"/#/compare?ids={a},{b},{gone}")
    page.wait_for_selector("#config-diff tr[data-path]")
    assert page.inner_text("#compare-missing").startswith(f"No run with id #{gone} (deleted?)")
    charts = ("cmp-vram", "cmp-step", "cmp-loss", "cmp-spill")
    for chart in charts:
        assert page.evaluate(f"document.getElementById('{chart}').data.length") == 2

    # Runs of 8 and 3 steps share steps 1-8 on every chart; zooming one moves them all.
    ranges = page.evaluate(
        f"{list(charts)}.map((id) => Array.from(document.getElementById(id).layout.xaxis.range))"
    )
    assert ranges == [[1, 8]] * 4
    assert page.evaluate("Array.from(document.getElementById('cmp-loss').data[1].x)") == [1, 2, 3]
    picture(page, "compare-lengths-desktop", full_page=True)
    page.evaluate("Plotly.relayout('cmp-loss', {'xaxis.range': [2, 5]})")
    page.wait_for_function(
        f"{list(charts)}.every((id) => document.getElementById(id).layout.xaxis.range[1] === 5)"
    )

    # Summary: changes against the first run, and the loss at the last step both reached.
    losses = {i: [p[1] for p in cmp["series"]["loss"][str(i)]] for i in (a, b)}
    pct = 100 * (losses[b][-1] - losses[a][-1]) / abs(losses[a][-1])
    cell = page.inner_text(f"#compare-summary tr[data-run-id='{b}'] td[data-figure='final_loss']")
    assert cell.endswith(f"({'+' if pct >= 0 else '−'}{abs(pct):.1f}%)"), cell
    assert losses[a][2] == losses[b][2]  # the synthetic loss depends on the step alone
    at3 = page.inner_text(f"#compare-summary tr[data-run-id='{b}'] td[data-figure='loss_at']")
    assert at3.endswith("(+0.0%)"), at3
    assert "loss at step 3" in page.text_content("#compare-summary thead")
    assert page.query_selector(f"#compare-summary tr[data-run-id='{a}'] .delta") is None

    # Add a run from the page, then remove one: the ids in the URL follow.
    page.select_option("#compare-add", str(c))
    page.wait_for_url(f"**/#/compare?ids={a},{b},{c}")
    page.wait_for_function("document.getElementById('cmp-loss')?.data?.length === 3")
    page.click(f".run-chip[data-run-id='{b}'] .remove-run")
    page.wait_for_url(f"**/#/compare?ids={a},{c}")
    page.wait_for_function("document.getElementById('cmp-loss')?.data?.length === 2")

    # A long config path wraps between its segments on a phone, never inside a name.
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(synthetic_server + f"/#/compare?ids={a},{b}")
    path = "memory.stagehand.activation_stagehand.min_spill_bytes"
    segs = page.wait_for_selector(f"#config-diff tr[data-path='{path}'] .diff-path")
    lines = segs.evaluate(
        "code => Array.from(code.querySelectorAll('.seg')).map((s) =>"
        " [s.textContent, s.getClientRects().length, Math.round(s.getBoundingClientRect().top)])"
    )
    assert "".join(t for t, _, _ in lines) == path
    assert all(n == 1 for _, n, _ in lines), lines
    assert len({top for _, _, top in lines}) > 1, lines  # it did wrap
    picture(page, "compare-lengths-phone", full_page=True)


def test_error_banners_are_sentences_and_clear_when_fixed(synthetic_server, page):
    # A refused field: the banner is a sentence naming it, and goes once the field is fixed.
    page.goto(synthetic_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    box = start_refused(page, lambda: page.fill("#field-max_steps", "0"))
    text = box.inner_text().removeprefix("×").strip()
    # Labelled with what the user asked for: Start (its data scan is part of it).
    assert re.search(
        r"^start run: overrides\.max_steps is 0; expected greater than 0\. \(HTTP 422, \w+\)$",
        text,
    ), text
    assert box.get_attribute("data-fields") == "max_steps"
    picture(page, "new-run-error-desktop")
    page.fill("#field-max_steps", "4")
    page.wait_for_selector(".page-errors .error-box", state="detached")
    assert page.inner_text("#error-max_steps") == ""

    # The runs list while the backend refuses: one banner (not one per poll), gone when the
    # list loads again.
    page.route("**/api/runs", lambda r: r.fulfill(status=503, body="down for maintenance"))
    page.goto(synthetic_server + "/#/runs")
    box = page.wait_for_selector(".page-errors .error-box[data-key='loading runs']")
    assert "Down for maintenance. (HTTP 503, http_503)" in box.inner_text()
    picture(page, "runs-error-desktop")
    page.unroute("**/api/runs")
    page.wait_for_selector(".page-errors .error-box", state="detached", timeout=10_000)
    page.wait_for_selector("#runs-count:has-text('run')")
