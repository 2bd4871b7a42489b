"""The OpenAPI document says what the server enforces (issue 54, finding 7).

Structure: the document is OpenAPI 3.1, so its schemas are JSON Schema 2020-12: a tuple is
``prefixItems`` (an ``items`` holding a list is 3.0's, invalid here).

Behaviour: a bounded schema-driven generator (the schema's own boundary values: min and max
length, minimum and maximum, 0, -1, the empty string, duplicate list items, plus a fixed list of
awkward strings), each value kept only when the operation's schema allows it, sent one field at a
time over a request the server accepts. A 422 for such a value is the server enforcing more than
its schema says, unless the field is one the handler checks against state the schema cannot
know (``STATEFUL``). The app runs in-process over a temp data dir (``inprocess.in_process``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from inprocess import in_process
from jsonschema import Draft202012Validator

MAX_ID = 2**62
AWKWARD = [
    "",
    " ",
    "a",
    "0",
    "1",
    "-1",
    "0,0",
    "1,1",
    "1,2",
    " 1 , 2 ",
    "1,2,",
    ",",
    "loss",
    "loss,loss",
    "a,b",
    "a.b",
    "..",
    ".a",
    "a/b",
    "a\\b",
    "a b",
    "a\tb",
    "a\nb",
    "a\x7fb",
    "a\u00a0b",
    "a\u200bb",
    "é",
    "1_0",
    "cpu",
    "cuda",
    "cuda:0",
    "auto",
    "x.png",
]
"""Strings every string field is tried with, where its schema allows them."""

STATEFUL = {
    ("POST", "/api/pipelines/inspect"): {"path", "transformer_path", "model_type"},
    ("POST", "/api/plan"): {"preset"},
    ("POST", "/api/tunes"): {"budget_mb", "overrides"},
    ("POST", "/api/tunes/{tune_id}/preset"): {"run_id"},
    ("POST", "/api/data/scan"): {"overrides"},
    ("POST", "/api/runs"): {"overrides"},
    ("POST", "/api/runs/check"): {"overrides"},
}
"""Fields whose 422 depends on what exists or on the planner (a folder on disk, a device
profile, the smallest plan within a budget, a tune's trials, the preset the overrides merge
into): not varied, and a 422 naming them is the handler's answer, not the schema's."""

KNOWN_GAPS: dict[tuple[str, str], str] = {}
"""Operations that still refuse schema-valid input (none: the artifact names, telemetry's
``fields`` and the plan's and tune's ``device`` declare their patterns and profiles). An entry
here must be refused, so that the test fails once it is fixed and it is taken off."""


# -- the document's structure ------------------------------------------------------------------


def _walk(node: Any, path: str = "#"):
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.items():
            yield from _walk(sub, f"{path}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            yield from _walk(sub, f"{path}/{i}")


def _schemas(doc: dict):
    """Every schema of the document: components, parameters, request and response bodies."""
    for name, schema in doc["components"]["schemas"].items():
        yield f"components/{name}", schema
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                yield f"{method} {path} {param['name']}", param["schema"]
            bodies = [op.get("requestBody", {})] + list(op["responses"].values())
            for body in bodies:
                for media in body.get("content", {}).values():
                    if "schema" in media:
                        yield f"{method} {path} body", media["schema"]


def test_the_document_is_openapi_3_1_with_tuples_as_prefix_items(client, doc):
    assert doc["openapi"].startswith("3.1.")
    for where, schema in _schemas(doc):
        Draft202012Validator.check_schema(schema)  # an `items: [...]` fails here
        for at, node in _walk(schema):
            assert not isinstance(node.get("items"), list), f"{where} {at}: items is a list"
            assert "additionalItems" not in node, f"{where} {at}: 3.0's additionalItems"
            if "prefixItems" in node:  # a tuple: exactly its positions
                n = len(node["prefixItems"])
                assert node.get("items") is False or node.get("maxItems") == n, (where, at)
                assert node.get("minItems") == n, (where, at)
    pairs = doc["components"]["schemas"]["LimitFields"]["properties"]["pairs"]["items"]
    assert pairs["prefixItems"] == [{"type": "string"}, {"type": "string"}]
    served = client.get("/api/limits/fields").json()["pairs"]
    assert served and all(_valid(doc, pairs, pair) for pair in served)


# -- what the server enforces -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with in_process(tmp_path_factory.mktemp("enforced") / "data") as c:
        yield c


@pytest.fixture(scope="module")
def doc(client) -> dict:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def _resolve(doc: dict, schema: dict) -> dict:
    """``schema`` with its ``$ref`` and single-branch ``allOf`` followed."""
    while "$ref" in schema or len(schema.get("allOf", [])) == 1:
        if "$ref" in schema:
            schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        else:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            schema = {**rest, **schema["allOf"][0]}
    return schema


def _valid(doc: dict, schema: dict, value: Any) -> bool:
    wrapper = {"components": doc["components"], "allOf": [schema]}
    return Draft202012Validator(wrapper).is_valid(value)


def _numbers(s: dict, integer: bool) -> list:
    """0, 1, -1 and each bound with its neighbours (whole numbers for an integer: a client
    sends 1, and JSON Schema's "1.0 is an integer" is out of scope: the limits body refuses
    1.0 as it refuses ``true``, by its description)."""
    out = [0, 1, -1, 2, 1000]
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in s:
            bound = s[key]
            out += [bound, bound + 1, bound - 1] if integer else [bound, bound + 0.5, bound - 0.5]
    if integer:
        return [int(v) for v in out if float(v).is_integer()]
    return [*out, 0.5, 1e-9]


def _candidates(doc: dict, schema: dict, depth: int = 0) -> list:
    """Boundary values of ``schema``, not all of them valid (``_field_values`` keeps those)."""
    s = _resolve(doc, schema)
    out: list = list(s.get("enum", []))
    for branch in s.get("anyOf", []) + s.get("oneOf", []):
        out += _candidates(doc, branch, depth)
    kind = s.get("type")
    if kind == "null":
        out.append(None)
    elif kind == "string":
        out += AWKWARD
        for n in (s.get("minLength"), s.get("maxLength")):
            if n:
                out += [c * n for c in "a0-."] + [",".join(["1"] * n)[:n]]
    elif kind in ("integer", "number"):
        out += _numbers(s, kind == "integer")
    elif kind == "boolean":
        out += [True, False]
    elif kind == "array" and depth < 2:
        if "prefixItems" in s:
            first = [_candidates(doc, p, depth + 1)[:3] for p in s["prefixItems"]]
            out += [list(t) for t in zip(*first, strict=False)]
        else:
            items = _candidates(doc, s.get("items", {}), depth + 1)
            items = [json.loads(i) for i in dict.fromkeys(json.dumps(i) for i in items)]
            out += [[], *[[i] for i in items], *[[i, i] for i in items], items[:2]]
            for n in (s.get("minItems"), s.get("maxItems")):
                if n:
                    out += [items[:n], [items[0]] * n, items[-n:]]
    elif kind == "object":
        out.append({})
    return out


def _field_values(doc: dict, schema: dict, known: list) -> list:
    """The schema-valid values among ``known`` and the boundary values of ``schema``."""
    seen, out = set(), []
    for value in known + _candidates(doc, schema):
        key = json.dumps(value, sort_keys=True)
        if key not in seen and _valid(doc, schema, value):
            seen.add(key)
            out.append(value)
    return out


def _query_text(param: dict, value: Any) -> str:
    """A query value as the parameter's ``style`` writes it (``form``; an array joined by
    commas when ``explode`` is false)."""
    if isinstance(value, list):
        assert param.get("explode") is False, f"{param['name']}: an array without explode: false"
        return ",".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


@pytest.fixture(scope="module")
def known(client) -> dict[str, list]:
    """Known-good values of fields, by name, for the request each variation starts from: two
    queued runs, a user preset, the tiny-ci config. A preset named by a string does not exist,
    nor a device profile (a 404 or a 422 naming them after the schema's checks, before any
    planning)."""
    runs = [client.post("/api/runs", json={"preset": "tiny-ci"}) for _ in range(2)]
    assert [r.status_code for r in runs] == [201, 201], runs[0].text
    config = client.get("/api/presets/tiny-ci").json()["config"]
    # The seeds write "on" (the server takes it too); the schema says a boolean.
    config["memory"]["gradient_checkpointing"] = True
    made = client.post("/api/presets", json={"name": "fuzz-base", "config": config})
    assert made.status_code == 201, made.text
    run_ids = [r.json()["id"] for r in runs]
    return {
        "run_id": [run_ids[0]],
        "tune_id": [MAX_ID],
        "name": ["fuzz-base", "x.png"],
        "ids": [run_ids, ",".join(map(str, run_ids))],
        "preset": ["no-such-preset", {}],
        "config": [config],
        "path": ["/nonexistent"],
        "budget_mb": [1000.0],
        "buckets": [10],
        "prefetch_window_blocks": [1],
    }


def _operations(doc: dict):
    """Every operation, the deletes last (they remove what the others name)."""
    ops = [(m.upper(), p, op) for p, by in doc["paths"].items() for m, op in by.items()]
    return sorted(ops, key=lambda o: o[0] == "DELETE")


def _fields(doc: dict, op: dict) -> list[tuple[str, str, dict, dict]]:
    """(where, name, schema, owner) of every parameter and top-level body field; the owner is
    the parameter, or the body's schema."""
    out = [(p["in"], p["name"], p["schema"], p) for p in op.get("parameters", [])]
    body = op.get("requestBody", {}).get("content", {}).get("application/json")
    if body:
        s = _resolve(doc, body["schema"])
        out += [("body", k, v, s) for k, v in s.get("properties", {}).items()]
    return out


