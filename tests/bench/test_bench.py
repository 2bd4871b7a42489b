"""``workbench bench --model tiny --quick``: the JSON has every field and sane values.

Speed is not asserted here (house rule: figures go in the benchmark's output, not in tests).
"""

from __future__ import annotations

import json

import pytest

from workbench.bench.cli import main, parse_args
from workbench.bench.configs import CPU_PEER_NOTE
from workbench.bench.probes import overlap_us, union_us
from workbench.bench.report import add_ratios, table, timeline_text

MAIN_ROWS = [
    "baseline",
    "stream_module",
    "stream_file",
    "stream_file_readers",
    "spill_keep",
    "spill_all",
    "spill_predictive",
    "conductor",
    "layer_offload_0.5",
    "layer_offload_0.9",
    "peer_group_offload",
    "peer_group_offload_stream",
    "peer_save_on_cpu",
]
SCALE = [2, 4, 8, 16]
STEPS = 2
OK_FIELDS = [
    "step_ms_median",
    "step_ms",
    "ratio_to_baseline",
    "phase_ms_median",
    "loss",
    "vram_peak_bytes",
    "vram_source",
    "vram_method",
    "rss_after_imports_bytes",
    "rss_peak_bytes",
    "rss_growth_bytes",
    "h2d_bytes_per_step",
    "d2h_bytes_per_step",
    "bytes_source",
    "stall_ms_per_step",
    "bound_ms",
    "ratio_to_bound",
    "telemetry",
    "steps",
    "warmup",
    "summary",
]
TOP_FIELDS = [
    "kind",
    "format",
    "created_at",
    "wall_s",
    "argv",
    "quick",
    "steps",
    "warmup",
    "device",
    "model",
    "large_model",
    "keep_path_us_per_tensor",
    "rows",
    "scale_rows",
    "large_rows",
    "goals",
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory, asset_cache) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = [
        "--model",
        "tiny",
        "--quick",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--cache-dir",
        str(asset_cache),
        "--steps",
        str(STEPS),
        "--warmup",
        "1",
        "--rounds",
        "1",
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_row(row: dict) -> None:
    assert row["status"] in ("ok", "n/a", "error")
    if row["status"] == "n/a":
        assert row["reason"].startswith(("not built:", "needs CUDA")), row["reason"]
        return
    assert row["status"] == "ok", f"{row['name']}: {row['reason']}"
    missing = [f for f in OK_FIELDS if f not in row]
    assert not missing, f"{row['name']} lacks {missing}"
    assert row["step_ms_median"] > 0
    assert row["ratio_to_baseline"] > 0
    assert row["vram_peak_bytes"] > 0
    assert row["rss_peak_bytes"] >= row["rss_after_imports_bytes"] > 0
    assert row["steps"] == STEPS
    assert len(row["step_ms"]) == STEPS * row["runs"]
    assert row["h2d_bytes_per_step"] is None or row["h2d_bytes_per_step"] >= 0


def test_top_level_and_main_rows(bench):
    assert [f for f in TOP_FIELDS if f not in bench] == []
    assert bench["kind"] == "bench" and bench["device"]["type"] == "cpu"
    # The planner's profile of the machine, measured by the bench before its rows (workbench.plan.check).
    profile = bench["cpu_profile"]
    assert profile["tracked"] is True and profile["tflops"] > 0 and profile["op_us"] > 0
    assert bench["model"]["n_blocks"] == 4 and bench["model"]["param_bytes"] > 0
    assert [r["name"] for r in bench["rows"]] == MAIN_ROWS
    for row in bench["rows"]:
        _check_row(row)
    base = bench["rows"][0]
    assert base["status"] == "ok" and base["runs"] == 2  # first and last
    assert base["ratio_to_baseline"] == 1.0
    assert base["h2d_bytes_per_step"] == 0.0 and base["vram_source"] == "counted"
    # The counted baseline holds at least every parameter.
    assert base["vram_peak_bytes"] > bench["model"]["param_bytes"]


def test_our_rows_read_the_runtimes_telemetry(bench):
    ours = [r for r in bench["rows"] if r["group"] == "ours" and r["status"] == "ok"]
    for row in ours:
        assert row["vram_source"] == "tracked"
        assert row["bytes_source"] == "telemetry", row["name"]
        if row["memory_config"]["strategy"] == "stagehand":
            # Every block is loaded at least once per step: H2D covers the block bytes.
            assert row["h2d_bytes_per_step"] >= bench["model"]["block_bytes"]
            assert row["stall_ms_per_step"] >= 0


def test_peers_on_cpu_are_marked(bench):
    peers = [r for r in bench["rows"] if r["group"] == "peer"]
    assert len(peers) == 3
    for row in peers:
        assert CPU_PEER_NOTE in row["notes"]
    stream = next(r for r in peers if r["name"] == "peer_group_offload_stream")
    assert stream["status"] == "n/a" and stream["reason"] == "needs CUDA"
    save = next(r for r in peers if r["name"] == "peer_save_on_cpu")
    assert save["status"] == "ok" and save["d2h_bytes_per_step"] > 0


def test_scale_rows(bench):
    scale = bench["scale_rows"]
    assert sorted({r["blocks"] for r in scale}) == SCALE
    for row in scale:
        _check_row(row)
    base = {r["blocks"]: r for r in scale if r["name"] == "baseline"}
    assert all(base[n]["ratio_to_baseline"] == 1.0 for n in SCALE)
    # Resident weights grow with blocks: the all-resident baseline's VRAM must too.
    peaks = [base[n]["vram_peak_bytes"] for n in SCALE]
    assert peaks == sorted(peaks) and peaks[-1] > 4 * peaks[0]


def test_goals_are_reported(bench):
    names = [g["name"] for g in bench["goals"]]
    assert len(names) == 8
    transition = next(g for g in bench["goals"] if g["name"] == "block transition overhead")
    us = bench["transition"]["us_per_transition"]
    assert transition["measured"] == f"{us:.0f} us" and us > 0  # measured, not a placeholder
    cuda_goals = [g for g in bench["goals"] if "needs CUDA" in g["note"]]
    assert len(cuda_goals) == 2 and all(g["met"] is None for g in cuda_goals)
    # On CPU the streaming rows are held to the copy bound the bench measured on this machine.
    assert bench["device"]["memcpy_gbps"] > 0 and bench["device"]["file_read_gbps"] > 0
    for name, target in (("stream_module", 1.10), ("stream_file", 1.15)):
        goal = next(g for g in bench["goals"] if g["name"] == f"{name} vs copy bound (CPU)")
        ratio = next(r for r in bench["rows"] if r["name"] == name)["ratio_to_bound"]
        assert goal["measured"] == f"{ratio:.2f}x" and goal["met"] == (ratio <= target)


def test_ratios_are_exact_for_the_baseline():
    rows = [
        {
            "name": "baseline",
            "group": "baseline",
            "status": "ok",
            "step_ms_median": 3.0,
            "h2d_bytes_per_step": 0.0,
        },
        {
            "name": "stream_file",
            "group": "ours",
            "status": "ok",
            "step_ms_median": 6.0,
            "h2d_bytes_per_step": 2e9,
        },
        {"name": "conductor", "group": "ours", "status": "n/a"},
    ]
    add_ratios(rows, {"h2d_gbps": 1.0})
    assert rows[0]["ratio_to_baseline"] == 1.0
    assert rows[1]["ratio_to_baseline"] == 2.0
    assert rows[1]["bound_ms"] == 2000.0  # 2e9 bytes at 1 GB/s beats 3 ms of compute
    assert rows[1]["ratio_to_bound"] == 6.0 / 2000.0
    assert rows[2]["ratio_to_baseline"] is None
    # CPU: copies and reads do not overlap compute; they add to the baseline.
    # File-backed: read into the slab, copied to the device, plus the spills' D2H bytes.
    rows[1].update(h2d_bytes_per_step=1e9, d2h_bytes_per_step=5e8, file_read_bytes_per_step=1e9)
    add_ratios(rows, {"memcpy_gbps": 1.0, "file_read_gbps": 2.0})
    assert rows[1]["bound_ms"] == 3.0 + 1500.0 + 500.0
    assert rows[1]["ratio_to_bound"] == 6.0 / 2003.0
    # Module-backed: copied from the host masters into the slab, then to the device.
    rows[1].update(d2h_bytes_per_step=0.0, file_read_bytes_per_step=0.0)
    add_ratios(rows, {"memcpy_gbps": 1.0, "file_read_gbps": 2.0})
    assert rows[1]["bound_ms"] == 3.0 + 2000.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scale-blocks", "2,x"], "--scale-blocks expects integers"),
        (["--scale-blocks", "1"], "must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_bad_arguments_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_round_is_compared_with_the_baseline_runs_around_it():
    # Baseline ran before round 1 (10 ms), before round 2 (20 ms: the machine slowed) and
    # once more at the end (30 ms); the row's rounds took 15 and 50 ms.
    rows = [
        {
            "name": "baseline",
            "group": "baseline",
            "status": "ok",
            "step_ms_median": 20.0,
            "run_medians": [10.0, 20.0, 30.0],
        },
        {
            "name": "stream_file",
            "group": "ours",
            "status": "ok",
            "step_ms_median": 30.0,
            "run_medians": [15.0, 50.0],
        },
    ]
    add_ratios(rows, {})
    assert rows[1]["ratio_rounds"] == [15.0 / 15.0, 50.0 / 25.0]
    assert rows[1]["ratio_spread"] == [1.0, 2.0]
    assert rows[0]["ratio_rounds"] is None  # the baseline's own ratio is 1 by definition
    for row in rows:
        row.update(label=row["name"], blocks=9, rss_peak_bytes=0, rss_growth_bytes=0)
    assert "1.00-2.00" in table(rows).splitlines()[2]


def test_copy_time_hidden_behind_kernels_is_the_overlap_of_their_unions():
    copies = [(0.0, 10.0), (5.0, 15.0), (30.0, 40.0)]  # 25 us of copying (the first two overlap)
    kernels = [(8.0, 12.0), (11.0, 32.0), (50.0, 60.0)]  # 8-32 and 50-60
    assert union_us(copies) == 25.0
    assert union_us(kernels) == 34.0
    assert overlap_us(copies, kernels) == 7.0 + 2.0  # 8-15 and 30-32
    assert overlap_us(copies, []) == 0.0
    assert overlap_us([(0.0, 4.0)], [(1.0, 2.0), (1.5, 3.0)]) == 2.0


def test_device_timeline_lists_each_cuda_row():
    row = {
        "name": "stream_file",
        "label": "stream, file-backed",
        "status": "ok",
        "blocks": 9,
        "h2d_achieved_gbps": 21.25,
        "device_timeline": {
            "host_syncs_per_step": 3.5,
            "h2d_copy_ms_per_step": 4.0,
            "h2d_hidden_fraction": 0.875,
        },
    }
    text = timeline_text([row, {"name": "peer", "status": "n/a"}], 25.0)
    assert "peak 25.0 GB/s" in text.splitlines()[0]
    assert text.splitlines()[2].split()[-4:] == ["21.2", "4.00", "88%", "3.5"]
    assert len(text.splitlines()) == 3
