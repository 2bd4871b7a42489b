"""What an attacker's requests found: deep JSON, sizes no machine has, ids that are
not plain integers. Every answer is a 4xx with the one error body naming the limit or the field;
the app runs in-process (``inprocess.in_process``): no worker is started."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from backend_helpers import assert_error_body
from inprocess import IdleExecutor, append_records, in_process

from stagehand.config.memory import MAX_MB
from workbench.api.security import MAX_JSON_DEPTH


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with in_process(tmp_path_factory.mktemp("hard") / "data") as c:
        yield c


def _body_routes(client) -> list[tuple[str, str]]:
    """Every (method, path) of the OpenAPI document that takes a JSON body, ids filled with 1."""
    spec = client.get("/openapi.json").json()
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if "requestBody" in op:
                url = path.replace("{run_id}", "1").replace("{tune_id}", "1")
                out.append((method.upper(), url.replace("{name}", "tiny-ci")))
    return out


def _nested(depth: int) -> bytes:
    """``{"preset": "tiny-ci", "overrides": {"a": {"a": ... 1 ...}}}``, ``depth`` levels in all."""
    inner = '{"a": ' * (depth - 1) + "1" + "}" * (depth - 1)
    return f'{{"preset": "tiny-ci", "overrides": {inner}}}'.encode()


def test_deep_json_is_one_422_stating_the_limit_on_every_body_route(client):
    routes = _body_routes(client)
    assert len(routes) >= 8 and ("POST", "/api/runs") in routes
    headers = {"content-type": "application/json"}
    for depth in (MAX_JSON_DEPTH + 1, 500, 980, 5000):
        for method, url in routes:
            resp = client.request(method, url, content=_nested(depth), headers=headers)
            err = assert_error_body(resp, 422)
            assert err["code"] == "json_too_deep", (method, url, depth, err)
            assert f"the limit is {MAX_JSON_DEPTH}" in err["message"]
    # Nothing was created, and the limit itself is let through to the ordinary checks.
    assert client.get("/api/runs").json()["count"] == 0
    resp = client.post("/api/runs", content=_nested(MAX_JSON_DEPTH), headers=headers)
    err = assert_error_body(resp, 422)
    assert err["code"] == "validation_error" and err["field"].startswith("overrides.a")
    # Brackets inside strings do not nest.
    flat = json.dumps({"preset": "tiny-ci", "overrides": {"name": "[{" * 2000}}).encode()
    resp = client.post("/api/runs", content=flat, headers=headers)
    assert assert_error_body(resp, 422)["field"] == "overrides.name"


ACT = "memory.stagehand.activation_stagehand"
MB_FIELDS = (
    "memory.stagehand.vram_high_watermark_mb",
    "memory.stagehand.pinned_pool_mb",
    "memory.stagehand.host_cache_mb",
    "memory.stagehand.reader_min_block_mb",
    f"{ACT}.vram_high_watermark_mb",
    f"{ACT}.pinned_growth_budget_mb",
    f"{ACT}.min_spill_bytes",
    f"{ACT}.recompute_threshold_bytes",
    "memory.stagehand.conductor_config.pinned_budget_mb",
)


@pytest.mark.parametrize("raw", ["1e308", "1" * 401, str(MAX_MB * 2**20 * 2)])
def test_sizes_no_machine_has_are_refused_naming_the_field(client, raw):
    for path in MB_FIELDS:
        value = raw
        for key in reversed(path.split(".")):
            value = f'{{"{key}": {value}}}'
        body = f'{{"preset": "tiny-ci", "overrides": {value}}}'.encode()
        resp = client.post("/api/runs", content=body, headers={"content-type": "application/json"})
        err = assert_error_body(resp, 422)
        assert err["field"] == f"overrides.{path}", (path, err)
        unit = "bytes" if path.endswith("_bytes") else "MB"
        bound = MAX_MB * 2**20 if unit == "bytes" else MAX_MB
        assert f"at most {bound} {unit}" in err["message"], err
    assert client.get("/api/runs").json()["count"] == 0


def test_live_limits_past_any_machine_are_refused_before_the_run_sees_them(client):
    for raw in ("1e308", "1" * 401):
        for field in ("activation_vram_high_watermark_mb", "vram_low_watermark_mb"):
            resp = client.patch(
                "/api/runs/1/limits",
                content=f'{{"{field}": {raw}}}'.encode(),
                headers={"content-type": "application/json"},
            )
            err = assert_error_body(resp, 422)
            assert err["field"] == field and f"at most {MAX_MB} MB" in err["message"], err


def test_the_schema_states_the_size_bounds(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    limits = schemas["LimitsUpdate"]["properties"]["vram_high_watermark_mb"]
    assert {"maximum": MAX_MB} in [
        {k: v for k, v in alt.items() if k == "maximum"} for alt in limits["anyOf"]
    ]


def test_trials_of_one_tune_run_one_after_another_without_slots_of_ours(api_factory):
    """Ray's default (``--executor ray`` without ``--max-parallel``): no slots of ours."""
    executor = IdleExecutor(slots=float("inf"))
    client = api_factory(executor=executor)
    body = {"preset": "tiny-ci", "budget_mb": 3, "device": "rtx4090", "max_trials": 3}
    trials = [t["run_id"] for t in client.post("/api/tunes", json=body).json()["trials"]]
    other = client.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"]
    assert len(trials) == 3
    started = []
    for run_id in trials:
        _wait_status(client, run_id, "running")
        time.sleep(0.5)  # five supervisor ticks: no other trial starts meanwhile
        status = {r: client.get(f"/api/runs/{r}").json()["status"] for r in [*trials, other]}
        assert [r for r in trials if status[r] == "running"] == [run_id], status
        assert status[other] == "running"  # a run of no tune is not held back
        started.append(run_id)
        executor.end(run_id)
    assert started == trials