def _start(doc: dict, fields: list, known: dict) -> dict:
    """A request of the operation: its required fields, its body's least fields
    (``minProperties``) and the optional ones with a known value, all schema-valid."""
    start: dict = {}
    for where, name, schema, owner in fields:
        required = owner.get("required") is True
        if where == "body":
            required = name in owner.get("required", []) or len(start) < owner.get(
                "minProperties", 0
            )
        good = [v for v in known.get(name, []) if _valid(doc, schema, v)]
        if required or good and where != "path":
            assert good, f"no known-good value of {name}: add one to known()"
            start[name] = good[0]
    return start


def _send(client, method: str, path: str, values: dict, fields: list):
    url, params, body = path, {}, {}
    for where, name, _, param in fields:
        if name not in values:
            continue
        value = values[name]
        if where == "path":
            url = url.replace("{" + name + "}", quote(str(value), safe=""))
        elif where == "query":
            if value is not None:  # a nullable parameter: null is its absence
                params[name] = _query_text(param, value)
        else:
            body[name] = value
    has_body = any(where == "body" for where, *_ in fields)
    return client.request(method, url, params=params, **({"json": body} if has_body else {}))


def _body_valid(doc: dict, fields: list, values: dict) -> bool:
    """Whether the body of ``values`` is valid as a whole (``anyOf``, ``minProperties``)."""
    schemas = [owner for where, _, _, owner in fields if where == "body"]
    body = {name: values[name] for where, name, *_ in fields if where == "body" and name in values}
    return not schemas or _valid(doc, schemas[0], body)


