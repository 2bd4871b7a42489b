"""The OpenAPI document: every operation lists the errors it can answer, each with the one
error body, and the Preset schema (with its bounds) is published for the preset bodies.

What an operation can answer follows from its shape, and is added here: 401 and 403 (token,
Host, Origin) everywhere, 422 when it takes parameters or a body, 400 (malformed JSON) when it
takes a body, 413 for writes (the body bound holds for every POST, PUT, PATCH and DELETE).
What its handler raises (404, 409, 403 read-only) each route declares with ``errors(...)``.
A query parameter read as a comma-separated list is declared as the array it is
(``comma_separated``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from workbench.api.errors import ErrorBody
from workbench.contract.preset import Preset

DESCRIPTIONS = {
    400: "malformed JSON (code malformed_json)",
    401: "no token, or the wrong one (code unauthorized)",
    403: "refused: Host, Origin or Sec-Fetch-Site (code forbidden), or a built-in preset "
    "(code read_only)",
    404: "no such run, preset or artifact (code not_found)",
    409: "the request clashes with the state: name taken, run not running (code conflict)",
    413: "body over 1 MB (code body_too_large)",
    422: "invalid input; field and details name each JSON path (code validation_error)",
}
WRITES = ("post", "put", "patch", "delete")
ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
COMMA_SEPARATED = "x-comma-separated"
"""Marks the schema of a query parameter read as a comma-separated list; ``document`` turns it
into the parameter's ``style: form, explode: false``."""


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries of a route: ``statuses`` with the one error body."""
    return {s: {"model": ErrorBody, "description": DESCRIPTIONS[s]} for s in statuses}


def comma_separated(
    items: dict[str, Any], min_items: int, max_items: int
) -> Callable[[dict[str, Any]], None]:
    """``json_schema_extra`` of a ``str`` query parameter whose handler reads it as a list
    (``ids=1,2``): its schema becomes an array of ``items`` (``min_items`` to ``max_items``,
    distinct), written ``style: form, explode: false`` (OpenAPI 3.1, "Style Values": the values
    joined by commas). The handler's own checks (``max_length``, a message naming the field)
    stay as they are; the array says what they accept."""

    def replace(schema: dict[str, Any]) -> None:
        description = schema.get("description")
        schema.clear()
        schema.update(type="array", items=items, minItems=min_items, maxItems=max_items)
        schema.update(uniqueItems=True, **{COMMA_SEPARATED: True})
        if description:
            schema["description"] = description

    return replace


def _publish(schema: dict[str, Any], model: type[BaseModel], name: str | None = None) -> None:
    """Adds ``model``'s JSON schema (and the models it uses) to the document's components."""
    own = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(own.pop("$defs", {}))
    components[name or model.__name__] = own


def _errors_of(method: str, operation: dict[str, Any]) -> list[int]:
    statuses = [401, 403]
    if operation.get("parameters") or "requestBody" in operation:
        statuses.append(422)
    if "requestBody" in operation:
        statuses.append(400)
    if method in WRITES:
        statuses.append(413)
    return statuses


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, built once (``app.openapi``)."""
    if app.openapi_schema:
        return app.openapi_schema

    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _publish(schema, ErrorBody)
    _publish(schema, Preset)
    for ops in schema.get("paths", {}).values():
        for method, operation in ops.items():
            for param in operation.get("parameters", []):
                if param["schema"].pop(COMMA_SEPARATED, False):
                    param.update(style="form", explode=False)
            responses = operation.setdefault("responses", {})
            for status in _errors_of(method, operation):
                responses[str(status)] = {"description": DESCRIPTIONS[status]}
            for status, response in responses.items():
                if status.startswith(("4", "5")):  # FastAPI's own 422 body is not ours
                    response["content"] = {"application/json": {"schema": ERROR_REF}}
    components = schema["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema


def install(app: FastAPI) -> None:
    """Serve ``document(app)`` at /openapi.json."""
    app.openapi = lambda: document(app)
