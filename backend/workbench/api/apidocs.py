"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) that work offline.

FastAPI's own pages load their scripts, styles, favicon and (ReDoc) Google fonts from CDNs, so
they are blank on a machine without internet. These are the same pages (FastAPI's
``get_swagger_ui_html`` / ``get_redoc_html``) pointed at copies served here, from the
``fastapi-offline-docs`` package's ``static/`` folder, as Plotly is served from ``plotly``'s.
"""

from __future__ import annotations

from importlib import util as importlib_util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse

from workbench.api.errors import NotFound

PACKAGE = "fastapi_offline_docs"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
}
PREFIX = "/static/vendor/docs"
FAVICON = "data:,"  # no request for a favicon (FastAPI's default is on fastapi.tiangolo.com)


def asset_dir() -> Path | None:
    """``fastapi_offline_docs/static`` of the installed package, if any."""
    spec = importlib_util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "static"
    return path if path.is_dir() else None


def install(app: FastAPI) -> None:
    """Serves ``/docs``, ``/redoc`` and their assets under ``/static/vendor/docs/``; create
    ``app`` with ``docs_url=None, redoc_url=None`` so FastAPI's CDN pages are not routed first.
    A missing package answers 404 naming it (the pages then say so in the browser's console)."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui():
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{PREFIX}/swagger-ui.css",
            swagger_favicon_url=FAVICON,
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc():
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API reference",
            redoc_js_url=f"{PREFIX}/redoc.standalone.js",
            redoc_favicon_url=FAVICON,
            with_google_fonts=False,
        )

    @app.get(PREFIX + "/{name}", include_in_schema=False)
    def asset(name: str):
        folder = asset_dir()
        if name not in ASSETS:
            raise NotFound(f"no API docs asset {name!r}: expected one of {', '.join(ASSETS)}")
        if folder is None or not (folder / name).is_file():
            raise NotFound(f"{PACKAGE} is not installed: pip install fastapi-offline-docs")
        return FileResponse(folder / name, media_type=ASSETS[name])
