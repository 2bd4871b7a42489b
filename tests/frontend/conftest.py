"""Browser tests of the dashboard: a real backend process, Debian chromium driven by Playwright.

``backend_server`` starts ``python -m workbench.cli serve`` on a free port with a temp data dir;
``synthetic_server`` does the same with ``tests.frontend.synthetic_worker`` as the worker (rich
telemetry without torch). Screenshots go under the test's tmp folder and are copied to
``/tmp/dashboard-shots/`` (override with ``DASHBOARD_SHOTS``) for people to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, CHROMIUM_ARGS

REPO = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("DASHBOARD_SHOTS", "/tmp/dashboard-shots"))
TAKE_SHOTS = os.environ.get("CI") != "true"
"""``shoot``'s pictures are for the developer who looks at them: under CI (``CI=true``) it saves
no picture (a picture costs ~2.3 s a width on 2 cores, and ``shoot`` takes 18 pages) and loads
each page at the phone width only, where it waits for it to be ready without an uncaught page
error (the desktop width is the test's own ``page``, already on that page)."""
DESKTOP = {"width": 1400, "height": 1000}
PHONE = {"width": 390, "height": 844}


def pytest_collection_modifyitems(config, items):
    missing = not Path(CHROMIUM).exists()
    for item in items:
        if "browser" in item.keywords and missing:
            item.add_marker(pytest.mark.skip(reason=f"{CHROMIUM} is not installed"))


class Api:
    """Tiny JSON client for setting up runs the tests then look at in the browser."""

    def __init__(self, base: str) -> None:
        self.base = base

    def send(self, method: str, path: str, body=None) -> tuple[int, object]:
        """``(HTTP status, the JSON body or None)``, a refusal's included."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            # Minutes, not seconds: a loaded machine's first pipeline inspection imports
            # diffusers in the server (over 30 s on 2 busy cores).
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, text = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text[:500]

    def call(self, method: str, path: str, body=None):
        """The JSON body of a 2xx answer; any other fails the test, naming the answer."""
        status, answer = self.send(method, path, body)
        if status >= 300:
            raise AssertionError(f"{method} {path} -> {status}: {str(answer)[:500]}")
        return answer

    def wait_run(self, run_id: int, statuses: set[str], timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.call("GET", f"/api/runs/{run_id}")
            if run["status"] in statuses:
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} still {run['status']} after {timeout} s")
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(data_dir: Path, extra_env: dict[str, str] | None = None):
    port = _free_port()
    env = dict(os.environ, **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    # Calibration plans each succeeded run on the server (seconds of CPU for a real run on
    # cpu); the synthetic server keeps it (its runs are calibrated only when their preset
    # names a GPU: tests/frontend/test_tune_ui.py).
    env.setdefault("STAGEHAND_WORKBENCH_CALIBRATE", "0")
    log = (data_dir.parent / f"server-{port}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--no-browser",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    # Up once it answers a static endpoint: /api/system waits for the device probe (on a GPU
    # build of torch a subprocess importing torch: seconds of CPU, half a minute on a loaded
    # machine), which the pages and tests that read it wait for themselves.
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/api/limits/fields", timeout=5).read()
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"backend did not start; see {log.name}") from None
            time.sleep(0.2)
    return proc, base


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def backend_server(tmp_path_factory):
    """Base URL of a real backend whose runs are real ``workbench train`` workers."""
    root = tmp_path_factory.mktemp("backend")
    # Its fork server starts with it (its imports overlap the first tests' pages), so that the
    # first run is forked too, not started cold beside it (~8 s of CPU each).
    proc, base = _start_server(root / "data", {"STAGEHAND_WORKBENCH_FORK_SERVER": "early"})
    yield base
    _stop_server(proc)


@pytest.fixture(scope="session")
def synthetic_server(tmp_path_factory):
    """Base URL of a backend whose worker is ``tests.frontend.synthetic_worker``."""
    root = tmp_path_factory.mktemp("synthetic")
    proc, base = _start_server(
        root / "data",
        {
            "STAGEHAND_WORKBENCH_WORKER_MODULE": "tests.frontend.synthetic_worker",
            "SYNTH_STEP_S": "0.25",
            "STAGEHAND_WORKBENCH_CALIBRATE": "1",
            # Its worker imports no torch: a cold start is ~0.1 s of CPU, where a fork server
            # would import torch, diffusers, peft and transformers first (~8 s; again after
            # each edit of a module it imported).
            "STAGEHAND_WORKBENCH_FORK_SERVER": "0",
        },
    )
    yield base
    _stop_server(proc)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _cancel_runs_after_a_failure(request):
    """A failed test's runs are cancelled: the backend trains one run at a time, so a run the
    test would have stopped otherwise keeps every later test's runs queued behind it."""
    yield
    if not request.node.stash.get(_FAILED, False):
        return
    for name in ("backend_server", "synthetic_server"):
        if name not in request.fixturenames:
            continue
        api = Api(request.getfixturevalue(name))
        for status in ("queued", "running", "stalled"):
            for run in api.call("GET", f"/api/runs?status={status}")["data"]:
                try:
                    api.call("POST", f"/api/runs/{run['id']}/cancel")
                except AssertionError:  # it ended meanwhile (409)
                    pass


@pytest.fixture(scope="session")
def contexts(_playwright, tmp_path_factory):
    """``contexts(viewport, **options)``: the session's browser context of that viewport (and
    ``launch_persistent_context`` options), made once: a chromium with a profile folder of its
    own. In a profile on disk chromium keeps the code V8 compiled for the dashboard's scripts
    and Plotly, and a new page takes it from there: its first load costs ~1 s of CPU on 2 cores
    where an in-memory context's (``browser.new_context``) costs ~3 s, every new page starting a
    renderer that compiles them from nothing. The dashboard keeps nothing in the browser (no
    cookies, no storage), so pages of one context see each other only through the HTTP cache."""
    made = {}

    def get(viewport: dict = DESKTOP, **options):
        # Reduced motion: app.css stops the running badge's pulse then (~0.6 CPU-s per 10 s a
        # page in chromium's software compositing; test_live_run checks it stopped).
        options.setdefault("reduced_motion", "reduce")
        key = (tuple(sorted(viewport.items())), tuple(sorted(options.items())))
        if key not in made:
            made[key] = _playwright.chromium.launch_persistent_context(
                tmp_path_factory.mktemp("chromium-profile"),
                executable_path=CHROMIUM,
                args=CHROMIUM_ARGS,
                viewport=viewport,
                **options,
            )
            # Waits end on what they wait for; a loaded 2-core machine's page can take longer
            # than Playwright's 30 s to get there.
            made[key].set_default_timeout(60_000)
        return made[key]

    yield get
    for context in made.values():
        context.close()


def _watch_errors(pg) -> list[str]:
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.page_errors = errors
    return errors


@pytest.fixture
def open_page(contexts):
    """``open_page(viewport=DESKTOP, **options)``: a new page in the session's context of that
    viewport, closed at the end of the test, which fails on any uncaught error in it."""
    opened = []

    def new(viewport: dict = DESKTOP, **options):
        pg = contexts(viewport, **options).new_page()
        _watch_errors(pg)
        opened.append(pg)
        return pg

    yield new
    for pg in opened:
        if not pg.is_closed():
            pg.close()
    errors = [e for pg in opened for e in pg.page_errors]
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def page(open_page):
    """A desktop-sized page that fails the test on any uncaught page error."""
    return open_page(DESKTOP)


QUIET = """([quietMs, capMs]) => new Promise((resolve) => {
    let timer = null;
    const observer = new MutationObserver(() => {
        clearTimeout(timer);
        timer = setTimeout(done, quietMs);
    });
    function done() { observer.disconnect(); clearTimeout(timer); clearTimeout(cap); resolve(); }
    const cap = setTimeout(done, capMs);
    observer.observe(document, {subtree: true, childList: true, attributes: true,
                                characterData: true});
    timer = setTimeout(done, quietMs);
})"""
"""Resolves once the page's DOM went ``quietMs`` without a change (the charts' flush timers,
150 ms, have drawn), or after ``capMs`` (a live run's page never goes quiet)."""


def settle(pg, cap_s: float = 1.0) -> None:
    """Until the page has drawn what it was going to (``QUIET``, at most ``cap_s``), its images
    loaded and its fonts ready: what a screenshot should show."""
    pg.evaluate(QUIET, [300, int(cap_s * 1000)])
    # (An image loading="lazy" below the fold loads only once scrolled to.)
    pg.wait_for_function("[...document.images].every((i) => i.complete || i.loading === 'lazy')")
    pg.evaluate("document.fonts.ready.then(() => true)")


@pytest.fixture(scope="session")
def _shooters(contexts):
    """One page per width for ``shoot``, each loading every URL afresh (after about:blank)."""
    made = {}

    def get(label: str, viewport: dict):
        if label not in made:
            made[label] = contexts(viewport).new_page()
        return made[label]

    return get


@pytest.fixture
def shoot(_shooters, tmp_path):
    """``shoot(url, name)``: full-page screenshots at desktop and 390 px phone width where
    ``TAKE_SHOTS``; otherwise the page loaded at the phone width only (``TAKE_SHOTS``). Either
    way the page is loaded afresh at each width, ready, without an uncaught page error."""

    def take(url: str, name: str, ready: str = "body", settle_s: float = 1.0) -> list[Path]:
        out = []
        widths = (("desktop", DESKTOP), ("phone", PHONE)) if TAKE_SHOTS else (("phone", PHONE),)
        for label, viewport in widths:
            pg = _shooters(label, viewport)
            pg.goto("about:blank")
            errors: list[str] = []

            def seen(exc, errors=errors) -> None:
                errors.append(str(exc))

            pg.on("pageerror", seen)
            try:
                pg.goto(url)
                pg.wait_for_selector(ready)
                if TAKE_SHOTS:
                    SHOTS.mkdir(parents=True, exist_ok=True)
                    settle(pg, settle_s)  # let the chart flush timers draw
                    path = tmp_path / f"{name}-{label}.png"
                    # A live run's page redraws meanwhile: minutes on a loaded machine.
                    pg.screenshot(path=str(path), full_page=True, timeout=120_000)
                    shutil.copy(path, SHOTS / path.name)
                    out.append(path)
            finally:
                pg.remove_listener("pageerror", seen)
                pg.goto("about:blank")  # a live run's page would go on drawing meanwhile
            assert not errors, f"uncaught errors in the page at {label} width: {errors}"
        return out

    return take


def picture(target, name: str, **kw) -> None:
    """``target.screenshot(**kw)`` (a page or a locator) saved as ``SHOTS/name.png``, where
    ``TAKE_SHOTS``: a picture for a developer's eyes, none under CI."""
    if TAKE_SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        target.screenshot(path=str(SHOTS / f"{name}.png"), **kw)


def api_of(base: str) -> Api:
    return Api(base)


def start_refused(page, change):
    """Makes ``change()`` (fills a field the server refuses) and clicks Start with the page's
    own field check held unanswered; returns the error box that shows. The page checks the
    request 350 ms after a field changes and holds Start back once the server names a problem;
    without the hold, a loaded machine answers that check before the click and Start is never
    sent. The hold is in place before the change, so no check of it can be answered first. With
    it, the server's refusal of the request itself is what the box shows. The held checks are
    dropped once the box is up."""
    held = []
    page.route("**/api/runs/check", lambda route: held.append(route))
    try:
        change()
        page.click("#start-run")
        return page.wait_for_selector(".page-errors .error-box[data-key='start run']")
    finally:
        # Dropped before the handler goes: a route still held when it goes is let through.
        for route in held:
            route.abort()
        page.unroute("**/api/runs/check")


def is_marker_label(label: str, full: str) -> bool:
    """A chart marker's label is its text ``full``, or ``full`` cut with "…" where the room
    beside its line ends (``markerShapes`` in frontend/js/chartlayout.js: the room depends on
    the chart's width and on how many steps it shows when drawn, which a loaded machine moves);
    a cut keeps at least the 12 characters that rule keeps."""
    if label == full:
        return True
    return label.endswith("…") and len(label) >= 12 and full.startswith(label[:-1])
