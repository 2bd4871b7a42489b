"""A plan's ``cpu`` profile is one per machine: the median of its first three measurements,
stored in the workbench cache (NOTE [ One CPU profile per machine ] in
``backend/workbench/plan/profiles.py``). Measurements are stand-ins here (a real one takes seconds to
minutes): the figures two servers measured on one machine, and a third."""

from __future__ import annotations

import json

import pytest

from workbench.plan import profiles

OPS_US = (257.6, 668.5, 300.0)
"""us per operation: the two servers' figures, then a third measurement."""


def _measured(op_us: float) -> profiles.DeviceProfile:
    return profiles.DeviceProfile(
        "cpu",
        0,
        0.03 * op_us / 300,
        2.0,
        "measured on this machine (1 threads, float32)",
        mem_gbps=3.0,
        op_us=op_us,
        load_us=10 * op_us,
        tracked=True,
        synchronous_copies=True,
    )


@pytest.fixture
def processes(monkeypatch, tmp_path):
    """``new_process()``: ``profile("cpu")`` as a fresh process plans it (nothing cached in
    memory), each measurement the next of ``OPS_US`` (round and round); ``calls`` counts the
    measurements."""
    monkeypatch.setenv("STAGEHAND_WORKBENCH_CACHE", str(tmp_path))
    calls = []

    def measure(dtype: str = "float32") -> profiles.DeviceProfile:
        calls.append(dtype)
        return _measured(OPS_US[(len(calls) - 1) % len(OPS_US)])

    monkeypatch.setattr(profiles, "cpu_profile", measure)

    def new_process() -> profiles.DeviceProfile:
        if hasattr(profiles, "stored_cpu_profile"):
            profiles.stored_cpu_profile.cache_clear()
        return profiles.profile("cpu")

    yield new_process, calls
    if hasattr(profiles, "stored_cpu_profile"):
        profiles.stored_cpu_profile.cache_clear()


def test_every_process_on_a_machine_plans_with_one_bounded_cpu_profile(processes, tmp_path):
    new_process, calls = processes
    seen = [new_process() for _ in range(5)]
    # Measured by the first three processes only; then the median of the three, for every one.
    assert [p.op_us for p in seen] == [257.6, 463.05, 300.0, 300.0, 300.0]
    assert len(calls) == 3
    assert seen[4] == seen[3] and seen[4].load_us == 3000.0 and seen[4].tflops == 0.03
    assert seen[4].measured == {
        "path": str(tmp_path / "cpu-profile.json"),
        "count": 3,
        "wanted": 3,
        "values": {
            "tflops": pytest.approx([0.02576, 0.06685, 0.03]),
            "h2d_gbps": [2.0, 2.0, 2.0],
            "mem_gbps": [3.0, 3.0, 3.0],
            "op_us": list(OPS_US),
            "load_us": pytest.approx([2576.0, 6685.0, 3000.0]),
            "disk_gbps": [None, None, None],
        },
    }
    assert seen[4].source.startswith("median of 3 measurements of 3 on this machine")
    # Another machine (here: another torch thread count) starts again.
    stored = json.loads((tmp_path / "cpu-profile.json").read_text())
    stored["machine"]["threads"] += 1
    (tmp_path / "cpu-profile.json").write_text(json.dumps(stored))
    assert new_process().op_us == 257.6 and len(calls) == 4  # measured afresh
    # A file that is not one (edited by hand, torn): measured again, not a traceback.
    key = json.loads((tmp_path / "cpu-profile.json").read_text())["machine"]
    for measurements in (5, [{"name": "cpu"}, "x"]):
        torn = {"machine": key, "measurements": measurements}
        (tmp_path / "cpu-profile.json").write_text(json.dumps(torn))
        new_process()
    assert len(calls) == 6


def test_the_plan_shows_the_profile_and_its_measurements(processes):
    """``workbench plan`` prints ``profile_line`` under its header (the source: how many
    measurements, stored where); ``POST /api/plan`` returns ``device`` as ``to_dict``."""
    from workbench.plan.table import profile_line

    new_process, _ = processes
    for _ in range(3):
        cpu = new_process()
    assert profile_line(cpu.to_dict()) == (
        "  profile      0.03 TFLOPs, H2D 2 GB/s, memory 3 GB/s, 300 us/op, 3000 us/load "
        "(us/op measured: 257.6, 668.5, 300; 3 of 3 stored)"
    )
    assert cpu.to_dict()["measured"]["values"]["op_us"] == list(OPS_US)
    assert profile_line(profiles.PROFILES["rtx4090"].to_dict()) == (
        "  profile      165.2 TFLOPs, H2D 25 GB/s, memory 1008 GB/s"
    )