def _refusals(client, doc: dict, known: dict) -> tuple[dict, int]:
    """(method, path, field) -> the first schema-valid value the server answered 422 to, with
    its message; and how many requests were sent."""
    refused, sent = {}, 0
    for method, path, op in _operations(doc):
        stateful = STATEFUL.get((method, path), set())
        fields = _fields(doc, op)
        if not fields:
            continue  # nothing to vary (and POST /api/assets/build would start a build)
        start = _start(doc, fields, known)
        assert _body_valid(doc, fields, start), (method, path, start)
        variations = [
            (field, value)
            for _, field, schema, _ in fields
            if field not in stateful
            for value in _field_values(doc, schema, known.get(field, []))
        ]
        for name, value in [(None, None), *variations]:
            values = start if name is None else {**start, name: value}
            if not _body_valid(doc, fields, values):
                continue
            resp = _send(client, method, path, values, fields)
            sent += 1
            if resp.status_code == 201 and path.startswith("/api/presets"):
                # A preset named "a" would make every later `preset: "a"` plan a real run.
                client.delete(f"/api/presets/{quote(resp.json()['name'], safe='')}")
            if resp.status_code != 422:
                continue
            error = resp.json()["error"]
            if (error["field"] or "").split(".")[0] in stateful:
                continue
            key = (method, path, name or "(start)")
            refused.setdefault(key, (values if name is None else value, error["message"][:100]))
    return refused, sent


def test_schema_valid_input_is_never_a_422(client, doc, known):
    refused, sent = _refusals(client, doc, known)
    assert sent > 500
    gaps = {(m, p, f) for (m, p), f in KNOWN_GAPS.items()}
    assert gaps <= set(refused), f"fixed, take them off KNOWN_GAPS: {gaps - set(refused)}"
    unexpected = {k: v for k, v in refused.items() if k not in gaps}
    assert unexpected == {}, "\n".join(f"{k}: {v!r}" for k, v in unexpected.items())
