"""The bench tests run as the runtimes' do (``tests/runtime/conftest.py``): in a temp working folder,
under the device double when ``STAGEHAND_TEST_LAG`` is set.

The tiny FLUX.1-dev rows (``workbench bench --model flux-dev --size tiny``) are the suite's
slowest tests: each row loads the 57-block model and runs three LoRA steps in its own child
process. Two session fixtures keep them to one bench run per test session:
``flux_dev_tiny`` builds the weights' folder once (in the asset cache, named by its config, so
``STAGEHAND_WORKBENCH_TEST_CACHE`` keeps it between sessions), and ``flux_dev_tiny_run`` runs
the rows on it once, on an emulated 24 GiB card (``--card-gb 24``: on the CPU a tiny row
without a card resolves its sections for the same card, ``realmodel.CARD_BYTES``), whose JSON
and printed table ``test_realsize.py`` and ``test_realsize_plan.py`` both assert on. The run
has the rows the session's tests that use it ask for (``@pytest.mark.realsize_rows(...)``;
a test without the marker asks for every row), so one test run alone runs only its rows.
"""

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest

from tests.runtime.conftest import _device_double, _in_tmp_dir  # noqa: F401

RUN_FIXTURE = "flux_dev_tiny_run"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"realsize_rows(*names): the tiny real-size rows a test using {RUN_FIXTURE} asserts on "
        "(the run always has ``resident``); without it, every row",
    )


def rows_wanted(items) -> list[str]:
    """The rows the session's tests using ``flux_dev_tiny_run`` ask for, in ``ROWS`` order
    (``[]``: every row, ``--only`` left empty)."""
    from workbench.bench.realsize import ROWS

    wanted: set[str] = set()
    for item in items:
        if RUN_FIXTURE not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("realsize_rows")
        if marker is None:
            return []
        wanted.update(marker.args)
    unknown = wanted - set(ROWS)
    assert not unknown, f"realsize_rows: no rows {sorted(unknown)} (rows are {list(ROWS)})"
    return [name for name in ROWS if name in wanted]


@pytest.fixture(scope="session")
def flux_dev_tiny(asset_cache) -> Path:
    """FLUX.1-dev's tiny weights (``realsize.build_job``), built once per session into a folder
    named by the tiny config's hash (a changed config gets a folder of its own, and its SquareQ
    cache beside it, ``DIR-squareq``, with it)."""
    from workbench.bench.realmodel import real_model
    from workbench.bench.realsize import build_job

    config = json.dumps(real_model("flux-dev").model_config("tiny"), sort_keys=True)
    folder = asset_cache / f"flux-dev-tiny-{hashlib.sha256(config.encode()).hexdigest()[:12]}"
    built = build_job({"model": "flux-dev", "folder": str(folder), "size": "tiny", "device": "cpu"})
    assert built["status"] == "ok", built
    return folder


@pytest.fixture(scope="session")
def flux_dev_tiny_run(flux_dev_tiny, tmp_path_factory, request) -> dict:
    """``workbench bench --model flux-dev --size tiny --device cpu --steps 1 --warmup 2
    --card-gb 24 --only ROWS`` on ``flux_dev_tiny`` once per session, ``ROWS`` the rows its
    tests ask for (``rows_wanted``): ``{"code": exit code, "result": the JSON, "printed": its
    stdout}``."""
    from workbench.bench.cli import main

    tmp = tmp_path_factory.mktemp("realsize")
    out = tmp / "realsize.json"
    argv = ["--model", "flux-dev", "--size", "tiny", "--folder", str(flux_dev_tiny)]
    # Warm-up 2: the trace step, then the first step after it, which also loads ahead the
    # blocks its successor needs first (NOTE [ Prefetch window ]): the third is steady.
    argv += ["--device", "cpu", "--steps", "1", "--warmup", "2"]
    argv += ["--card-gb", "24", "--out", str(out)]
    argv += ["--only", ",".join(rows_wanted(request.session.items))]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(tmp)
        code = main(argv)
    result = json.loads(out.read_text()) if out.is_file() else None
    return {"code": code, "result": result, "printed": printed.getvalue()}
