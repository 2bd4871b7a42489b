"""Bad input everywhere gets a 4xx with the one error body; a bounded fuzz of the OpenAPI routes
finds no 5xx. The app runs in-process (``inprocess.in_process``): no worker is started,
runs stay queued."""

from __future__ import annotations

import json
import string

import pytest
from backend_helpers import assert_error_body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess import in_process, raw_request, ws_url
from starlette.websockets import WebSocketDisconnect

from workbench.api.deps import get_probe
from workbench.services.system import SystemProbe


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # One app for the module, as the fuzz tests want the runs and presets of the others.
    with in_process(tmp_path_factory.mktemp("bad") / "data") as c:
        yield c


@pytest.fixture(scope="module")
def data_dir(client):
    return client.app.state.settings.data_dir


def test_error_body_on_every_error_path(client):
    assert_error_body(client.get("/api/nothing-here"), 404)
    assert_error_body(client.delete("/api/system"), 405)
    assert_error_body(client.get("/api/runs/12345"), 404)
    assert_error_body(client.get("/api/runs/abc"), 422)
    assert_error_body(client.get("/api/presets/nope"), 404)
    assert_error_body(client.get("/static/nope.js"), 404)
    err = assert_error_body(
        client.post(
            "/api/runs", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert err["code"] == "malformed_json"
    assert_error_body(client.post("/api/runs", content=b"[1, 2]"), 422)
    err = assert_error_body(client.post("/api/runs", json={"preset": "no-such-preset"}), 404)
    assert err["field"] == "preset"
    err = assert_error_body(client.post("/api/runs", json={"preset": "tiny-ci", "extra": 1}), 422)
    assert err["field"] == "extra"


def test_a_body_that_is_not_a_json_object_says_what_is_expected(client):
    expected = "expected a JSON object body (Content-Type: application/json), got "
    cases = [
        (client.post("/api/runs"), "no body"),
        (
            client.post("/api/presets", content=b"name=x", headers={"content-type": "text/plain"}),
            "Content-Type 'text/plain'",
        ),
        (client.put("/api/presets/tiny-ci", json=[1, 2]), "an array in JSON"),
        (client.patch("/api/runs/1", json="notes"), "a string in JSON"),
    ]
    for response, got in cases:
        err = assert_error_body(response, 422)
        assert (err["field"], err["message"]) == (None, expected + got), err


def test_invalid_overrides_name_the_json_path(client):
    err = assert_error_body(
        client.post(
            "/api/runs",
            json={
                "preset": "tiny-ci",
                "overrides": {
                    "memory": {"stagehand": {"vram_high_watermark_mb": "lots"}},
                    "max_steps": 4,
                },
            },
        ),
        422,
    )
    assert err["field"] == "overrides.memory.stagehand.vram_high_watermark_mb", err
    err = assert_error_body(
        client.post("/api/runs", json={"preset": "tiny-ci", "overrides": {"max_steps": -1}}), 422
    )
    assert err["field"] == "overrides.max_steps"
    err = assert_error_body(
        client.post(
            "/api/runs",
            json={
                "preset": "tiny-ci",
                "overrides": {"data": {"path": "/nonexistent/folder", "factory": None}},
            },
        ),
        422,
    )
    assert err["field"] == "overrides.data.path"
    assert client.get("/api/runs").json() == {"data": [], "count": 0}


def _refused(client, overrides: dict | str) -> dict:
    if isinstance(overrides, str):  # raw JSON text: NaN and Infinity are not JSON objects' values
        body = f'{{"preset": "tiny-ci", "overrides": {overrides}}}'.encode()
        resp = client.post("/api/runs", content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": overrides})
    return assert_error_body(resp, 422)


def test_preset_numbers_bounds_and_rules_are_named_at_the_api(client):
    err = _refused(client, '{"logit_mean": NaN}')
    assert err["field"] == "overrides.logit_mean" and "finite" in err["message"]
    err = _refused(client, '{"memory": {"stagehand": {"vram_high_watermark_mb": Infinity}}}')
    assert err["field"] == "overrides.memory.stagehand.vram_high_watermark_mb"
    err = _refused(client, {"learning_rate": True})
    assert err["message"] == "overrides.learning_rate: found true, expected a valid number"
    err = _refused(client, {"resolution": 100000})
    assert err["message"].endswith("expected less than or equal to 4096")
    err = _refused(client, {"memory": {"stagehand": {"vram_high_watermark_mb": 0.1}}})
    assert err["field"] == "overrides.memory.stagehand.vram_low_watermark_mb"
    assert err["message"] == (
        "overrides.memory.stagehand.vram_low_watermark_mb: vram_low_watermark_mb (0.5) must not "
        "be above vram_high_watermark_mb (0.1)"
    )
    err = _refused(client, {"data": {"captions": "../../etc/passwd"}})
    assert err["field"] == "overrides.data.captions" and "not a path" in err["message"]
    err = _refused(client, {"data": {"factory": None, "path": "tests"}})  # exists here
    assert err["field"] == "overrides.data.path" and "absolute folder path" in err["message"]
    err = _refused(client, {"model": {"factory": None, "path": "/" + "n" * 300}})
    assert err["field"] == "overrides.model.path" and "File name too long" in err["message"]
    assert client.get("/api/runs").json()["count"] == 0


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "a/b", "..", "x\\y", "tab\tname", "x" * 101, ""]
)
def test_path_traversal_and_long_names_are_refused(client, name):
    err = assert_error_body(client.post("/api/runs", json={"preset": "tiny-ci", "name": name}), 422)
    assert err["field"] == "name"
    assert_error_body(client.post("/api/presets", json={"name": name, "config": {}}), 422)


def test_artifacts_by_name_only(client, data_dir):
    # Any run will do: artifacts are looked up by run id + plain file name.
    run = client.post("/api/runs", json={"preset": "tiny-ci"}).json()
    client.post(f"/api/runs/{run['id']}/cancel")
    samples = data_dir / "runs" / str(run["id"]) / "samples"
    samples.mkdir(parents=True)
    (samples / "sample-00.png").write_bytes(b"\x89PNG fake")
    (data_dir / "secret.txt").write_text("no")
    listed = client.get(f"/api/runs/{run['id']}/artifacts").json()
    assert [a["name"] for a in listed["data"]] == ["sample-00.png"]
    got = client.get(f"/api/runs/{run['id']}/artifacts/sample-00.png")
    assert got.status_code == 200 and got.content == b"\x89PNG fake"
    for bad in ["..%2F..%2Fsecret.txt", "%2E%2E", ".hidden", "config.json", "a%00b"]:
        resp = client.get(f"/api/runs/{run['id']}/artifacts/{bad}")
        assert 400 <= resp.status_code < 500, (bad, resp.status_code)
        assert_error_body(resp)
    # The path as written (httpx would normalise the dots away), as uvicorn passes it on.
    for path in ("../../../secret.txt", "..", "../config.json"):
        resp = raw_request(client, "GET", f"/api/runs/{run['id']}/artifacts/{path}")
        assert 400 <= resp.status_code < 500 and b'"error"' in resp.content, (path, resp)


def test_only_regular_files_inside_the_run_folder_are_artifacts(client, data_dir):
    ids = []
    for _ in range(2):
        run = client.post("/api/runs", json={"preset": "tiny-ci"}).json()
        client.post(f"/api/runs/{run['id']}/cancel")
        ids.append(run["id"])
    secret = data_dir / "secret.png"  # outside both run folders, same file system
    secret.write_bytes(b"secret bytes")
    outside = data_dir / "elsewhere"
    outside.mkdir()
    (outside / "leak.png").write_bytes(b"secret bytes")
    samples = data_dir / "runs" / str(ids[0]) / "samples"
    samples.mkdir(parents=True)
    (samples / "ok.png").write_bytes(b"\x89PNG ok")
    (samples / "link.png").symlink_to(secret)
    (samples / "passwd.png").symlink_to("/etc/passwd")
    (samples / "hard.png").hardlink_to(secret)
    (samples / "loop.png").symlink_to(samples / "loop.png")
    # A samples/ folder that is itself a symlink out of the run folder.
    (data_dir / "runs" / str(ids[1]) / "samples").symlink_to(outside)

    listed = client.get(f"/api/runs/{ids[0]}/artifacts").json()
    assert [a["name"] for a in listed["data"]] == ["ok.png"]
    assert client.get(f"/api/runs/{ids[0]}/artifacts/ok.png").content == b"\x89PNG ok"
    for name in ("link.png", "passwd.png", "hard.png", "loop.png"):
        err = assert_error_body(client.get(f"/api/runs/{ids[0]}/artifacts/{name}"), 404)
        assert err["field"] == "name", name
    assert client.get(f"/api/runs/{ids[1]}/artifacts").json() == {"data": [], "count": 0}
    assert_error_body(client.get(f"/api/runs/{ids[1]}/artifacts/leak.png"), 404)


def test_ids_and_since_are_bounded_integers(client):
    huge = "99999999999999999999"  # above 2**64
    for ids in (f"{huge},1", "1,1_0", "1,-2", "1,\u0662"):
        err = assert_error_body(client.get("/api/compare", params={"ids": ids}), 422)
        assert err["field"] == "ids" and "from 1 to 4611686018427387904" in err["message"], ids
    assert_error_body(client.get(f"/api/runs/{huge}"), 422)
    assert_error_body(client.get("/api/runs/1/telemetry", params={"since": 2**63}), 422)
    for path in (f"{huge}/stream", f"1/stream?since={huge}", "\u0661/stream", "1/stream?since=1_0"):
        with client.websocket_connect(ws_url(client, f"/api/runs/{path}")) as ws:
            frame = ws.receive_json()
            assert frame["error"]["code"] == "bad_request", path
            assert "since from -1 to 4611686018427387904" in frame["error"]["message"]
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
            assert closed.value.code == 4400, path


def test_limits_are_strict_numbers_and_name_the_field(client):
    def refused(body) -> dict:
        if isinstance(body, str):
            resp = client.patch(
                "/api/runs/1/limits",
                content=body.encode(),
                headers={"content-type": "application/json"},
            )
        else:
            resp = client.patch("/api/runs/1/limits", json=body)
        return assert_error_body(resp, 422)

    err = refused({"vram_high_watermark_mb": 100, "vram_low_watermark_mb": 200})
    assert err["field"] == "vram_low_watermark_mb"
    assert err["message"] == (
        "vram_low_watermark_mb: vram_low_watermark_mb (200.0) must not be above "
        "vram_high_watermark_mb (100.0)"
    )
    err = refused({"activation_vram_high_watermark_mb": 1, "activation_vram_low_watermark_mb": 2})
    assert err["field"] == "activation_vram_low_watermark_mb"
    assert refused({"vram_high_watermark_mb": True})["field"] == "vram_high_watermark_mb"
    assert refused({"prefetch_window_blocks": "3"})["field"] == "prefetch_window_blocks"
    err = refused('{"vram_low_watermark_mb": NaN}')
    assert err["field"] == "vram_low_watermark_mb" and "finite" in err["message"]
    assert refused({})["message"].startswith("no limits given")


def test_bucket_fields_must_be_dotted_names(client):
    run_id = client.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"]
    url = f"/api/runs/{run_id}/telemetry"
    err = assert_error_body(client.get(url, params={"buckets": 4, "fields": "loss,a'b"}), 422)
    assert err["field"] == "fields" and "a'b" in err["message"]
    client.post(f"/api/runs/{run_id}/cancel")


def test_huge_bodies_get_413(client):
    big = {"preset": "tiny-ci", "overrides": {"pad": "x" * (2 << 20)}}
    err = assert_error_body(client.post("/api/runs", json=big), 413)
    assert err["code"] == "body_too_large"

    # No Content-Length, 40 chunks of 64 KiB: the limit holds for streamed bodies too.
    resp = raw_request(
        client,
        "POST",
        "/api/presets",
        headers={"content-type": "application/json", "transfer-encoding": "chunked"},
        chunks=[b" " * 65536] * 40,
    )
    assert_error_body(resp, 413)


def test_presets_builtin_read_only_and_user_presets_editable(client):
    tiny = client.get("/api/presets/tiny-ci").json()
    assert tiny["builtin"] is True and tiny["config"]["max_steps"] == 8
    assert_error_body(client.put("/api/presets/tiny-ci", json={"config": tiny["config"]}), 403)
    assert_error_body(client.delete("/api/presets/tiny-ci"), 403)
    resp = client.post("/api/presets/tiny-ci/duplicate", json={"name": "mine"})
    assert resp.status_code == 201 and resp.json()["builtin"] is False
    assert_error_body(client.post("/api/presets/tiny-ci/duplicate", json={"name": "mine"}), 409)
    cfg = {**tiny["config"], "max_steps": 5}
    resp = client.put("/api/presets/mine", json={"config": cfg, "description": "five"})
    assert resp.status_code == 200 and resp.json()["config"]["max_steps"] == 5
    err = assert_error_body(
        client.put("/api/presets/mine", json={"config": {**cfg, "resolution": "big"}}), 422
    )
    assert err["field"] == "config.resolution"
    names = [p["name"] for p in client.get("/api/presets").json()["data"]]
    assert "mine" in names and "tiny-ci" in names
    assert client.delete("/api/presets/mine").status_code == 204
    assert_error_body(client.get("/api/presets/mine"), 404)


def test_system_info(client):
    # The real probe (torch/version.py on a CPU build, else torch asked in a subprocess), in
    # place of the app's FixedProbe (tests/backend/test_system_probe.py).
    probe = SystemProbe(client.app.state.executor)
    client.app.dependency_overrides[get_probe] = lambda: probe
    try:
        info = client.get("/api/system").json()
    finally:
        del client.app.dependency_overrides[get_probe]
    assert info["ram_total_mb"] > 100 and info["device"] in ("cpu", "cuda:0")
    assert info["torch_version"].startswith("2.")


def test_data_scan_before_start_names_every_file_left_out(client, tmp_path):
    from tests.worker.messy_data import BAD, LEFT_OUT, USABLE, WARNED, build_messy

    folder = build_messy(tmp_path / "messy")
    runs = client.get("/api/runs").json()["count"]
    data = {"factory": None, "path": str(folder)}
    scan = client.post("/api/data/scan", json={"preset": "tiny-ci", "overrides": {"data": data}})
    assert scan.status_code == 200, scan.text
    found = scan.json()
    assert (found["folder"], found["usable"], found["bad"]) == (str(folder), len(USABLE), len(BAD))
    assert {s["file"] for s in found["skipped"] if s["bad"]} == set(BAD)
    assert {s["file"] for s in found["skipped"] if not s["bad"]} == set(LEFT_OUT)
    assert {w["file"] for w in found["warnings"]} == set(WARNED)
    assert found["problem"] is None and found["on_bad_file"] == "skip"
    strict = {"data": {**data, "on_bad_file": "fail"}}
    found = client.post("/api/data/scan", json={"preset": "tiny-ci", "overrides": strict}).json()
    assert found["problem"].startswith("data.on_bad_file is fail and 4 file(s) cannot be used:")
    digits = client.post("/api/data/scan", json={"preset": "tiny-ci"}).json()
    assert digits["usable"] is None and "built and scanned by the worker" in digits["note"]
    err = assert_error_body(client.post("/api/data/scan", json={"preset": "nope"}), 404)
    assert err["field"] == "preset"
    relative = {"data": {"factory": None, "path": "tests"}}
    err = assert_error_body(
        client.post("/api/data/scan", json={"preset": "tiny-ci", "overrides": relative}), 422
    )
    assert err["field"] == "overrides.data.path"
    assert client.get("/api/runs").json()["count"] == runs  # scanning queues nothing


def test_data_scan_of_a_video_pipeline_takes_its_clips(client, tmp_path):
    """A Wan / LTX-2 run trains on clips: the scan before Start takes them as the worker does
    (before, every clip was "not an image" and the folder had "no usable image")."""
    import json

    from tests.worker.conftest import write_clip

    model = tmp_path / "wan"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    folder = tmp_path / "clips"
    folder.mkdir()
    write_clip(folder / "a.mp4", 3, size_hw=(16, 16))
    (folder / "a.txt").write_text("a clip")
    (folder / "b.mov").write_bytes(b"not a clip")
    overrides = {
        "model": {"factory": None, "path": str(model), "text_encoder_model_name": None},
        "data": {"factory": None, "path": str(folder), "frames": 1},
    }
    scan = client.post("/api/data/scan", json={"preset": "tiny-ci", "overrides": overrides})
    found = scan.json()
    assert (found["usable"], found["bad"], found["problem"]) == (1, 1, None), scan.text
    (bad,) = found["skipped"]
    assert bad["file"] == "b.mov" and bad["reason"].startswith("unreadable clip (")


def test_openapi_lists_every_error_with_the_one_body_and_the_bounds(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ErrorBody" in schemas
    assert set(schemas["ErrorInfo"]["required"]) == {"code", "message", "field", "details"}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = {int(c) for c in op["responses"] if c.startswith(("4", "5"))}
            expected = {401, 403}
            if op.get("parameters") or "requestBody" in op:
                expected.add(422)
            if "requestBody" in op:
                expected |= {400, 413}
            if method in ("post", "put", "patch", "delete"):
                expected.add(413)
            if "{" in path or path in ("/api/compare", "/api/runs") and method != "get":
                expected.add(404)
            assert expected <= codes, (method, path, codes)
            for code in codes:
                assert op["responses"][str(code)]["content"] == error, (method, path, code)
    runs = doc["paths"]["/api/runs/{run_id}"]
    assert {"409"} <= set(runs["delete"]["responses"]) and "409" in (
        doc["paths"]["/api/runs/{run_id}/limits"]["patch"]["responses"]
    )
    run_id = runs["get"]["parameters"][0]["schema"]
    assert (run_id["minimum"], run_id["maximum"]) == (1, 2**62)
    preset = schemas["Preset"]["properties"]
    assert preset["resolution"]["maximum"] == 4096 and preset["batch_size"]["maximum"] == 256
    assert schemas["PresetCreate"]["properties"]["config"]["allOf"] == [
        {"$ref": "#/components/schemas/Preset"}
    ]
    limits = doc["paths"]["/api/runs/{run_id}/limits"]["patch"]["requestBody"]
    assert limits["content"]["application/json"]["schema"]["$ref"].endswith("/LimitsUpdate")


def test_options_says_what_a_path_takes(client):
    for path, allow in (
        ("/api/runs", "GET, OPTIONS, POST"),
        ("/api/runs/1", "DELETE, GET, OPTIONS, PATCH"),
        ("/api/presets/tiny-ci/duplicate", "OPTIONS, POST"),
        ("/static/js/app.js", "GET, HEAD, OPTIONS"),
    ):
        resp = client.options(path, headers={"Origin": "http://evil.example"})
        assert resp.status_code == 204 and resp.headers["allow"] == allow, (path, resp.text)
        assert resp.content == b"" and "access-control-allow-origin" not in resp.headers
    err = assert_error_body(client.delete("/api/system"), 405)
    assert err["code"] == "method_not_allowed"
    assert client.delete("/api/system").headers["allow"] == "GET, OPTIONS"
    post = client.post("/api/runs/1")  # PATCH and DELETE exist there, POST does not
    assert post.status_code == 405 and post.headers["allow"] == "DELETE, GET, OPTIONS, PATCH"
    assert client.post("/").headers["allow"] == client.head("/").headers["allow"] == "GET, OPTIONS"
    assert_error_body(client.options("/api/nothing-here"), 404)


# -- fuzz ----------------------------------------------------------------------------------------
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
EDGES = [2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**20]
"""Integers around the bounds of ids and seqs (2**62) and of SQLite's INTEGER."""
SEGMENT = st.one_of(
    st.integers(-5, 10**20).map(str),
    st.sampled_from(EDGES).map(str),
    st.text(string.ascii_letters + string.digits + "._-%~", min_size=1, max_size=12),
    st.sampled_from(["tiny-ci", "1", "..", "%2e%2e", "-1", "0"]),
)


def _routes(client) -> list[tuple[str, str, dict]]:
    spec = client.get("/openapi.json").json()
    return [
        (method.upper(), path, op)
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
    ]


def test_fuzz_openapi_routes_never_5xx(client):
    routes = _routes(client)
    assert len(routes) >= 15
    seen_5xx: list = []

    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        route=st.sampled_from(routes),
        segs=st.lists(SEGMENT, min_size=3, max_size=3),
        body=JSON,
        query=st.dictionaries(
            st.sampled_from(["since", "limit", "buckets", "ids", "metrics", "status", "tag", "x"]),
            st.text(max_size=12)
            | st.integers(-(2**64), 2**64).map(str)
            | st.sampled_from(EDGES).map(lambda n: f"{n},1"),
            max_size=3,
        ),
        raw=st.booleans(),
    )
    def probe(route, segs, body, query, raw):
        method, path, _ = route
        it = iter(segs)
        url = "".join(next(it) if part.startswith("{") else part for part in _split(path))
        kw = {"params": query}
        if method in ("POST", "PUT", "PATCH"):
            if raw:
                kw["content"] = json.dumps(body)[:-1].encode() or b"{"
                kw["headers"] = {"content-type": "application/json"}
            else:
                kw["json"] = body
        if method == "DELETE" and "runs" in path:
            return  # deleting runs is tested elsewhere; fuzz must not remove the fixtures
        resp = client.request(method, url, **kw)
        if resp.status_code >= 500:
            seen_5xx.append((method, url, kw, resp.status_code, resp.text[:300]))
        if resp.status_code >= 400:
            assert_error_body(resp)

    probe()
    assert seen_5xx == []


def _split(path: str) -> list[str]:
    out, cur = [], ""
    for ch in path:
        if ch == "{":
            out.append(cur)
            cur = "{"
        elif ch == "}":
            out.append(cur + "}")
            cur = ""
        else:
            cur += ch
    return [*out, cur]


BOUNDED = {
    "resolution": 4096,
    "batch_size": 256,
    "max_steps": 10_000_000,
    "lora_rank": 1024,
    "adapter.rank": 1024,
    "learning_rate": 1,
    "logit_std": 10,
    "seed": 2**32 - 1,
    "checkpoint_every": 10_000_000,
    "scheduler.warmup_steps": 10_000_000,
    "samples.steps": 1000,
    "data.frames": 1024,
    "data.max_caption_tokens": 4096,
}
"""Preset numbers and their upper bounds."""


def test_fuzz_preset_numbers_past_their_bounds_are_422_naming_the_field(client):
    offending = st.one_of(
        st.sampled_from(sorted(BOUNDED.items())).flatmap(
            lambda item: st.tuples(
                st.just(item[0]), st.integers(item[1] + 1, item[1] * 10**12).map(json.dumps)
            )
        ),
        st.tuples(
            st.sampled_from(sorted(BOUNDED)),
            st.sampled_from(["true", "false", '"4"', '"1e3"', "NaN", "Infinity", "-Infinity"]),
        ),
    )

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=offending)
    def probe(case):
        path, value = case
        overrides = value
        for key in reversed(path.split(".")):
            overrides = f'{{"{key}": {overrides}}}'
        body = f'{{"preset": "tiny-ci", "overrides": {overrides}}}'.encode()
        resp = client.post("/api/runs", content=body, headers={"content-type": "application/json"})
        err = assert_error_body(resp, 422)
        assert f"overrides.{path}" in {d["field"] for d in err["details"]}, (path, value, err)

    before = client.get("/api/runs").json()["count"]
    probe()
    assert client.get("/api/runs").json()["count"] == before  # not one run was queued
