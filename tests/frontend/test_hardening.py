"""The hardening in a real browser: a sandboxed iframe on a page from another port cannot cancel a
run; run names are text in Plotly's legends; the New run page shows the dataset scan before
Start and the run page shows the worker's (synthetic worker, real backend, Debian chromium)."""

from __future__ import annotations

import copy
import html
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.frontend.conftest import Api, picture
from tests.worker.messy_data import BAD, USABLE, WARNED, build_messy

pytestmark = [pytest.mark.browser]


def make_preset(api: Api, name: str, steps: int, step_s: float, data: dict | None = None) -> None:
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, max_steps=steps, description=f"synthetic step_s={step_s}")
    if data is not None:
        config["data"] = data
    api.call("POST", "/api/presets", {"name": name, "config": config})


class AttackPage:
    """``page`` served on 127.0.0.1 at another port than the dashboard's (another origin)."""

    def __init__(self, page: str) -> None:
        body = page.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_sandboxed_iframe_from_another_port_cannot_cancel_a_run(synthetic_server, page):
    api = Api(synthetic_server)
    make_preset(api, "synth-target", steps=400, step_s=0.2)
    run = api.call("POST", "/api/runs", {"preset": "synth-target", "name": "target"})
    api.wait_run(run["id"], {"running"}, timeout=30)
    cancel = f"{synthetic_server}/api/runs/{run['id']}/cancel"
    # The iframe's document has an opaque origin: its requests carry Origin: null.
    script = (
        f"fetch({cancel!r}, {{method: 'POST', mode: 'no-cors'}})"
        ".then(() => parent.postMessage('sent', '*'),"
        " (e) => parent.postMessage('failed: ' + e, '*'));"
    )
    frame = f'<iframe sandbox="allow-scripts" srcdoc="{html.escape(f"<script>{script}</script>")}">'
    attack = AttackPage(
        "<!doctype html><title>waiting</title>"
        "<script>addEventListener('message', (e) => { document.title = e.data; });</script>"
        + frame
        + "</iframe>"
    )
    try:
        page.goto(attack.url)
        page.wait_for_function("document.title !== 'waiting'", timeout=15_000)
        assert page.title() == "sent"  # the request left the browser...
        time.sleep(2.0)  # ...and the worker would have stopped within a step (0.2 s)
        assert api.call("GET", f"/api/runs/{run['id']}")["status"] == "running"
    finally:
        attack.close()
    api.call("POST", f"/api/runs/{run['id']}/cancel")  # no Origin: a script, allowed
    api.wait_run(run["id"], {"cancelled"}, timeout=30)


def test_run_names_are_text_in_plotly_titles_legends_and_hovers(synthetic_server, page, shoot):
    api = Api(synthetic_server)
    make_preset(api, "synth-names", steps=3, step_s=0)
    name = '<a href="https:evil.example">pwn <b>bold & co'
    ids = []
    for i in range(2):
        run = api.call("POST", "/api/runs", {"preset": "synth-names", "name": f"plain-{i}"})
        ids.append(run["id"])
    api.call("PATCH", f"/api/runs/{ids[0]}", {"name": name})
    for run_id in ids:
        api.wait_run(run_id, {"succeeded"}, timeout=60)
    url = f"{synthetic_server}/#/compare?ids={ids[0]},{ids[1]}"
    page.goto(url)
    page.wait_for_selector("#cmp-loss .legendtext")
    legend = page.eval_on_selector_all("#cmp-loss .legendtext", "ts => ts.map(t => t.textContent)")
    assert legend[0] == f"{name} (#{ids[0]})"
    for chart in ("cmp-vram", "cmp-step", "cmp-loss", "cmp-spill"):
        assert page.eval_on_selector_all(f"#{chart} a", "links => links.length") == 0, chart
        bold = f"#{chart} .legendtext tspan[style*='bold']"
        assert page.eval_on_selector_all(bold, "b => b.length") == 0, chart
    # Hover: the unified label names the run as text, too.
    box = page.locator("#cmp-loss .nsewdrag").first.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_selector("#cmp-loss .hoverlayer .legendtext, #cmp-loss .hoverlayer text")
    hover = page.eval_on_selector("#cmp-loss .hoverlayer", "h => h.textContent")
    assert '<a href="' in hover  # the name as text (Plotly cuts hover names at 15 characters)
    assert page.eval_on_selector_all("#cmp-loss .hoverlayer a", "a => a.length") == 0
    # The run page's header shows it as text as well (no link, the literal characters).
    page.goto(f"{synthetic_server}/#/runs/{ids[0]}")
    page.wait_for_selector("#run-header h1")
    assert page.inner_text("#run-header h1") == name
    assert page.eval_on_selector_all("#run-header h1 a", "a => a.length") == 0
    shoot(url, "compare-markup-names", ready="#cmp-loss .legendtext")


