"""One JSON error body for every error the API returns.

``{"error": {"code": str, "message": str, "field": str | None, "details": list}}`` for 4xx/5xx
responses, and as the last frame before a websocket closes (docs/contracts.md). ``field`` is the
JSON path of the input at fault (``overrides.memory.stagehand.vram_high_watermark_mb``).
"""

from __future__ import annotations

import inspect
import logging
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import WebSocketRoute

from workbench.services.diskfull import condition, free_bytes, is_disk_full
from workbench.store import is_damage

log = logging.getLogger("workbench.api.errors")


class ErrorDetail(BaseModel):
    """One problem of a 422: the field (JSON path) and what is wrong with it."""

    field: str | None
    message: str
    type: str | None = None


class ErrorInfo(BaseModel):
    code: str = Field(description="stable machine-readable code: validation_error, not_found...")
    message: str = Field(description="one sentence for people, naming the field when there is one")
    field: str | None = Field(description="JSON path of the input at fault, or null")
    details: list[ErrorDetail] = Field(description="every problem of a 422; empty otherwise")


class ErrorBody(BaseModel):
    """The one body of every error response (and the last websocket frame before a close)."""

    error: ErrorInfo


class ApiError(Exception):
    """An error with an HTTP status and a stable machine-readable code."""

    status = 400
    code = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        details: list[Any] | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details or []
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.field, self.details)


class NotFound(ApiError):
    """The named preset, run or artifact does not exist."""

    status, code = 404, "not_found"


class Conflict(ApiError):
    """The request clashes with the current state (name taken, run not running)."""

    status, code = 409, "conflict"


class ReadOnly(ApiError):
    """Built-in presets cannot be changed or deleted."""

    status, code = 403, "read_only"


class Invalid(ApiError):
    """The input is well-formed JSON but not a valid value."""

    status, code = 422, "invalid"


class Unauthorized(ApiError):
    """No token, or the wrong one."""

    status, code = 401, "unauthorized"


class TooLarge(ApiError):
    """The request body is over the limit."""

    status, code = 413, "body_too_large"


class DiskFull(ApiError):
    """A write failed because the disk of the data dir is full (HTTP 507 Insufficient Storage)."""

    status, code = 507, "disk_full"


def error_body(
    code: str, message: str, field: str | None = None, details: list[Any] | None = None
) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field, "details": details or []}}


def json_path(loc: Sequence[Any], prefix: str | None = None) -> str | None:
    """``("memory", "stagehand", 0)`` -> ``"memory.stagehand[0]"``, with an optional prefix."""
    out = prefix or ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _plain(value: Any) -> Any:
    # pydantic puts exception objects in ``ctx``; the body must stay JSON.
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def validation_details(errors: Iterable[dict[str, Any]], prefix: str | None = None) -> list[dict]:
    """pydantic errors as ``[{field, message, type}]`` with JSON paths."""
    return [
        {
            "field": json_path(e.get("loc", ()), prefix),
            "message": e.get("msg", ""),
            "type": e.get("type", ""),
        }
        for e in errors
    ]


def from_validation(exc: ValidationError, prefix: str | None = None) -> Invalid:
    """A pydantic ``ValidationError`` as a 422 naming its first field."""
    details = validation_details(exc.errors(), prefix)
    first = details[0] if details else {"field": prefix, "message": str(exc)}
    field = first["field"]
    message = f"{field}: {first['message']}" if field else first["message"]
    return Invalid(message, field=field or prefix, details=details, code="validation_error")


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    422: "validation_error",
}


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def allowed_methods(request: Request) -> list[str]:
    """The methods this app takes at ``request``'s path (OPTIONS included), sorted: those of
    every route whose path matches (the API's routers, given to ``install``; the dashboard's
    routes and static files; websockets are not HTTP methods)."""
    path = request.url.path
    methods = {"OPTIONS"}
    routers = request.app.state.api_routers
    for route in [*(r for router in routers for r in router.routes), *request.app.routes]:
        regex = getattr(route, "path_regex", None)
        if isinstance(route, WebSocketRoute) or regex is None or not regex.match(path):
            continue
        methods |= getattr(route, "methods", None) or {"GET", "HEAD"}  # a Mount: static files
    return sorted(methods)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    headers = dict(exc.headers or {})
    if exc.status_code == 404 and message == "Not Found":
        message = f"no route or file at {request.url.path}"
    if exc.status_code == 405:
        allow = ", ".join(allowed_methods(request))
        if request.method == "OPTIONS":  # what this path takes; no CORS: other origins get none
            return Response(status_code=204, headers={"Allow": allow})
        headers["Allow"] = allow
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allow})"
    return JSONResponse(error_body(code, message), status_code=exc.status_code, headers=headers)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        ctx = errors[0].get("ctx") or {}
        return JSONResponse(
            error_body(
                "malformed_json", f"request body is not valid JSON: {ctx.get('error', '')}".strip()
            ),
            status_code=400,
        )
    # Strip FastAPI's "body"/"query"/"path" head: the field is the client's JSON path.
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if loc == ("body",):  # no body, or one FastAPI did not read as JSON: say what it takes
            got = _body_kind(request, e)
            e["msg"] = f"expected a JSON object body (Content-Type: application/json), got {got}"
        if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
            e["loc"] = loc[1:]
    err = from_validation_list(errors)
    return JSONResponse(err.body(), status_code=422)


