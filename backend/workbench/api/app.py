"""The FastAPI application: services built in ``lifespan``, one router per resource, the
dashboard's static files, one error body, and the security middleware in front."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from importlib import util as importlib_util
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from workbench.api import (
    apidocs,
    artifacts,
    assets,
    checks,
    compare,
    data,
    errors,
    openapi,
    pipelines,
    plan,
    presets,
    runs,
    stream,
    system,
    telemetry,
    tunes,
)
from workbench.api.deps import public_run
from workbench.api.errors import NotFound
from workbench.api.security import SecurityMiddleware
from workbench.contract.javascript import javascript_module
from workbench.executors import Executor
from workbench.executors.factory import make_executor
from workbench.services.adoption import adopt_run_folders
from workbench.services.assets import AssetBuild
from workbench.services.calibration import Calibrator
from workbench.services.hub import Hub
from workbench.services.presets import load_builtins
from workbench.services.settings import Settings
from workbench.services.supervisor import Supervisor
from workbench.services.system import SystemProbe
from workbench.services.tailer import Tailer
from workbench.store import Store

log = logging.getLogger("workbench.api.app")

ROUTERS = [
    system.router,
    assets.router,
    presets.router,
    runs.router,
    checks.router,
    artifacts.router,
    data.router,
    telemetry.router,
    compare.router,
    stream.router,
    pipelines.router,
    plan.router,
    tunes.router,
]
"""One router per resource, in the order the OpenAPI page lists them."""

PLACEHOLDER = """<!doctype html><meta charset="utf-8"><title>Stagehand Workbench</title>
<h1>Stagehand Workbench</h1><p>The dashboard is not installed (no <code>frontend/index.html</code>).
The API is running: see <a href="/docs">/docs</a>.</p>"""


def plotly_js() -> Path | None:
    """``plotly/package_data/plotly.min.js`` of the installed plotly package, if any."""
    spec = importlib_util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings: Settings = app.state.settings
    settings.runs_dir.mkdir(parents=True, exist_ok=True)
    # Refused here with DatabaseDamaged (path, how to rebuild) unless `workbench serve` has
    # opened it already (it prints that message instead of uvicorn's traceback).
    store = app.state.opened_store or Store(settings.db_path, runs_dir=settings.runs_dir)
    app.state.opened_store = None  # closed at the end of this lifespan: a next one reopens
    adopt_run_folders(store, settings.runs_dir)  # before the supervisor gives a new id
    names = load_builtins(store, settings.presets_dir)
    log.info("built-in presets: %s", ", ".join(names) or "none")
    hub = Hub(asyncio.get_running_loop())
    tailer = Tailer(store, hub, settings.poll_interval_s)

    def on_change(run_id: int) -> None:
        row = store.get_run(run_id)
        if row is not None:
            hub.publish_run(run_id, public_run(store, row))

    executor = app.state.executor or make_executor(settings)
    pending = settings.data_dir / "calibration-queue.json" if settings.calibrate else None
    calibrator = Calibrator(store, pending=pending, enabled=settings.calibrate)
    finished = calibrator.submit if settings.calibrate else None
    probe = app.state.probe or SystemProbe(executor)
    probe.start()
    supervisor = Supervisor(
        settings,
        store,
        tailer,
        on_change,
        executor,
        on_finished=finished,
        default_device=probe.default_device,
    )
    app.state.store, app.state.hub, app.state.tailer = store, hub, tailer
    app.state.supervisor, app.state.probe = supervisor, probe
    app.state.calibrator = calibrator
    app.state.assets = assets = AssetBuild(settings.asset_cache)
    if settings.demo_assets:
        assets.start()
    calibrator.start()
    supervisor.start()
    tailer.start()
    try:
        yield
    finally:
        assets.stop()
        supervisor.stop()
        calibrator.stop()
        tailer.stop()
        executor.close()
        store.close()


def create_app(
    settings: Settings | None = None,
    executor: Executor | None = None,
    probe: SystemProbe | None = None,
    store: Store | None = None,
) -> FastAPI:
    """The app for ``settings`` (defaults from the environment). Services start in lifespan;
    ``executor`` is the one ``settings.executor`` names unless given (already built), ``probe``
    a ``SystemProbe`` over it unless given (tests pass one that answers without torch),
    ``store`` the database already opened and checked (``workbench serve``), else opened in
    lifespan (``DatabaseDamaged`` from there stops the start). Run folders that the database
    has no row for are adopted as runs at start (``workbench.services.adoption``)."""
    settings = settings or Settings()
    app = FastAPI(
        title="Stagehand Workbench",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # apidocs serves /docs and /redoc from local assets
        redoc_url=None,
        description="Runs, presets and live telemetry of LoRA training runs (docs/contracts.md).",
    )
    app.state.settings = settings
    app.state.executor = executor
    app.state.probe = probe
    app.state.opened_store = store
    errors.install(app, ROUTERS)
    openapi.install(app)
    apidocs.install(app)
    for router in ROUTERS:
        app.include_router(router)

    @app.get("/", include_in_schema=False)
    def index():
        page = settings.frontend_dir / "index.html"
        if page.is_file():
            return FileResponse(page, media_type="text/html")
        return HTMLResponse(PLACEHOLDER)

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly():
        path = plotly_js()
        if path is None:
            raise NotFound("plotly is not installed: pip install plotly")
        return FileResponse(path, media_type="text/javascript")

    @app.get("/static/js/contract.js", include_in_schema=False)
    def contract_js():
        """Run statuses, live-limit fields and allowed values for the dashboard
        (``workbench.contract.javascript``)."""
        return Response(javascript_module(), media_type="text/javascript")

    app.mount(
        "/static", StaticFiles(directory=settings.frontend_dir, check_dir=False), name="static"
    )
    # Telemetry pages and static assets (plotly.min.js: 4.6 MB, ~1.4 MB gzipped) compressed for
    # clients that accept it; websockets pass through untouched.
    app.add_middleware(GZipMiddleware, minimum_size=1024)
    app.add_middleware(
        SecurityMiddleware, token=settings.token, max_body_bytes=settings.max_body_bytes
    )
    return app
