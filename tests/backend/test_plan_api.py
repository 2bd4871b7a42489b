"""``POST /api/plan`` on the app in-process (no server process): a plan of the tiny factory
model, and the one error body naming the field for bad input."""

from __future__ import annotations

import shutil
import struct

import pytest
from fastapi.testclient import TestClient
from inprocess import in_process

TINY = {
    "model": {"factory": "flux", "size": "tiny", "dtype": "float32"},
    "adapter": {"rank": 4},
    "resolution": 64,
    "batch_size": 1,
    "memory": {
        "strategy": "stagehand",
        "gradient_checkpointing": False,
        "stagehand": {
            "pinned_pool_mb": 8,
            "pinned_slab_mb": 1,
            "vram_high_watermark_mb": 1.5,
            "vram_low_watermark_mb": 1.0,
        },
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    with in_process(tmp_path_factory.mktemp("plan") / "data") as c:  # no calibrations
        yield c


def test_plan_of_the_tiny_model(client):
    res = client.post("/api/plan", json={"preset": TINY, "device": "rtx4090"})
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["fits"] is True and out["device"]["name"] == "rtx4090"
    assert out["model"]["n_blocks"] == 4
    low, high = out["steady_band_bytes"]
    assert out["model"]["resident_bytes"] <= low < high == out["peak_bytes"]["steady"]
    # Streaming under a 1.5 MB high watermark: the peak stays below everything resident.
    assert high < out["model"]["param_bytes"]
    assert len(out["curve"]["t_ms"]) == len(out["curve"]["bytes"]) > 8


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"preset": TINY, "device": "gtx480"}, "device"),
        ({"preset": {**TINY, "batch_size": 0}}, "preset.batch_size"),
        (
            {"preset": {**TINY, "memory": {"strategy": "stagehand", "stagehand": {"x": 1}}}},
            "preset.memory.stagehand.x",
        ),
        ({"preset": TINY, "vram_gb": -1}, "vram_gb"),
    ],
)
def test_bad_input_is_one_error_body_naming_the_field(client, body, field):
    res = client.post("/api/plan", json=body)
    assert res.status_code == 422, res.text
    error = res.json()["error"]
    assert field in (error["field"] or "") and error["message"]


