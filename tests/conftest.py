"""Shared test setup: single-threaded, offline, and session-scoped assets from the factory.

Set ``STAGEHAND_WORKBENCH_TEST_CACHE=/some/folder`` to reuse the factory's builds across test runs;
otherwise everything is built once per session into one temp folder.
"""

import gc
import os

# Before torch: MKL's strict reproducible mode (MKL_CBWR), as every worker and command has it.
import workbench.worker.preload  # noqa: F401

gc.disable()  # until the test loop starts (pytest_runtestloop below)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test servers do not start the demo-asset build (minutes of CPU); tests/backend/test_assets.py
# and tests/frontend/test_assets_ui.py start it themselves.
os.environ.setdefault("STAGEHAND_WORKBENCH_DEMO_ASSETS", "0")


def _run_cache() -> str:
    """The workbench cache (``$STAGEHAND_WORKBENCH_CACHE``) of every process this test run
    starts, in place of the user's (``~/.cache/stagehand-workbench``, or the variable they set):
    a temp folder made by the run's first process (xdist's controller, whose environment its
    workers inherit: one folder for them all) and removed when that process exits. The servers,
    workers and builds the tests start wrote their stage-1 caches, worker baseline, CPU profile
    and demo-asset builds into the user's cache. Tests that need a cache of their own still set
    the variable themselves."""
    import atexit
    import shutil
    import tempfile

    owner = os.environ.get("STAGEHAND_TEST_RUN_CACHE")
    if owner is None:
        owner = tempfile.mkdtemp(prefix="stagehand-test-cache-")
        os.environ["STAGEHAND_TEST_RUN_CACHE"] = owner
        atexit.register(shutil.rmtree, owner, ignore_errors=True)
    return owner


os.environ["STAGEHAND_WORKBENCH_CACHE"] = _run_cache()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Collection ran with the cyclic collector paused (this file's top): every object it made
    (torch, diffusers, transformers, peft and the test modules: ~560,000 for tests/) is frozen here
    (``gc.freeze``) and the collector resumed, so that no full collection scans them again, as
    ``workbench.worker.preload`` does for a worker. Collecting tests/: 20.8 -> 15.0 s on 2 cores;
    tests/plan, tests/runtime/squareq and two worker files: 299 -> 272 CPU-s. In xdist's
    controller, which collects nothing, this is where the collector resumes too.

    A young collection then waits for 10,000 new container objects, not Python's 700: the tests
    build models, tensors and modules by the thousand, and each full collection (every 100 young
    ones, as before) scans what they hold. Time in collections, tests/runtime/test_exactness.py,
    tests/plan/test_inventory_shapes.py and two more files in one process: 2.80 -> 1.42 of
    ~57 CPU-s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    gc.enable()


BROWSER_TESTS = "tests/frontend/"
"""The folder whose files one xdist worker runs together (``pytest_xdist_make_scheduler``)."""


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (``./dev test``), the browser tests' files are one unit of work
    for one worker, every other file one unit as before: their session fixtures (a dashboard
    server with its fork server and torch side, a synthetic server, chromium with its profiles
    and Playwright's driver, ``tests/frontend/conftest.py``) are then started once per test run,
    not once in each worker. Other ``--dist`` modes are xdist's own (None: its default)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class BrowserFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return BROWSER_TESTS if path.startswith(BROWSER_TESTS) else path

    return BrowserFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""Debian's chromium and its flags, for every test that drives a browser (never ``playwright
install``)."""


@pytest.fixture(scope="session")
def _playwright():
    """The test process's one Playwright (its sync API refuses a second inside the first's
    event loop: a test starting its own after the browser tests ran in its process failed)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def browser(_playwright):
    """A plain chromium, for the tests that make a context of their own (``new_context``)."""
    b = _playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield b
    b.close()


@pytest.fixture(scope="session")
def asset_cache(tmp_path_factory) -> Path:
    """Cache root the factory builds into for this session."""
    env = os.environ.get("STAGEHAND_WORKBENCH_TEST_CACHE")
    if env:
        path = Path(env).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tiny_flux(asset_cache) -> Path:
    from workbench.worker.assets import build_model

    return build_model("flux", "tiny", asset_cache)


@pytest.fixture(scope="session")
def tiny_sd3(asset_cache) -> Path:
    from workbench.worker.assets import build_model

    return build_model("sd3", "tiny", asset_cache)


@pytest.fixture(scope="session")
def tiny_video(asset_cache) -> Path:
    """Tiny LTXVideoTransformer3DModel folder (arch name ``ltx``)."""
    from workbench.worker.assets import build_model

    return build_model("ltx", "tiny", asset_cache)


@pytest.fixture(scope="session")
def tiny_vae(asset_cache) -> Path:
    from workbench.worker.assets import build_model

    return build_model("vae", "tiny", asset_cache)


@pytest.fixture(scope="session")
def digits_dir(asset_cache) -> Path:
    from workbench.worker.assets import build_digits

    return build_digits(asset_cache)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from workbench.worker.assets import minilm_path

    return minilm_path()