def _wait_status(client, run_id: int, status: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get(f"/api/runs/{run_id}").json()["status"] != status:
        assert time.monotonic() < deadline, (run_id, status)
        time.sleep(0.05)


@pytest.mark.parametrize("raw", ["1_0", "1.0", "%201", "+1", "%D9%A1", "01x"])
def test_ids_are_plain_integers_on_every_route(client, raw):
    """``1_0`` read as 10, ``1.0`` and `` 1`` as 1 by HTTP routes, refused by the websocket
    and ``/api/compare``: now refused everywhere, naming the parameter."""
    for url, field in (
        (f"/api/runs/{raw}", "run_id"),
        (f"/api/runs/{raw}/telemetry", "run_id"),
        (f"/api/runs/{raw}/limits", "run_id"),
        (f"/api/tunes/{raw}", "tune_id"),
        (f"/api/runs/1/telemetry?since={raw}", "since"),
    ):
        err = assert_error_body(client.get(url), 422)
        assert err["field"] == field and "ASCII digits" in err["message"], (url, err)


def test_the_schema_states_names_and_ids_formats(client):
    from workbench.api.models import NAME_RE

    doc = client.get("/openapi.json").json()
    props = doc["components"]["schemas"]
    for model in ("PresetCreate", "PresetDuplicate", "TunePreset"):
        name = props[model]["properties"]["name"]
        assert (name["pattern"], name["maxLength"]) == (NAME_RE.pattern, 64), model
    run_name = props["RunCreate"]["properties"]["name"]["anyOf"][0]
    assert run_name["maxLength"] == 100
    params = {p["name"]: p for p in doc["paths"]["/api/compare"]["get"]["parameters"]}
    ids = params["ids"]
    assert (ids["style"], ids["explode"], ids["schema"]["type"]) == ("form", False, "array")
    assert ids["schema"]["items"] == {"type": "integer", "minimum": 1, "maximum": 2**62}
    preset = doc["paths"]["/api/presets/{name}"]["get"]["parameters"][0]["schema"]
    assert preset["pattern"] == NAME_RE.pattern


def test_a_file_name_that_is_not_utf8_is_shown_escaped_and_never_breaks_the_runs_list(
    api_factory, tmp_path
):
    """``c_\\xff.png`` made the scan a 500; a run failed on it made ``/api/runs``, one run and
    ``/api/compare`` 500 (``surrogates not allowed``) until the run was deleted."""
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    with open(os.path.join(os.fsencode(folder), b"c_\xff.png"), "wb") as f:
        f.write(b"not a png")
    executor = IdleExecutor(slots=2)
    client = api_factory(executor=executor)
    data = {"factory": None, "path": str(folder), "on_bad_file": "fail"}
    resp = client.post("/api/data/scan", json={"preset": "tiny-ci", "overrides": {"data": data}})
    assert resp.status_code == 200, resp.text
    found = resp.json()
    assert found["skipped"] == [
        {"file": "c_\\xff.png", "reason": "not an image Pillow can read", "bad": True}
    ]
    assert found["usable"] == 1 and found["problem"].endswith(
        "\n  c_\\xff.png: not an image Pillow can read"
    )

    # A worker's error record that names the file as Python read it (a lone surrogate).
    failed, other = (
        client.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"] for _ in "ab"
    )
    _wait_status(client, failed, "running")
    message = "data.on_bad_file is fail and 1 file(s) cannot be used:\n  c_\udcff.png: bad"
    error = {"source": "trainer", "kind": "error", "step": None, "phase": None}
    error.update(seq=0, time=1.0, message=message, error_type="DataError", traceback="c_\udcff")
    append_records(client.app.state.settings.data_dir, failed, [error])
    time.sleep(0.3)  # the tailer's poll: the record is stored before the exit is seen
    executor.end(failed, 1)
    _wait_status(client, failed, "failed")
    shown = "data.on_bad_file is fail and 1 file(s) cannot be used:\n  c_\\xff.png: bad"
    for url in ("/api/runs", "/api/runs?status=failed", f"/api/runs/{failed}"):
        resp = client.get(url)
        assert resp.status_code == 200, (url, resp.text)
        run = resp.json()["data"][-1] if "data" in resp.json() else resp.json()
        assert run["id"] == failed and run["error"]["message"] == shown, url
        assert run["error"]["traceback"] == "c_\\xff"
    resp = client.get(f"/api/compare?ids={failed},{other}")
    assert resp.status_code == 200, resp.text
    assert resp.json()["runs"][0]["error"]["message"] == shown


def test_the_log_route_reads_only_the_run_folders_own_worker_log(client, tmp_path):
    """``worker.log`` replaced by a symlink (or a second name) of a file outside the data
    folder, or a run folder that is a symlink, was served: the artifact routes' rule now."""
    runs_dir = client.app.state.settings.runs_dir
    secret = tmp_path / "secret.txt"
    secret.write_text("root:SECRET\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "worker.log").write_text("SECRET from elsewhere\n")
    ids = [client.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"] for _ in range(4)]
    own, link, hard, linked_dir = ids
    (runs_dir / str(own) / "worker.log").write_text("step 1/3\n")
    (runs_dir / str(link) / "worker.log").symlink_to(secret)
    (runs_dir / str(hard) / "worker.log").hardlink_to(secret)
    shutil.rmtree(runs_dir / str(linked_dir))  # its config.json, written when it was queued
    (runs_dir / str(linked_dir)).symlink_to(elsewhere)

    assert client.get(f"/api/runs/{own}/log").json() == {"text": "step 1/3\n"}
    for run_id in (link, hard, linked_dir):
        resp = client.get(f"/api/runs/{run_id}/log")
        assert resp.status_code == 200 and resp.json() == {"text": None}, (run_id, resp.text)


def test_a_path_the_file_system_refuses_is_a_422_naming_the_field(client, tmp_path):
    """A 300-character name (over the file system's 255 bytes) was ``OSError: File name too
    long``, a 500."""
    long = "a" * 300
    for path in (f"/tmp/{long}", f"{tmp_path}/{long}/pipe"):
        err = assert_error_body(client.post("/api/pipelines/inspect", json={"path": path}), 422)
        assert err["field"] == "path", err
        assert err["message"].startswith("path: cannot read '") and err["message"].endswith(
            "'... (File name too long)"
        )
    # The single-file transformer is checked after the folder: a pipeline folder's layout.
    components = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2")
    components += ("tokenizer_2", "transformer")
    folder = tmp_path / "flux"
    for name in components:
        (folder / name).mkdir(parents=True)
    index = {name: ["diffusers", "X"] for name in components}
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", **index}))
    body = {"path": str(folder), "transformer_path": f"{tmp_path}/{long}.safetensors"}
    err = assert_error_body(client.post("/api/pipelines/inspect", json=body), 422)
    assert err["field"] == "transformer_path" and "(File name too long)" in err["message"], err


LIVE_INTS = {
    "prefetch_window_blocks": ("memory.stagehand", 128),
    "max_inflight_transfers": ("memory.stagehand", 64),
    "max_inflight_d2h": ("memory.stagehand.activation_stagehand", 64),
    "max_inflight_h2d": ("memory.stagehand.activation_stagehand", 64),
}
"""The integer live limits -> (their config section, their bound)."""


def _under(path: str, value) -> dict:
    out = value
    for key in reversed(path.split(".")):
        out = {key: out}
    return out


def test_integer_live_limits_have_an_upper_bound_everywhere_they_are_set(client):
    """``{"max_inflight_d2h": 10**400}`` was accepted and applied, in a PATCH, a new run's
    config and ``/api/plan``."""
    import copy

    from workbench.worker.preset import load_preset

    _, preset = load_preset("tiny-ci")
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    runs = client.get("/api/runs").json()["count"]  # the module's earlier tests made some
    for field, (section, bound) in LIVE_INTS.items():
        for value in (10**400, bound + 1):
            resp = client.patch("/api/runs/1/limits", json={field: value})
            err = assert_error_body(resp, 422)
            assert err["field"] == field and f"less than or equal to {bound}" in err["message"]
            overrides = _under(f"{section}.{field}", value)
            resp = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": overrides})
            err = assert_error_body(resp, 422)
            assert err["field"] == f"overrides.{section}.{field}", err
            planned = copy.deepcopy(preset)
            where = planned.setdefault("memory", {}).setdefault("stagehand", {})
            if section.endswith("activation_stagehand"):
                where = where.setdefault("activation_stagehand", {})
            where[field] = value
            body = {"preset": planned, "device": "rtx4090"}  # no CPU profile measured
            err = assert_error_body(client.post("/api/plan", json=body), 422)
            assert err["field"] == f"preset.{section}.{field}", err
        alternatives = schemas["LimitsUpdate"]["properties"][field]["anyOf"]
        assert alternatives[0]["maximum"] == bound and "at most" in alternatives[0]["description"]
    assert client.get("/api/runs").json()["count"] == runs  # no refused run was created
