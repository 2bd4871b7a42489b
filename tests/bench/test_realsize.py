"""``workbench bench --model flux-dev --size tiny``: the real-size rows' CPU smoke run.

The tiny size is FLUX.1-dev's config scaled to tiny widths with all 57 blocks, so the block
loads, file reads and Conductor answers per step are the real model's (the H100 run counted
2,188 file reads per step file-backed). Speed is not asserted (figures go in the output).
"""

from __future__ import annotations

import json

import pytest
import torch

from stagehand.config.memory import MB, StagehandConfig
from stagehand.weights.auto import margin_bytes
from stagehand.weights.defaults import block_bytes, resolve
from stagehand.weights.registry import find_blocks
from workbench.bench.cli import main
from workbench.bench.realmodel import (
    CARD_BYTES,
    REAL_MODELS,
    card_section,
    preset_memory,
    real_model,
    section_scale,
)
from workbench.bench.realsize import ROWS, emulate_card, row_memory
from workbench.plan.inventory import add_lora, meta_model
from workbench.plan.profiles import profile


def test_the_real_config_is_flux_dev_and_its_rows_use_the_presets():
    spec = REAL_MODELS["flux-dev"]
    model = meta_model(spec.class_name, spec.model_config("real"), torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 11.90
    assert spec.inputs_shape("real") == ((128, 128), 512)  # 1024 px: 4096 image tokens
    stream = row_memory("stream_file", "flux-dev", "real")["stagehand"]
    assert stream["file_backed"] is True and "conductor_config" not in stream
    # The preset leaves the pipeline settings out: on an H100 the runtime derives them from
    # the bench model's blocks (LoRA r16 on attention: the largest 648.9 MiB).
    add_lora(model, spec.lora_rank, spec.lora_targets)
    sizes = block_bytes(find_blocks(model))
    h100 = profile("h100").vram_bytes
    got = resolve(StagehandConfig(**stream), sizes, cuda=True, vram_bytes=h100, cpus=16)
    assert (got.prefetch_window_blocks, got.max_inflight_transfers) == (2, 4)
    assert (got.pinned_pool_mb, got.pinned_slab_mb) == (5 * 649, 649)
    assert row_memory("stream_module", "flux-dev", "real")["stagehand"]["file_backed"] is False
    preset = row_memory("preset", "flux-dev", "real")["stagehand"]
    assert preset["conductor_config"]["vram_soft_cap_mb"] == "auto"  # resolved on the card
    # A tiny row has no card: its "auto" figures are a 24 GiB card's, scaled (soft cap: the
    # card less the 1 GiB + 5% margin, NOTE [ Who gives way ]).
    tiny = row_memory("preset", "flux-dev", "tiny")["stagehand"]["conductor_config"]
    soft = (CARD_BYTES - margin_bytes(CARD_BYTES, cuda=True)) / MB
    assert tiny["vram_soft_cap_mb"] == pytest.approx(soft * section_scale(spec, "tiny"))
    assert row_memory("layer_offload_0.9", "flux-dev", "real")["layer_offload_fraction"] == 0.9
    # An emulated card (--card-gb): the real-size rows' "auto" is resolved for it, in MB, the
    # rule's own figures (no scaling); a bigger card keeps more.
    for name in ("preset", "stream_file"):
        card24 = row_memory(name, "flux-dev", "real", card_bytes=24 * 2**30)["stagehand"]
        card80 = row_memory(name, "flux-dev", "real", card_bytes=80 * 2**30)["stagehand"]
        assert card24["vram_high_watermark_mb"] < card80["vram_high_watermark_mb"]
        assert card24["vram_low_watermark_mb"] < card24["vram_high_watermark_mb"] < 24 * 1024
    card24 = row_memory("preset", "flux-dev", "real", card_bytes=CARD_BYTES)["stagehand"]
    soft24 = (CARD_BYTES - margin_bytes(CARD_BYTES, cuda=True)) / MB
    assert card24["conductor_config"]["vram_soft_cap_mb"] == pytest.approx(soft24)
    with pytest.raises(ValueError, match="real-size rows are"):
        row_memory("nope", "flux-dev", "real")
    with pytest.raises(ValueError, match="--model must be one of"):
        real_model("flux-9")


def test_tiny_real_size_rows_run_every_strategy(flux_dev_tiny_run):
    """Every row of the session's tiny bench run (``conftest.flux_dev_tiny_run``: on an emulated
    24 GiB card, which on the CPU is the card a tiny row's sections are resolved for anyway)."""
    assert flux_dev_tiny_run["code"] == 0
    result = flux_dev_tiny_run["result"]
    assert result["kind"] == "bench_realsize" and result["size"] == "tiny"
    # The folder was built before this run (``conftest.flux_dev_tiny``): the run reuses it.
    assert result["build"]["reused"] is True
    probe = result["probe"]
    assert probe["memcpy_gbps"] > 0
    assert all(probe[f"pagecache_to_host_{t}t_gbps"] > 0 for t in (1, 4, 8))
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == list(ROWS) and all(r["status"] == "ok" for r in rows.values())
    resident = rows["resident"]
    assert resident["counters"]["blocks_loaded"] == 0 and resident["x_resident"] == 1.0
    for name in (
        "stream_file",
        "stream_file_int8",
        "stream_file_fp8",
        "stream_module",
        "preset",
        "stream_half",
    ):
        c = rows[name]["counters"]
        # Of 57 blocks (110 loads a step when every block moved twice), those the scaled 24 GB
        # budget keeps stay: fewer loads, all prefetched.
        assert 0 < c["blocks_loaded"] < 110 and c["prefetch_misses"] == 0
        assert 0 < c["resident_blocks"] < 57 and rows[name]["h2d_bytes_per_step"] > 0
    assert rows["stream_file"]["counters"]["file_reads"] > 0
    # SquareQ: the same loads, in 8 bits (<= 0.56x at tiny widths: a 64-wide row's fp32 scale
    # weighs more than at real size), and a loss within 5% of the bf16 row's.
    plain = rows["stream_file"]
    for name in ("stream_file_int8", "stream_file_fp8"):
        row = rows[name]
        assert row["counters"]["blocks_loaded"] == plain["counters"]["blocks_loaded"]
        assert row["counters"]["file_reads"] == plain["counters"]["file_reads"]
        assert row["h2d_bytes_per_step"] <= 0.56 * plain["h2d_bytes_per_step"]
        assert row["host_image_bytes"] <= 0.56 * plain["host_image_bytes"]
        assert abs(row["loss"] - plain["loss"]) <= 0.05 * abs(plain["loss"])
        assert row["squareq"]["quantized_layers"] > 0 and row["squareq"]["worst_layer"]
    assert rows["stream_module"]["counters"]["file_reads"] == 0
    assert rows["preset"]["counters"]["denials"] == 0  # the section has room
    assert rows["preset"]["counters"]["grants"] >= rows["preset"]["counters"]["blocks_loaded"]
    # A budget for half the blocks' bytes: a steady step moves 2 x the bytes over it, within
    # the granularity of a block (NOTE [ Eviction policy ]).
    half = rows["stream_half"]
    assert abs(half["h2d_bytes_per_step"] / half["h2d_expected_bytes"] - 1) <= 0.05
    # The planner given that budget (the row's section as it ran, its watermarks the runtime's):
    # the row's block loads, and its H2D bytes within 5%. Not vacuous: half the blocks do not
    # fit, so the step loads more blocks than the model's 19 double-stream blocks.
    ran = half["memory_config"]["stagehand"]
    plan, c = half["plan"], half["counters"]
    marks = [ran["vram_high_watermark_mb"], ran["vram_low_watermark_mb"]]
    assert plan["watermarks_mb"] == [round(m, 3) for m in marks]
    double_stream = REAL_MODELS["flux-dev"].model_config("tiny")["num_layers"]
    assert plan["block_loads_per_step"] == c["blocks_loaded"] > double_stream
    assert abs(plan["h2d_bytes_per_step"] / c["h2d_bytes"] - 1) <= 0.05
    offload = rows["layer_offload_0.9"]["counters"]
    # 51 offloaded blocks, each loaded and evicted at its forward and at its backward use, as
    # the synchronous mode does: async changes when copies happen, never what is offloaded
    # (NOTE [ Layer-order window ]; it kept the block at each turn, 2 x 51 - 2, before).
    assert offload["blocks_loaded"] == 2 * 51 and offload["pageable_copies"] == 0
    assert offload["blocks_evicted"] == 2 * 51
    assert offload["blocks_loaded"] == rows["layer_offload_0.9"]["plan"]["block_loads_per_step"]
    for row in rows.values():
        assert row["bound_ms"] >= resident["step_ms_median"]
        assert row["x_bound"] == pytest.approx(row["step_ms_median"] / row["bound_ms"])
        assert row["attention"]["device"] == "cpu"
        assert row["plan"]["step_ms"] > 0  # the planner's prediction beside the measurement
    printed = flux_dev_tiny_run["printed"]
    assert "layer_offload_0.9" in printed and "x bound" in printed


@pytest.mark.realsize_rows("stream_file", "preset")
def test_a_tiny_card_row_moves_what_the_plan_predicts(flux_dev_tiny_run):
    """``--size tiny --device cpu --card-gb 24 --only stream_file,preset`` (the session's run,
    ``conftest.flux_dev_tiny_run``, which has these rows): each row runs the
    section the planner resolves for the real model (scaled to the tiny blocks) and its measured
    step (the third: warm-up 2) has the blocks on the device, loads, H2D bytes and misses the
    planner's simulation of that section on the tiny model predicts for the same step. The
    preset row (streaming + activation spill + the Conductor) planned 42 loads and 7,827,456 B
    against the run's 41 and 7,522,304 before the plan counted activations as the run does
    (``tests/bench/test_preset_plan_exact.py`` checks it step by step)."""
    assert flux_dev_tiny_run["code"] == 0
    result = flux_dev_tiny_run["result"]
    assert result["card_gb"] == 24 and (result["steps"], result["warmup"]) == (1, 2)
    rows = {r["name"]: r for r in result["rows"]}
    spec = REAL_MODELS["flux-dev"]
    real = card_section(spec, preset_memory(spec.preset), CARD_BYTES)["stagehand"]
    scale = section_scale(spec, "tiny")
    for name in ("stream_file", "preset"):
        row, plan = rows[name], rows[name]["plan"]
        section = row["memory_config"]["stagehand"]
        assert section["vram_high_watermark_mb"] == pytest.approx(
            real["vram_high_watermark_mb"] * scale
        )
        assert plan["watermarks_mb"] == [
            round(section["vram_high_watermark_mb"], 3),
            round(section["vram_low_watermark_mb"], 3),
        ]
        c = row["counters"]
        assert 0 < c["blocks_loaded"] < 110 and 0 < c["resident_blocks"] < 57  # not vacuous
        assert c["blocks_loaded"] == plan["block_loads_per_step"], name
        assert row["h2d_bytes_per_step"] == plan["h2d_bytes_per_step"], name
        assert c["resident_blocks"] == plan["on_device_blocks"], name
        assert c["prefetch_misses"] == plan["misses_per_step"] == 0
        assert plan["streamed_blocks"] + plan["resident_blocks"] == 57 and plan["step_ms"] > 0
    assert rows["preset"]["h2d_bytes_per_step"] == 7_522_304  # spill_bytes 0: no spill here
    assert rows["preset"]["counters"]["grants"] == 41  # the Conductor granted every prefetch
    assert rows["resident"]["plan"]["block_loads_per_step"] == 0


def test_a_tiny_run_builds_the_weights_its_folder_lacks(tmp_path):
    """Without ``--card-gb``, in an empty folder: the run builds the weights (a later run
    reuses them: ``test_tiny_real_size_rows_run_every_strategy``) and its rows resolve each
    section for the 24 GiB card the session's shared run emulates."""
    out = tmp_path / "realsize.json"
    argv = ["--model", "flux-dev", "--size", "tiny", "--folder", str(tmp_path / "w")]
    argv += ["--device", "cpu", "--steps", "1", "--warmup", "2", "--out", str(out)]
    assert main([*argv, "--only", "resident"]) == 0
    result = json.loads(out.read_text())
    assert result["build"]["params"] > 0 and not result["build"]["reused"]
    assert [r["status"] for r in result["rows"]] == ["ok"] and result["card_gb"] is None
    for name in ROWS:
        card = row_memory(name, "flux-dev", "tiny", card_bytes=CARD_BYTES)
        assert row_memory(name, "flux-dev", "tiny") == card, name


@pytest.mark.parametrize(("device", "index"), [("cuda", 1), ("cuda:3", 3)])
def test_card_gb_caps_the_allocator_of_a_device_with_or_without_an_index(
    monkeypatch, device, index
):
    """``--card-gb`` through torch's own ``set_per_process_memory_fraction`` (its device-index
    check included) on a fake CUDA device of 141 GB whose current index is 1: a bare ``cuda``
    crashed there on a GPU, the fraction must reach the allocator for the right index."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    props = type("Props", (), {"total_memory": 141 * 10**9})
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: calls.append(("props", i)) or props
    )
    monkeypatch.setattr(
        torch._C, "_cuda_setMemoryFraction", lambda f, i: calls.append((f, i)), raising=False
    )
    fraction = emulate_card(torch.device(device), CARD_BYTES)
    assert fraction == CARD_BYTES / (141 * 10**9)
    assert calls == [("props", index), (fraction, index)]
    assert emulate_card(torch.device(device), 200 * 10**9) == 1.0  # a card larger than the device