def test_new_run_page_scans_the_data_before_start_and_the_run_page_shows_it(
    synthetic_server, page, shoot, tmp_path
):
    api = Api(synthetic_server)
    folder = build_messy(tmp_path / "messy")
    data = {"path": str(folder), "max_caption_tokens": 16}
    make_preset(api, "synth-messy", steps=3, step_s=0, data=data)
    make_preset(api, "synth-strict", steps=3, step_s=0, data={**data, "on_bad_file": "fail"})

    # on_bad_file: fail -> the scan's problem is shown and nothing starts.
    page.goto(synthetic_server + "/#/new?preset=synth-strict")
    page.wait_for_selector("#preset-select option[value='synth-strict']", state="attached")
    page.wait_for_function("document.getElementById('preset-select').value === 'synth-strict'")
    page.click("#start-run")
    problem = page.wait_for_selector("#data-scan .scan-problem")
    assert problem.inner_text().startswith("data.on_bad_file is fail and 4 file(s) cannot be used")
    assert "#/new" in page.url and page.inner_text("#start-run") == "Start run"

    # skip (the default) -> the list is shown once, then Start goes ahead.
    page.select_option("#preset-select", "synth-messy")
    assert page.is_hidden("#data-scan") and page.inner_text("#start-run") == "Start run"
    page.click("#start-run")
    # The strict preset's scan is taken away when the preset changes; this is the new one.
    page.wait_for_selector("#data-scan #scan-confirm")
    summary = page.inner_text("#data-scan .scan-summary")
    assert summary.startswith(f"{len(USABLE)} samples · 9 files left out (4 bad) · 2 warnings")
    rows = page.eval_on_selector_all(
        "#data-scan tr[data-file]", "rs => rs.map(r => [r.dataset.file, r.className])"
    )
    assert {f for f, kind in rows if kind == "scan-bad"} == set(BAD)
    assert {f for f, kind in rows if kind == "scan-warning"} == set(WARNED)
    assert page.inner_text("#start-run") == "Start anyway"
    # The worker's device: auto, the CPU, and one entry per CUDA device the server found.
    cuda = api.call("GET", "/api/system")["cuda_devices"]
    options = page.eval_on_selector_all("#run-device option", "os => os.map(o => o.value)")
    assert options == ["auto", "cpu", *[f"cuda:{i}" for i in range(cuda)]]
    page.select_option("#run-device", "cpu")
    picture(page, "new-run-data-scan-desktop", full_page=True)
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    assert api.call("GET", f"/api/runs/{run_id}")["device"] == "cpu"

    # The run page shows the scan the worker recorded.
    # The server is shared by the session's browser tests: the run may queue behind another.
    page.wait_for_selector("#run-data .scan-summary", timeout=120_000)
    assert page.inner_text("#run-data .scan-summary") == summary
    api.wait_run(run_id, {"succeeded"}, timeout=60)
    shoot(f"{synthetic_server}/#/runs/{run_id}", "run-data-scan", ready="#run-data .scan-summary")


def test_run_page_shows_the_frames_per_clip_beside_the_scan(
    synthetic_server, page, shoot, tmp_path
):
    """A video run's ``trainer/run_started`` carries the frames per clip it chose;
    the run page's Data card shows them together with the scan recorded before it."""
    from PIL import Image

    api = Api(synthetic_server)
    folder = tmp_path / "stills"
    folder.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(folder / f"still{i}.png")
        (folder / f"still{i}.txt").write_text(f"a still number {i}")
    make_preset(api, "synth-frames", steps=2, step_s=0, data={"path": str(folder), "frames": 1})
    run_id = api.call("POST", "/api/runs", {"preset": "synth-frames", "name": "frames"})["id"]
    api.wait_run(run_id, {"succeeded"}, timeout=120)
    page.goto(f"{synthetic_server}/#/runs/{run_id}")
    page.wait_for_selector("#run-data #data-frames")
    assert page.inner_text("#run-data #data-frames") == "1 frame per clip (data.frames)"
    assert page.inner_text("#run-data .scan-summary").startswith("2 samples")
    shoot(f"{synthetic_server}/#/runs/{run_id}", "run-data-frames", ready="#run-data #data-frames")