def _body_kind(request: Request, error: dict[str, Any]) -> str:
    content_type = request.headers.get("content-type")
    if error.get("type") == "missing":
        return "no body"
    if content_type and "json" not in content_type.lower():
        return f"Content-Type {content_type!r}"
    kinds = {
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return f"{kinds.get(type(error.get('input')), 'null')} in JSON"


def from_validation_list(errors: list[dict[str, Any]]) -> Invalid:
    details = validation_details(errors)
    first = details[0] if details else {"field": None, "message": "invalid request"}
    field = first["field"]
    message = f"{field}: {first['message']}" if field else first["message"]
    return Invalid(_plain(message), field=field, details=_plain(details), code="validation_error")


async def _disk_full(request: Request, exc: Exception) -> Response:
    """sqlite's "database or disk is full" and ``OSError`` ``ENOSPC``: a 507 naming the path and
    its free bytes, logged once per condition (``workbench.services.diskfull``), not a 500 and a
    traceback per request. Any other error of these classes goes on to the handler registered
    for a base class (or to ``_unhandled``)."""
    if request.scope["type"] != "http" or not is_disk_full(exc):
        return await _next_handler(request, exc)
    where = f"{request.method} {request.url.path}"
    data_dir = request.app.state.settings.data_dir
    disk = condition(data_dir)
    disk.failed(exc, where)
    name = getattr(exc, "filename", None)
    path = name if isinstance(name, str) and name else str(data_dir)
    what = "the database" if isinstance(exc, sqlite3.Error) else path
    message = (
        f"disk full at {path}: {free_bytes(path)} bytes free; {where} could not write {what} "
        f"({getattr(exc, 'strerror', None) or exc}). Free space under {data_dir} and retry"
    )
    return JSONResponse(DiskFull(message).body(), status_code=DiskFull.status)


async def _next_handler(request: Request, exc: Exception) -> Response:
    """The handler of the nearest base class of ``exc`` other than ``_disk_full`` (below
    ``Exception``, whose handler answers from the outermost middleware); else ``exc`` goes on
    there."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            break
        handler = handlers.get(cls)
        if handler is not None and handler is not _disk_full:
            out = handler(request, exc)
            return await out if inspect.isawaitable(out) else out
    raise exc


class DatabaseUnavailable(ApiError):
    """The database file is damaged (HTTP 503 until it is rebuilt from the run folders)."""

    status, code = 503, "database_damaged"


async def _database_damaged(request: Request, exc: Exception) -> Response:
    """SQLite saying the database is damaged or not a database (``workbench.store.is_damage``): a
    503 naming the file and how to rebuild it, not a 500 ``DatabaseError``. Any other
    ``sqlite3.DatabaseError`` (and any on a websocket) goes on to ``_unhandled``."""
    if request.scope["type"] != "http" or not is_damage(exc):
        raise exc
    settings = request.app.state.settings
    where = f"{request.method} {request.url.path}"
    message = (
        f"the database {settings.db_path} is damaged ({exc}); {where} cannot be answered. The "
        f"run folders in {settings.runs_dir} are intact: stop the server and start it with "
        "`workbench serve --rebuild-db` to rebuild the database from them"
    )
    log.error("%s", message)
    return JSONResponse(DatabaseUnavailable(message).body(), status_code=503)


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body("internal_error", f"{type(exc).__name__}: the server failed on this request"),
        status_code=500,
    )


def install(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """Route every error path of ``app`` to the one body. ``routers``: the API's
    (``workbench.api.app.ROUTERS``), whose methods a 405 or OPTIONS answer lists; given here because
    the routers import this module."""
    app.state.api_routers = list(routers)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(sqlite3.OperationalError, _disk_full)
    app.add_exception_handler(OSError, _disk_full)
    app.add_exception_handler(sqlite3.DatabaseError, _database_damaged)
    app.add_exception_handler(Exception, _unhandled)