def test_a_pipeline_header_length_past_its_file_is_a_422_naming_it(client, asset_cache, tmp_path):
    """Read as is, the 2^62-byte header was a ``MemoryError``: a 500 with an empty message."""
    from tests.fixtures.pipelines import build_pipeline

    folder = shutil.copytree(build_pipeline("flux", asset_cache), tmp_path / "flux")
    shard = sorted((folder / "transformer").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    shard.write_bytes(bytes(data))
    named = f"{shard}: header length 4611686018427387904 bytes, but the file holds"
    res = client.post("/api/pipelines/inspect", json={"path": str(folder)})
    assert res.status_code == 422, res.text
    error = res.json()["error"]
    assert error["field"] == "path" and error["message"].startswith(named)
    preset = {**TINY, "model": {"path": str(folder), "dtype": "float32"}}
    res = client.post("/api/plan", json={"preset": preset, "device": "rtx4090"})
    assert res.status_code == 422, res.text
    assert named in res.json()["error"]["message"]


@pytest.mark.parametrize(
    ("flag", "raw"),
    [
        ("--vram-gb", "inf"),
        ("--vram-gb", "1e308"),
        ("--vram-gb", "1e-300"),
        ("--text-len", "-1"),
        ("--text-len", "4097"),
        ("--tflops", "nan"),
        ("--h2d-gbps", "nan"),
        ("--disk-gbps", "nan"),
        ("--efficiency", "nan"),
        ("--efficiency", "0"),
        ("--efficiency", "-1"),
        ("--efficiency", "1.5"),
        ("--tflops", "1e-300"),
    ],
)
def test_plan_cli_refuses_absurd_inputs_naming_the_flag(flag, raw, capsys):
    """Tracebacks (``inf``, ``1e308``, ``--text-len -1``) and "nan ms ... fits: yes" with exit 0
    before; now argparse's usage error, naming the flag, before anything is planned."""
    from workbench.cli.plan import main

    with pytest.raises(SystemExit) as done:
        main(["tiny-ci", "--device", "rtx4090", "--no-calibration", flag, raw])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected " in err and err.endswith(f"got {raw!r}\n"), err
    assert "Traceback" not in err


def test_plan_cli_takes_inputs_at_their_bounds(capsys):
    from workbench.cli.plan import main

    args = ["tiny-ci", "--device", "rtx4090", "--no-calibration", "--efficiency", "1"]
    assert main([*args, "--text-len", "1", "--vram-gb", "4096", "--tflops", "1e5"]) == 0
    assert "fits: yes" in capsys.readouterr().out


@pytest.mark.parametrize("field", ["vram_gb", "tflops", "h2d_gbps", "disk_gbps"])
def test_plan_api_profile_overrides_are_bounded_and_finite(client, field):
    """``1e-300`` overrides planned a 0.0 ms step beside a 1.7e300 ms trace step."""
    from workbench.contract.plan_inputs import OVERRIDES

    low, high, _ = OVERRIDES[field]
    for value in ("1e-300", "NaN", "Infinity", str(high * 2)):
        body = f'{{"preset": {{}}, "device": "rtx4090", "{field}": {value}}}'
        res = client.post("/api/plan", content=body, headers={"content-type": "application/json"})
        assert res.status_code == 422, (value, res.text)
        assert res.json()["error"]["field"] == field
    res = client.post("/api/plan", json={"preset": TINY, "device": "rtx4090", field: low})
    assert res.status_code == 200, res.text
    assert all(v < 1e12 for v in res.json()["step_ms"].values())


def test_profile_refuses_overrides_that_are_not_finite():
    from workbench.plan import PlanInputError, profile

    for value in (float("nan"), float("inf"), 0.0):
        with pytest.raises(PlanInputError, match=r"^tflops must be a finite number > 0"):
            profile("rtx4090", tflops=value)


def test_first_cpu_plans_at_once_measure_the_machine_once_and_say_so(client, tmp_path, monkeypatch):
    """The first plans on ``cpu`` measure this machine (tens of seconds). Two asked at once
    (a double click, two tabs) wait for one measurement; while it runs,
    ``GET /api/plan/cpu-profile`` says a plan is measuring, which the New run page shows."""
    import threading
    import time

    from workbench.plan import profiles

    monkeypatch.setenv("STAGEHAND_WORKBENCH_CACHE", str(tmp_path / "cache"))
    profiles.stored_cpu_profile.cache_clear()
    measured = profiles.DeviceProfile(  # a stand-in for this machine's figures
        "cpu",
        0,
        0.03,
        2.0,
        "measured on this machine (1 threads, float32)",
        mem_gbps=3.0,
        op_us=300.0,
        load_us=3000.0,
        tracked=True,
        synchronous_copies=True,
    )
    calls: list[float] = []
    started = threading.Event()

    def slow_measure(dtype: str = "float32") -> profiles.DeviceProfile:
        calls.append(time.monotonic())
        started.set()
        time.sleep(1.5)
        return measured

    monkeypatch.setattr(profiles, "cpu_profile", slow_measure)
    before = client.get("/api/plan/cpu-profile").json()
    assert before == {
        "will_measure": True,
        "measuring": False,
        "measurements": 0,
        "wanted": profiles.MEASUREMENTS,
        "measure_s": None,
    }
    answers: list = []

    def plan() -> None:
        answers.append(client.post("/api/plan", json={"preset": TINY, "device": "cpu"}))

    threads = [threading.Thread(target=plan) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        during = client.get("/api/plan/cpu-profile").json()
        assert during["measuring"] is True and during["will_measure"] is True
        for t in threads:
            t.join(60)
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert len(calls) == 1  # one measurement for both plans
        after = client.get("/api/plan/cpu-profile").json()
        assert after["will_measure"] is False and after["measuring"] is False
        assert after["measurements"] == 1
        # A new process would measure again (1 of 3 stored), and the page would say how long
        # the last one took.
        profiles.stored_cpu_profile.cache_clear()
        fresh = client.get("/api/plan/cpu-profile").json()
        assert fresh["will_measure"] is True and fresh["measurements"] == 1
        assert 1.5 <= fresh["measure_s"] < 30
    finally:
        profiles.stored_cpu_profile.cache_clear()
